"""Process helpers of the tests, on infra.process (psutil; a process is its pid and start time): find a tree, kill it
at once as an OOM killer or a lost node would, tell whether a process still runs. One reading of /proc for the tests
as for shardline; tests/processes/test_process.py checks that reading against /proc/PID/stat read by hand."""

from __future__ import annotations

import os
import signal

from infra import process
from infra.process import ProcessInfo


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie has stopped running)."""
    return process.inspect(pid) is not None


def _tree_pids(pid: int) -> list[int]:
    """`pid` first, then every live process below it (whatever session or process group it moved to)."""
    return sorted(process.descendants([pid]), key=lambda p: p != pid)


def tree(pid: int) -> list[ProcessInfo]:
    """The processes of `_tree_pids(pid)` as read now, to be killed later only while each is still the one read."""
    return [info for p in _tree_pids(pid) if (info := process.inspect(p))]


def group_members(pgid: int) -> set[int]:
    """Every live process of the process group `pgid` (a server's worker processes, a worker's flow runs)."""
    return {info.pid for info in process.processes() if info.pgid == pgid}


def _sigkill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill(infos: list[ProcessInfo]) -> None:
    """SIGKILL each of `infos` (read earlier) that is still the process read: its pid was not handed on since."""
    _sigkill([info.pid for info in infos if process.is_same(info.pid, info.start_ticks)])


def kill_tree(pid: int) -> list[int]:
    """SIGKILL `pid` and all its descendants at once, the parent first (so it starts nothing more); their PIDs.
    The tree was read just before, so no identity check sits between the signals."""
    pids = _tree_pids(pid)
    _sigkill(pids)
    return pids
