"""One HTTP service of the stack: keep it when it already answers, else start it detached and wait for it."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from flows.stack.procs import StackError, http_ok, is_ours, port_open, spawn, stop, wait_until
from flows.stack.state import PartState, part_up


def bin_path(name: str) -> str:
    """A console script of the environment shardline runs in (prefect, mlflow), not whatever PATH finds first."""
    exe = Path(sys.executable).with_name(name)
    return str(exe) if exe.exists() else name


def service_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment with telemetry off, this interpreter's bin first on PATH, and `extra`."""
    env = {
        **os.environ,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "RAY_USAGE_STATS_ENABLED": "0",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def comes_up(part: PartState, timeout_s: float) -> bool:
    """Whether a recorded part is up, or comes up within `timeout_s` while the processes this stack started for it
    run: a server that is merely slow (a loaded machine, a Prometheus loading its TSDB) is waited for as a new one
    would be, not taken for hung and stopped, which broke every run connected to it."""
    if part_up(part):
        return True
    if not (part.started_by_us and part.procs and all(is_ours(p) for p in part.procs)):
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and all(is_ours(p) for p in part.procs):
        time.sleep(0.5)
        if part_up(part):
            return True
    return False


def ensure_service(
    name: str,
    recorded: PartState | None,
    url: str,
    health_url: str,
    host: str,
    port: int,
    argv: list[str],
    env: dict[str, str],
    log_dir: Path,
    timeout_s: float,
    detail: dict[str, str] | None = None,
) -> PartState:
    """Return the part as running: the recorded one if it answers at `url`, one already answering on the port
    (kept, and marked not ours so `down` leaves it), or a new process started here and waited for. A recorded part
    that is not kept (at another URL, or failing its health check) is stopped first when this stack started it.

    Raises:
        StackError: the port is taken by something that does not answer like this service, or it did not start.
    """
    detail = {**(detail or {}), "health_url": health_url}
    if recorded is not None and recorded.url == url and comes_up(recorded, timeout_s):
        return recorded
    if recorded is not None:
        # moved to another port or host, or hung (alive, not answering): the old server of this stack is not left
        # running unrecorded once its replacement is recorded, nor kept listening where the config no longer says
        # (a 0.0.0.0 one answers on 127.0.0.1 too), nor left holding the port its replacement needs.
        # stop_part stops only processes this stack started and that are still the ones it recorded.
        stop_part(recorded)
    if http_ok(health_url):
        return PartState(name=name, url=url, port=port, started_by_us=False, detail=detail)
    if port_open(host, port):
        raise StackError(
            f"{name}: port {host}:{port} is taken by something that is not a {name} server; choose another port"
        )
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = spawn(name, argv, env, log_dir)
    part = PartState(
        name=name,
        url=url,
        port=port,
        procs=[proc],
        started_by_us=True,
        detail={**detail, "log": str(log_dir / f"{name}.log")},
    )
    try:
        wait_until(name, lambda: http_ok(health_url), timeout_s, proc, log_dir / f"{name}.log")
    except BaseException:  # Ctrl-C too: the part is recorded only once this returns, so stop it here
        stop(proc)  # nothing half-started is left behind
        raise
    return part


def stop_part(part: PartState) -> bool:
    """Stop the processes `up` recorded for this part, and only if `up` started them; True if any was running."""
    if not part.started_by_us:
        return False
    return any([stop(p) for p in part.procs])
