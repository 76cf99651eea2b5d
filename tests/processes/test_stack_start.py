"""What a second `up` does with each part it recorded, with real short-lived processes standing in for the servers
(`sleep`, Python's http.server): an interrupted start leaves nothing running, a part moved to another port or host
is stopped, a hung server is replaced and a slow one waited for, a Prometheus `up` started is never forgotten.
Nothing here starts Prefect, MLflow or Ray."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.stack_procs import free_port, gone, http_server

import flows.stack.service as service
import flows.stack.worker as worker
from flows.cli.root import main
from flows.config import load_stack_config
from flows.stack import prometheus, stack
from flows.stack.config import StackConfig
from flows.stack.procs import is_ours
from flows.stack.state import PartState, StackState, read_state, write_state

# ---- an interrupted start stops what it spawned (service.ensure_service, worker.start) -----------------------------


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_wait_for_a_service_stops_the_process_it_started(error, spawned, tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setattr(service, "spawn", lambda name, argv, env, log_dir: spawned(["sleep", "30"]))

    def interrupted(*args, **kwargs):
        assert is_ours(spawned.all[0])  # the server is running when the operator presses Ctrl-C
        raise error

    monkeypatch.setattr(service, "wait_until", interrupted)
    with pytest.raises(error):
        service.ensure_service(
            "prefect",
            None,
            f"http://127.0.0.1:{port}/api",
            f"http://127.0.0.1:{port}/api/health",
            "127.0.0.1",
            port,
            ["prefect", "server", "start"],
            dict(os.environ),
            tmp_path / "logs",
            5.0,
        )
    assert len(spawned.all) == 1 and gone(spawned.all[0])


@pytest.mark.parametrize(
    "error", [httpx.ConnectError("[Errno 111] Connection refused"), KeyboardInterrupt()], ids=["refused", "ctrl-c"]
)
def test_a_failed_poll_for_the_worker_stops_the_worker_it_started(error, spawned, home, monkeypatch):
    monkeypatch.setattr(worker, "ensure_pool", lambda *args: None)  # no Prefect server here
    monkeypatch.setattr(worker, "spawn", lambda name, argv, env, log_dir: spawned(["sleep", "30"]))

    def online(*args):
        raise error

    monkeypatch.setattr(worker, "_worker_online", online)
    with pytest.raises(type(error)):
        worker.start(StackConfig(), home, None, "http://127.0.0.1:1/api", "http://127.0.0.1:2")
    assert len(spawned.all) == 1 and gone(spawned.all[0])


def test_a_worker_is_kept_while_prefect_and_mlflow_stay_and_replaced_when_either_moves(spawned):
    """A kept worker would poll the old Prefect server, and its runs log to the old MLflow one."""
    prefect, mlflow = "http://127.0.0.1:4200/api", "http://127.0.0.1:5000"
    url = worker.pool_url(prefect, "shardline-process")
    recorded = PartState(
        name="worker", url=url, procs=[spawned(["sleep", "30"])], started_by_us=True, detail={"tracking_uri": mlflow}
    )
    assert url == "http://127.0.0.1:4200/work-pools/work-pool/shardline-process"
    assert worker.keeps(recorded, url, mlflow)
    assert not worker.keeps(recorded, worker.pool_url("http://127.0.0.1:4300/api", "shardline-process"), mlflow)
    assert not worker.keeps(recorded, url, "http://127.0.0.1:5100")
    assert not worker.keeps(recorded.model_copy(update={"detail": {}}), url, mlflow)  # recorded before it was kept
    assert service.stop_part(recorded) and gone(recorded.procs[0])  # what start does with one it does not keep


# ---- a part moved to another port or host is stopped, not lost or kept (service.ensure_service) --------------------


def _ensure_http(recorded: PartState | None, host_in_url: str, port: int, tmp_path: Path) -> PartState:
    return service.ensure_service(
        "prefect",
        recorded,
        f"http://{host_in_url}:{port}",
        f"http://127.0.0.1:{port}/",
        "127.0.0.1",
        port,
        http_server(port, tmp_path),
        dict(os.environ),
        tmp_path / "logs",
        10.0,
    )


def test_a_part_moved_to_another_port_stops_the_old_server_and_starts_a_new_one(spawned, tmp_path):
    old_port, new_port = free_port(), free_port()
    first = _ensure_http(None, "127.0.0.1", old_port, tmp_path)
    spawned.all.extend(first.procs)  # stopped at the end whatever happens
    assert first.started_by_us and is_ours(first.procs[0])
    again = _ensure_http(first, "127.0.0.1", old_port, tmp_path)
    assert again is first and is_ours(first.procs[0])  # same URL, answering: kept as it is

    moved = _ensure_http(first, "127.0.0.1", new_port, tmp_path)
    spawned.all.extend(moved.procs)
    assert gone(first.procs[0])  # the old server of this stack is not left running unrecorded
    assert moved.url == f"http://127.0.0.1:{new_port}" and moved.started_by_us and is_ours(moved.procs[0])


def test_a_part_moved_to_another_host_is_restarted_where_the_config_says(spawned, tmp_path):
    port = free_port()
    wide = spawned(["sleep", "30"])  # stands in for the server a first `up --host 0.0.0.0` started
    recorded = PartState(name="prefect", url=f"http://0.0.0.0:{port}", port=port, procs=[wide], started_by_us=True)
    part = _ensure_http(recorded, "127.0.0.1", port, tmp_path)
    spawned.all.extend(part.procs)
    assert gone(wide) and part.url == f"http://127.0.0.1:{port}" and is_ours(part.procs[0])


def _listens_and_never_answers(port: int) -> list[str]:
    code = (
        "import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
        f"s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(30)"
    )
    return [sys.executable, "-c", code]


@pytest.mark.parametrize("hung", ["listener gone", "listening"])
def test_a_hung_server_this_stack_started_is_stopped_before_its_replacement_starts(hung, spawned, tmp_path):
    """Recorded, ours, alive and failing its health check: it was left running unrecorded beside its replacement,
    or, still holding the port, it made `up` fail with the port taken."""
    port = free_port()
    old = spawned(["sleep", "30"] if hung == "listener gone" else _listens_and_never_answers(port))
    deadline = time.monotonic() + 5
    while hung == "listening" and not service.port_open("127.0.0.1", port) and time.monotonic() < deadline:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    recorded = PartState(
        name="prefect", url=url, port=port, procs=[old], started_by_us=True, detail={"health_url": f"{url}/"}
    )
    part = _ensure_http(recorded, "127.0.0.1", port, tmp_path)
    spawned.all.extend(part.procs)
    assert gone(old) and part.started_by_us and part.procs != [old] and is_ours(part.procs[0])


def test_a_slow_server_this_stack_started_is_waited_for_and_kept(spawned, tmp_path):
    """A server of this stack that answers a few seconds late (a loaded machine, a Prometheus loading its TSDB) was
    taken for hung by a second `up`, stopped and replaced, which broke every run connected to it."""
    port = free_port()
    serve = f"exec {sys.executable} -m http.server {port} --bind 127.0.0.1 --directory {tmp_path}"
    slow = spawned(["sh", "-c", f"sleep 2; {serve}"])  # exec: the same process, answering from 2 s on
    url = f"http://127.0.0.1:{port}"
    recorded = PartState(
        name="prefect", url=url, port=port, procs=[slow], started_by_us=True, detail={"health_url": f"{url}/"}
    )
    part = _ensure_http(recorded, "127.0.0.1", port, tmp_path)
    spawned.all.extend(p for p in part.procs if p != slow)  # a replacement, where one was started, is stopped too
    assert part.procs == [slow] and is_ours(slow)


def test_a_moved_part_this_stack_did_not_start_is_left_running(spawned, tmp_path):
    port = free_port()
    foreign = spawned(["sleep", "30"])
    recorded = PartState(name="prefect", url="http://127.0.0.1:1", port=1, procs=[foreign], started_by_us=False)
    part = _ensure_http(recorded, "127.0.0.1", port, tmp_path)
    spawned.all.extend(part.procs)
    assert is_ours(foreign) and is_ours(part.procs[0])


# ---- a Prometheus `up` started is stopped or kept on record, never forgotten (prometheus.start, stack.up) ---------


def _wait_listening(port: int) -> None:
    deadline = time.monotonic() + 5
    while not service.port_open("127.0.0.1", port) and time.monotonic() < deadline:
        time.sleep(0.05)


def _fake_prometheus(bin_dir: Path) -> None:
    """A `prometheus` on PATH: Python's http.server at --web.listen-address, answering /-/ready from the data dir."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "prometheus"
    script.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do case "$a" in --web.listen-address=*) addr="${a#*=}";; '
        '--storage.tsdb.path=*) data="${a#*=}";; esac; done\n'
        'mkdir -p "$data/-" && touch "$data/-/ready"\n'
        f'exec {sys.executable} -m http.server "${{addr##*:}}" --bind "${{addr%:*}}" --directory "$data"\n'
    )
    script.chmod(0o755)


def test_a_prometheus_up_started_that_is_not_ready_yet_is_stopped_and_replaced(home, spawned, monkeypatch):
    """Prometheus answers 503 on /-/ready while it loads its TSDB: it was taken for someone else's server on the
    port, and `up` dropped its record with it still running."""
    port = free_port()
    loading = spawned(http_server(port, home))  # listens; 404 on /-/ready
    _wait_listening(port)
    _fake_prometheus(home / "bin")
    monkeypatch.setenv("PATH", f"{home / 'bin'}{os.pathsep}{os.environ['PATH']}")
    cfg = StackConfig(prometheus_port=port, start_timeout_s=10.0)
    url = prometheus.server_url(cfg)
    recorded = PartState(
        name="prometheus",
        url=url,
        port=port,
        procs=[loading],
        started_by_us=True,
        detail={"health_url": f"{url}/-/ready"},
    )
    _, pipe = load_stack_config(None, [])
    part = prometheus.start(cfg, home, recorded, pipe.serve)
    spawned.all.extend(part.procs)
    assert gone(loading) and part.started_by_us and part.procs != [loading] and is_ours(part.procs[0])


def test_a_prometheus_up_started_stays_recorded_when_a_later_up_skips_the_part(home, spawned, capsys):
    """A later `up` that skips the part (no `prometheus` binary now) dropped its record with the server running, where
    no `down` ever found it; a record whose processes are gone is dropped."""
    running = spawned(["sleep", "30"])
    recorded = PartState(name="prometheus", url="http://127.0.0.1:9095", port=9095, procs=[running], started_by_us=True)
    state = StackState(home=str(home), parts={"prometheus": recorded})
    write_state(state)
    stack.forget_unless_running(state, "prometheus", print)
    assert "the one an earlier `up` started still runs: kept on record" in capsys.readouterr().out
    assert read_state() == state and main(["down"]) == 0 and gone(running)
    stack.forget_unless_running(state, "prometheus", print)  # nothing of it runs now
    assert read_state() == StackState(home=str(home), parts={})
