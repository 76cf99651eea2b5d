"""Detached service processes: start in their own process group, wait until they answer, stop by recorded PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from infra import process


class StackError(RuntimeError):
    """A part of the stack could not start, answer or stop; the message names the part and says why."""


class Proc(BaseModel):
    """A process `up` started: its PID (also its process-group id) and its start time, so that a PID reused by
    another program after a reboot or a crash is never signalled."""

    pid: int
    start_ticks: int


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (infra.process), or None if gone."""
    info = process.inspect(pid)
    return None if info is None else info.start_ticks


def is_ours(proc: Proc) -> bool:
    """True while the recorded process is alive and is the very process `up` started."""
    return process.is_same(proc.pid, proc.start_ticks)


def spawn(name: str, argv: list[str], env: dict[str, str], log_dir: Path, cwd: Path | None = None) -> Proc:
    """Start `argv` detached (own session, so it outlives this command), output to `log_dir/name.log`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{name}.log", "ab") as log:
        popen = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    ticks = _start_ticks(popen.pid)
    if ticks is None:
        raise StackError(f"{name}: exited at once; see {log_dir / f'{name}.log'}")
    return Proc(pid=popen.pid, start_ticks=ticks)


def stop(proc: Proc, grace_s: float = 15.0) -> bool:
    """SIGTERM the process group `spawn` created, SIGKILL what is left after `grace_s`; True if it was running.

    Only the recorded group is signalled, and only while its leader is still the recorded process, or, once the
    leader died, while processes it started are left in its group (a killed `mlflow server` leaves its workers).
    """
    if not is_ours(proc) and not _orphans(proc):
        return False
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _group_alive(proc.pid):
                _reap(proc.pid)
                return True
            time.sleep(0.2)
    return True


def _orphans(proc: Proc) -> list[process.ProcessInfo]:
    """Live members of the recorded group whose leader is gone. The kernel hands out no PID still in use as a group
    id, so such a group is the one `spawn` created; a start before the leader's would be an older, other group."""
    if process.inspect(proc.pid) is not None:  # the leader runs, or the PID went to another process
        return []
    return [p for p in process.processes() if p.pgid == proc.pid and p.start_ticks >= proc.start_ticks]


def _group_alive(pgid: int) -> bool:
    return any(p.pgid == pgid for p in process.processes())


def _reap(pid: int) -> None:
    """Collect the exit status when the leader is our own child (started in this process), so it leaves no zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def port_open(host: str, port: int) -> bool:
    """True if something accepts TCP connections on host:port."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True if GET `url` answers 2xx."""
    import httpx

    try:
        return httpx.get(url, timeout=timeout_s).is_success
    except httpx.HTTPError:
        return False


def wait_until(name: str, check: Callable[[], bool], timeout_s: float, proc: Proc | None, log: Path) -> None:
    """Poll `check` until it is true; fail early if the process died, late after `timeout_s`.

    Raises:
        StackError: naming the part, the cause and the log file.
    """
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc is not None and not is_ours(proc):
            raise StackError(f"{name}: exited while starting; last log lines:\n{tail(log)}")
        if time.monotonic() > deadline:
            raise StackError(f"{name}: did not answer within {timeout_s:.0f} s; last log lines:\n{tail(log)}")
        time.sleep(0.5)


def tail(path: Path, lines: int = 8) -> str:
    """The last lines of a log file, for error messages."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"
