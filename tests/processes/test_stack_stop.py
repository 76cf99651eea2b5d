"""`down` of the local stack with real short-lived processes standing in for its servers: it never starts a Ray
head, stops every part it can, stops only the Ray head `up` started, and stops a process group whose leader died.
Nothing here starts Prefect, MLflow or Ray."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from support.stack_procs import gone

from flows.cli.root import main
from flows.config import load_stack_config
from flows.stack import endpoint, ray_head
from flows.stack.procs import Proc, is_ours, spawn, stop
from flows.stack.state import PartState, StackState, read_state, state_path, write_state
from infra import head, process
from infra.config import ClusterConfig
from infra.ray_env import ClusterError

ENSURE_HEAD = head.ensure_head  # before `home` replaces it


# ---- `down` never starts a Ray head and stops every part it can (stack.down, endpoint.stop) ------------------------


def _record_stack(home: Path, spawned) -> dict[str, Proc]:
    servers = {name: spawned(["sleep", "30"]) for name in ("prefect", "mlflow", "worker")}
    parts = {name: PartState(name=name, procs=[p], started_by_us=True) for name, p in servers.items()}
    parts["ray"] = PartState(name="ray", url="http://127.0.0.1:8265", started_by_us=False)
    parts["endpoint"] = PartState(name="endpoint", url="http://127.0.0.1:8000", started_by_us=True)
    write_state(StackState(home=str(home), parts=parts))
    return servers


def test_stopping_the_endpoint_without_a_running_head_starts_none(home):
    _, config = load_stack_config(None, [])
    part = PartState(name="endpoint", url="http://127.0.0.1:8000", started_by_us=True)
    assert endpoint.stop(part, config) is False  # `home`'s guard fails the test if provision starts a head


def test_down_without_a_head_stops_every_other_part(home, spawned, capsys):
    servers = _record_stack(home, spawned)
    assert main(["down"]) == 0
    assert all(gone(p) for p in servers.values())
    assert not state_path().exists()
    assert "endpoint  was not running" in capsys.readouterr().out
    assert main(["status"]) == 1  # nothing is up: a script's `shardline status && ...` must not go on
    assert "no stack is recorded here" in capsys.readouterr().out


def test_down_goes_on_after_a_part_fails_and_exits_non_zero(home, spawned, capsys, monkeypatch):
    servers = _record_stack(home, spawned)

    def fails(part, config):
        raise ClusterError("ray start failed: no memory for the object store\n(Ray's last lines)")

    monkeypatch.setattr(endpoint, "stop", fails)
    assert main(["down"]) == 1
    out, err = capsys.readouterr()
    assert all(gone(p) for p in servers.values())  # Prefect, MLflow, worker: stopped all the same
    assert "endpoint  could not be stopped: ClusterError: ray start failed: no memory" in out
    assert "Ray's last lines" not in out  # one line
    assert "could not stop endpoint" in err
    state = read_state()
    assert state is not None and list(state.parts) == ["endpoint"]  # kept for the next `down`


# ---- `down` stops only the Ray head `up` started (ray_head.stop) ---------------------------------------------------


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "30"])
    deadline = time.monotonic() + 5  # until it has exec'd, /proc shows Python's start time and command line
    while Path(f"/proc/{proc.pid}/cmdline").read_bytes() != b"sleep\x0030\x00" and time.monotonic() < deadline:
        time.sleep(0.01)
    yield proc
    proc.kill()
    proc.wait()


def _write_head(pid: int, gcs_address: str = "127.0.0.1:1") -> Path:
    info = process.inspect(pid)
    assert info is not None and info.cmdline == ("sleep", "30"), info  # the sleeper, exec'd
    record = head._record()
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(
        head.HeadInfo(
            gcs_address=gcs_address,
            dashboard_url="http://127.0.0.1:2",
            pids=[pid],
            start_ticks=[info.start_ticks],
            host="127.0.0.1",
            num_cpus=1,
            started_at=0.0,
        ).model_dump_json()
    )
    return record


def test_down_leaves_a_head_that_replaced_the_one_up_started(home, sleeper):
    gone = subprocess.Popen(["sleep", "30"])  # head A, which `up` recorded, then died
    ticks = process.inspect(gone.pid).start_ticks
    gone.kill()
    gone.wait()
    record = _write_head(sleeper.pid)  # head B, which a later `shardline run` started and recorded
    part = PartState(name="ray", procs=[Proc(pid=gone.pid, start_ticks=ticks)], started_by_us=True)
    assert ray_head.stop(part) is False
    time.sleep(0.2)
    assert sleeper.poll() is None and json.loads(record.read_text())["pids"] == [sleeper.pid]


def test_a_second_up_leaves_a_head_that_replaced_the_one_up_started_to_its_owner(home, sleeper, monkeypatch):
    """The second `up` recorded the `shardline run`'s head as started by the stack, and `down` then stopped it."""
    monkeypatch.setattr(head, "ensure_head", ENSURE_HEAD)  # reuses a recorded head; `ray start` stays guarded
    gone = subprocess.Popen(["sleep", "30"])  # head A, which `up` recorded, then died
    ticks = process.inspect(gone.pid).start_ticks
    gone.kill()
    gone.wait()
    with socket.socket() as gcs:  # head B's GCS answers, so infra.head reuses B and starts none
        gcs.bind(("127.0.0.1", 0))
        gcs.listen()
        _write_head(sleeper.pid, f"127.0.0.1:{gcs.getsockname()[1]}")
        recorded = PartState(name="ray", procs=[Proc(pid=gone.pid, start_ticks=ticks)], started_by_us=True)
        part = ray_head.start(ClusterConfig(), recorded)
        assert [p.pid for p in part.procs] == [sleeper.pid] and part.started_by_us is False
        assert ray_head.stop(part) is False
        b = Proc(pid=sleeper.pid, start_ticks=process.inspect(sleeper.pid).start_ticks)
        ours = PartState(name="ray", procs=[b], started_by_us=True)  # the head `up` started, still running
        assert ray_head.start(ClusterConfig(), ours).started_by_us is True
    time.sleep(0.2)
    assert sleeper.poll() is None


def test_down_stops_the_head_up_started(home, sleeper):
    record = _write_head(sleeper.pid)
    ticks = process.inspect(sleeper.pid).start_ticks
    part = PartState(name="ray", procs=[Proc(pid=sleeper.pid, start_ticks=ticks)], started_by_us=True)
    assert ray_head.stop(part) is True
    assert sleeper.wait(timeout=5) is not None and not record.exists()


# ---- a group whose leader died is still stopped (procs.stop) ------------------------------------------------------


def _group(pgid: int) -> list[int]:
    return [p.pid for p in process.processes() if p.pgid == pgid]


@pytest.fixture
def orphaned(tmp_path: Path):
    """A spawned group whose leader (a shell) exited and left its child `sleep` running, as a killed `mlflow server`
    leaves its workers; that child is killed at the end whatever the test did."""
    proc = spawn("orphans", ["sh", "-c", "sleep 30 & exec sleep 0.2"], dict(os.environ), tmp_path / "logs")
    os.waitpid(proc.pid, 0)  # the leader exits; reaped as init reaps it for `up`
    deadline = time.monotonic() + 5
    while not _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    members = [p for p in process.processes() if p.pgid == proc.pid]
    yield proc
    for member in members:  # only the very processes started here
        if process.is_same(member.pid, member.start_ticks):
            os.kill(member.pid, 9)


def test_stop_signals_the_group_whose_leader_died(orphaned):
    assert not is_ours(orphaned) and len(_group(orphaned.pid)) == 1  # the sleep the shell started
    assert stop(orphaned, grace_s=3.0) is True
    assert _group(orphaned.pid) == []


def test_stop_leaves_a_group_older_than_the_recorded_leader(orphaned):
    members = _group(orphaned.pid)
    later = Proc(pid=orphaned.pid, start_ticks=orphaned.start_ticks + 10**9)  # a record of a later process
    assert stop(later, grace_s=1.0) is False
    assert _group(orphaned.pid) == members
