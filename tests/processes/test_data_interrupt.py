"""Ctrl-C during a parallel data stage: a terminal sends it to the whole process group; the chunk workers ignore it
(no traceback of their own, no BrokenProcessPool racing the parent's KeyboardInterrupt), and the parent, which
handles it, stops them at once instead of waiting for their chunks."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from training.data.engine import LocalPool


def _ignores_sigint(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << 1))  # bit 1: SIGINT (2)
    raise AssertionError(f"no SigIgn in /proc/{pid}/status")


def test_chunk_workers_ignore_ctrl_c_and_an_interrupted_parent_stops_them():
    pool = LocalPool(2, 1 << 20)
    with pytest.raises(KeyboardInterrupt):
        with pool:
            executor = pool.executor()
            workers = [psutil.Process(pid) for pid in executor._processes]  # noqa: SLF001 - the pool's own children
            assert len(workers) == 2 and all(_ignores_sigint(w.pid) for w in workers)
            raise KeyboardInterrupt
    deadline = time.monotonic() + 10
    while any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers):
        assert time.monotonic() < deadline, "the workers outlived the interrupted pool"
        time.sleep(0.05)


def test_a_pool_built_off_the_main_thread_leaves_ctrl_c_to_its_workers():
    """In `shardline run` the data stage runs on a Prefect task's thread: the KeyboardInterrupt goes to the main
    thread, which cannot stop this pool, so its workers keep Ctrl-C and die of it (which stops the stage)."""
    import threading

    found: list[bool] = []

    def build() -> None:
        with LocalPool(2, 1 << 20) as pool:
            found.extend(_ignores_sigint(pid) for pid in pool.executor()._processes)  # noqa: SLF001

    thread = threading.Thread(target=build)
    thread.start()
    thread.join(timeout=60)
    assert found == [False, False]
