"""Processes a killed run leaves behind, found by what that run recorded, never by name.

The flow records the child processes of its own process when it starts (with the embedded default that is
Prefect's temporary API server) under $SHARDLINE_HOME/runs/<pid>.json. A later `shardline run` stops the
recorded processes of every owner that is no longer alive, but only those whose PID still belongs to the same
process (same start time and command line), so a recycled PID is never touched. Ray processes that `ray.init`
starts share the driver's fate and need no record; a long-lived Ray head is meant to outlive runs.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from infra.paths import shardline_home

log = logging.getLogger(__name__)


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time in clock ticks) of a live process; None when there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        return ""


def _identity(pid: int) -> dict | None:
    st = _stat(pid)
    if st is None or st[1] == "Z":
        return None
    return {"pid": pid, "start": st[2], "cmdline": _cmdline(pid)}


def _records_dir() -> Path:
    d = shardline_home() / "runs"
    d.mkdir(parents=True, exist_ok=True)
    return d


def record_children() -> Path | None:
    """Record this process and its current children (Linux); return the record file (None off Linux)."""
    if not Path("/proc/self/stat").exists():
        return None
    me = os.getpid()
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None and st[0] == me:
                ident = _identity(int(entry.name))
                if ident:
                    children.append(ident)
    path = _records_dir() / f"{me}.json"
    path.write_text(json.dumps({"owner": _identity(me), "children": children}), encoding="utf-8")
    return path


def forget() -> None:
    """Drop this process's record (a run that ends normally has stopped its children itself)."""
    (_records_dir() / f"{os.getpid()}.json").unlink(missing_ok=True)


def terminate(pids: list[int], alive: Callable[[int], bool], wait_s: float = 5.0) -> None:
    """SIGTERM `pids`, wait up to wait_s for them to go, then SIGKILL what is left (and wait again)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if alive(p)]
            time.sleep(0.1)
        if not pids:
            return


def reap_orphans(wait_s: float = 5.0) -> list[int]:
    """Stop the recorded children of owners that died; return the PIDs that were signalled."""
    reaped: list[int] = []
    for path in sorted(_records_dir().glob("*.json")):
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        owner = body.get("owner") or {}
        if _identity(int(owner.get("pid", 0))) == owner:
            continue  # the run is still alive
        victims = [c["pid"] for c in body.get("children", []) if _identity(int(c["pid"])) == c]
        reaped += victims
        if victims:
            log.warning("stopping processes %s left by a killed run (pid %s)", victims, owner.get("pid"))
        terminate(victims, lambda p: _identity(p) is not None, wait_s)
        path.unlink(missing_ok=True)
    return reaped
