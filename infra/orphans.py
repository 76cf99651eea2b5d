"""Processes a killed run leaves behind, found by what that run recorded, never by name.

The flow records the child processes of its own process when it starts (with the embedded default that is
Prefect's temporary API server) under $SHARDLINE_HOME/runs/<pid>.json. A later `shardline run` stops the
recorded processes of every owner that is no longer alive, but only those whose PID still belongs to the same
process (same start time, infra.process), so a recycled PID is never touched. The command line is kept for people
reading the record, not compared, so records written by earlier versions match as they did. Ray processes that
`ray.init` starts share the driver's fate and need no record; a long-lived Ray head is meant to outlive runs.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from infra import process
from infra.paths import shardline_home

log = logging.getLogger(__name__)


def _entry(info: process.ProcessInfo) -> dict:
    """What a record holds of a process: {"pid", "start" (clock ticks since boot), "cmdline"}."""
    return {"pid": info.pid, "start": info.start_ticks, "cmdline": " ".join(info.cmdline)[:300]}


def _identity(pid: int) -> dict | None:
    """The record entry of the live process `pid`; None if there is none."""
    info = process.inspect(pid)
    return None if info is None else _entry(info)


def _still(recorded: dict) -> bool:
    """True while the recorded process runs: same pid, same start time."""
    try:
        return process.is_same(int(recorded.get("pid", 0)), recorded["start"])
    except (KeyError, TypeError, ValueError):
        return False


def _records_dir() -> Path:
    d = shardline_home() / "runs"
    d.mkdir(parents=True, exist_ok=True)
    return d


def record_children() -> Path | None:
    """Record this process and its current children (Linux); return the record file (None off Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    me = os.getpid()
    children = [_entry(p) for p in process.processes() if p.ppid == me]
    path = _records_dir() / f"{me}.json"
    path.write_text(json.dumps({"owner": _identity(me), "children": children}), encoding="utf-8")
    return path


def forget() -> None:
    """Drop this process's record (a run that ends normally has stopped its children itself)."""
    (_records_dir() / f"{os.getpid()}.json").unlink(missing_ok=True)


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
        if _still(owner):
            continue  # the run is still alive
        victims = [c["pid"] for c in body.get("children", []) if _still(c)]
        reaped += victims
        if victims:
            log.warning("stopping processes %s left by a killed run (pid %s)", victims, owner.get("pid"))
        process.terminate(victims, wait_s)
        path.unlink(missing_ok=True)
    return reaped
