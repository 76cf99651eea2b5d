"""The embedded release lock (a file lock beside the SQLite store) excludes across processes, per model."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from deployments.release_lock import LockTimeout, release_lock
from flows.log_hygiene import is_expected


@pytest.fixture(autouse=True)
def _embedded(monkeypatch, tmp_path):
    # a configured Prefect server would select the Prefect lock; the spawned children inherit this environment
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))


def _hold(model: str, uri: str, record: str, seconds: float, start: object) -> None:
    """Child process: take the lock, record when it held it (monotonic clock, shared by all processes)."""
    start.wait(60)  # all children ask at once, so without exclusion they would overlap
    with release_lock(model, uri, 30):
        entered = time.monotonic()
        time.sleep(seconds)
        left = time.monotonic()
    Path(record).write_text(f"{entered} {left}")


def _hold_until(model: str, uri: str, held: object, release: object) -> None:
    with release_lock(model, uri, 30):
        held.set()
        release.wait(30)


def test_the_file_lock_excludes_across_processes(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    ctx = multiprocessing.get_context("spawn")
    records = [tmp_path / f"holder-{i}.txt" for i in range(3)]
    start = ctx.Barrier(3)
    procs = [ctx.Process(target=_hold, args=("m", uri, str(r), 0.3, start)) for r in records]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    intervals = sorted(tuple(map(float, r.read_text().split())) for r in records)
    assert all(left - entered >= 0.29 for entered, left in intervals)
    for (_, left), (entered, _) in zip(intervals, intervals[1:], strict=False):
        assert entered >= left, f"two holders overlapped: {intervals}"
    assert (tmp_path / "mlflow.db.release-m.lock").exists()  # beside the store it guards


def test_a_lock_held_elsewhere_times_out(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    ctx = multiprocessing.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_until, args=("my/model", uri, held, release))
    holder.start()
    try:
        assert held.wait(60)
        with pytest.raises(
            LockTimeout,
            match=r"release lock .*release-my-model\.lock of model 'my/model' still held after 0\.2 s: another "
            r"release of 'my/model' is still running \(its canary may be paused or awaiting approval: `shardline "
            r"canary status --model my/model`\); let it finish, abort it, or raise canary\.lock_timeout_s$",
        ) as timed_out:
            with release_lock("my/model", uri, 0.2):
                pytest.fail("entered a lock another process holds")
        assert is_expected(timed_out.value)  # the operator's to resolve: one line in the logs, no traceback
        # another model's release is not blocked by it
        with release_lock("other", uri, 0.2) as what:
            assert what == f"file lock {tmp_path}/mlflow.db.release-other.lock"
    finally:
        release.set()
        holder.join(timeout=30)
    assert holder.exitcode == 0
    with release_lock("my/model", uri, 5):  # freed when its holder left
        pass


def test_the_lock_is_free_again_after_the_block_and_after_an_error(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with pytest.raises(RuntimeError, match="boom"):
        with release_lock("m", uri, 1):
            raise RuntimeError("boom")
    with release_lock("m", uri, 0.2):
        with pytest.raises(LockTimeout):  # a second open file in the same process is excluded too
            with release_lock("m", uri, 0.2):
                pass


def test_a_tracking_server_locks_under_shardline_home(tmp_path):
    with release_lock("m", "http://127.0.0.1:5000", 1) as what:
        assert what == f"file lock {tmp_path}/home/locks/release-m.lock"
        with pytest.raises(LockTimeout):
            with release_lock("m", "http://127.0.0.1:5000", 0.2):
                pass
