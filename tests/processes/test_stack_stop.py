"""`up` and `down` of the local stack with real short-lived processes standing in for its servers (`sleep`, Python's
http.server): an interrupted start leaves nothing running, a moved part is stopped, `down` never starts a Ray head,
stops every part it can, and stops only the Ray head `up` started. Nothing here starts Prefect, MLflow or Ray."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import flows.stack.service as service
import flows.stack.worker as worker
from flows.cli.root import main
from flows.config import load_stack_config
from flows.stack import endpoint, mlflow_server, prefect_server, prometheus, ray_head, stack
from flows.stack.config import StackConfig
from flows.stack.procs import Proc, StackError, is_ours, spawn, stop
from flows.stack.state import PartState, StackState, read_state, state_path, write_state
from infra import head, process
from infra.config import ClusterConfig
from infra.ray_env import ClusterError

ENSURE_HEAD = head.ensure_head  # before `home` replaces it


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh $SHARDLINE_HOME, Ray's temp dir inside it, and a guard: starting a Ray head fails the test."""
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path))
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "raytmp"))

    def no_head(*args, **kwargs):
        raise AssertionError("a Ray head was started")

    monkeypatch.setattr(head, "ensure_head", no_head)
    monkeypatch.setattr(head, "_run_ray", no_head)
    return tmp_path


@pytest.fixture
def spawned(tmp_path: Path):
    """Detached processes started with procs.spawn (their own session, as `up` starts servers); whatever a test
    leaves running is stopped at the end."""
    started: list[Proc] = []

    def start(argv: list[str]) -> Proc:
        proc = spawn(f"p{len(started)}", argv, dict(os.environ), tmp_path / "logs")
        started.append(proc)
        return proc

    start.all = started  # type: ignore[attr-defined]
    yield start
    for proc in started:
        stop(proc, grace_s=2.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_server(port: int, directory: Path) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(directory)]


def _gone(proc: Proc, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while is_ours(proc) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not is_ours(proc)


# ---- an interrupted start stops what it spawned (service.ensure_service, worker.start) -----------------------------


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_wait_for_a_service_stops_the_process_it_started(error, spawned, tmp_path, monkeypatch):
    port = _free_port()
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
    assert len(spawned.all) == 1 and _gone(spawned.all[0])


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
    assert len(spawned.all) == 1 and _gone(spawned.all[0])


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
    assert service.stop_part(recorded) and _gone(recorded.procs[0])  # what start does with one it does not keep


# ---- a part moved to another port or host is stopped, not lost or kept (service.ensure_service) --------------------


def _ensure_http(recorded: PartState | None, host_in_url: str, port: int, tmp_path: Path) -> PartState:
    return service.ensure_service(
        "prefect",
        recorded,
        f"http://{host_in_url}:{port}",
        f"http://127.0.0.1:{port}/",
        "127.0.0.1",
        port,
        _http_server(port, tmp_path),
        dict(os.environ),
        tmp_path / "logs",
        10.0,
    )


def test_a_part_moved_to_another_port_stops_the_old_server_and_starts_a_new_one(spawned, tmp_path):
    old_port, new_port = _free_port(), _free_port()
    first = _ensure_http(None, "127.0.0.1", old_port, tmp_path)
    spawned.all.extend(first.procs)  # stopped at the end whatever happens
    assert first.started_by_us and is_ours(first.procs[0])
    again = _ensure_http(first, "127.0.0.1", old_port, tmp_path)
    assert again is first and is_ours(first.procs[0])  # same URL, answering: kept as it is

    moved = _ensure_http(first, "127.0.0.1", new_port, tmp_path)
    spawned.all.extend(moved.procs)
    assert _gone(first.procs[0])  # the old server of this stack is not left running unrecorded
    assert moved.url == f"http://127.0.0.1:{new_port}" and moved.started_by_us and is_ours(moved.procs[0])


def test_a_part_moved_to_another_host_is_restarted_where_the_config_says(spawned, tmp_path):
    port = _free_port()
    wide = spawned(["sleep", "30"])  # stands in for the server a first `up --host 0.0.0.0` started
    recorded = PartState(name="prefect", url=f"http://0.0.0.0:{port}", port=port, procs=[wide], started_by_us=True)
    part = _ensure_http(recorded, "127.0.0.1", port, tmp_path)
    spawned.all.extend(part.procs)
    assert _gone(wide) and part.url == f"http://127.0.0.1:{port}" and is_ours(part.procs[0])


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
    port = _free_port()
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
    assert _gone(old) and part.started_by_us and part.procs != [old] and is_ours(part.procs[0])


def test_a_slow_server_this_stack_started_is_waited_for_and_kept(spawned, tmp_path):
    """A server of this stack that answers a few seconds late (a loaded machine, a Prometheus loading its TSDB) was
    taken for hung by a second `up`, stopped and replaced, which broke every run connected to it."""
    port = _free_port()
    serve = f"exec {sys.executable} -m http.server {port} --bind 127.0.0.1 --directory {tmp_path}"
    slow = spawned(["sh", "-c", f"sleep 2; {serve}"])  # exec: the same process, answering from 2 s on
    url = f"http://127.0.0.1:{port}"
    recorded = PartState(
        name="prefect", url=url, port=port, procs=[slow], started_by_us=True, detail={"health_url": f"{url}/"}
    )
    part = _ensure_http(recorded, "127.0.0.1", port, tmp_path)
    assert part.procs == [slow] and is_ours(slow)


def test_a_moved_part_this_stack_did_not_start_is_left_running(spawned, tmp_path):
    port = _free_port()
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
    port = _free_port()
    loading = spawned(_http_server(port, home))  # listens; 404 on /-/ready
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
    assert _gone(loading) and part.started_by_us and part.procs != [loading] and is_ours(part.procs[0])


def test_a_prometheus_up_started_stays_recorded_when_a_later_up_skips_the_part(home, spawned, monkeypatch, capsys):
    running = spawned(["sleep", "30"])
    recorded = PartState(name="prometheus", url="http://127.0.0.1:9095", port=9095, procs=[running], started_by_us=True)
    write_state(StackState(home=str(home), parts={"prometheus": recorded}))
    cfg, pipe = _up_without_servers(monkeypatch, [])
    (home / "no-prometheus").mkdir()
    monkeypatch.setenv("PATH", str(home / "no-prometheus"))  # this `up` finds no binary: the part is skipped
    stack.up(cfg, pipe, say=print)
    assert "prometheus SKIPPED: no `prometheus` binary" in capsys.readouterr().out
    state = read_state()
    assert state is not None and state.parts["prometheus"].procs == [running]
    assert main(["down"]) == 0 and _gone(running)


# ---- `status` of the PostgreSQL part: up while its server accepts connections (state.part_up) ---------------------


def test_status_shows_the_postgres_backend_up_while_it_accepts_connections(home, monkeypatch):
    """shardline starts no PostgreSQL, so the part has no processes and no health URL: it always read as DOWN."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    monkeypatch.setattr(stack, "ensure_databases", lambda backend: [])  # no PostgreSQL here
    cfg, pipe = _up_without_servers(
        monkeypatch, ["stack.prometheus=false", f'stack.backend="postgresql://u@127.0.0.1:{port}/x"']
    )
    try:
        stack.up(cfg, pipe, say=lambda line: None)
        assert stack.status()["postgres"]["up"] is True
    finally:
        listener.close()
    assert stack.status()["postgres"]["up"] is False
    unresolvable = PartState(name="postgres", port=5432, detail={"host": "db.invalid"})
    assert stack.dump_status(StackState(home=str(home), parts={"postgres": unresolvable}))["postgres"]["up"] is False


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
    assert all(_gone(p) for p in servers.values())
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
    assert all(_gone(p) for p in servers.values())  # Prefect, MLflow, worker: stopped all the same
    assert "endpoint  could not be stopped: ClusterError: ray start failed: no memory" in out
    assert "Ray's last lines" not in out  # one line
    assert "could not stop endpoint" in err
    state = read_state()
    assert state is not None and list(state.parts) == ["endpoint"]  # kept for the next `down`


# ---- two `up`s at once: the record stays whole and one server of each part is started (state, stack.up) --------


def _up_without_servers(monkeypatch: pytest.MonkeyPatch, sets: list[str]):
    """Configs for an `up` whose Prefect and MLflow are records only (no server starts), without Ray, endpoint or
    deployments; the worker is whatever the test sets."""
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")  # `up` points this process at the stack
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:2")
    monkeypatch.setattr(prefect_server, "start", lambda *args: PartState(name="prefect", url="http://127.0.0.1:1/api"))
    monkeypatch.setattr(mlflow_server, "start", lambda *args: PartState(name="mlflow", url="http://127.0.0.1:2"))
    monkeypatch.setattr(worker, "start", lambda *args: PartState(name="worker", url="http://127.0.0.1:1/pool"))
    return load_stack_config(None, ["stack.ray=false", "stack.endpoint=false", "stack.deploy=false", *sets])


def test_concurrent_writers_of_the_record_neither_fail_nor_damage_it(home):
    state = StackState(home=str(home), parts={"prefect": PartState(name="prefect", url="http://127.0.0.1:4200/api")})
    errors: list[BaseException] = []

    def writes() -> None:
        for _ in range(300):
            try:
                write_state(state)
                assert read_state() == state  # never half a file
            except BaseException as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)

    threads = [threading.Thread(target=writes) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [p.name for p in home.iterdir() if p.name.startswith(("stack.json", ".stack."))] == ["stack.json"]


def test_a_second_up_or_down_while_one_runs_fails_at_once_and_starts_nothing(home, spawned, monkeypatch, capsys):
    """Each `up` read the record before the other wrote it, so each started a worker and only one stayed recorded."""
    cfg, pipe = _up_without_servers(monkeypatch, ["stack.prometheus=false"])
    starting, release = threading.Event(), threading.Event()

    def worker_start(cfg, home, recorded, api_url, tracking_uri):  # the first `up` waits for its worker here
        if starting.is_set():
            return PartState(name="worker", procs=[spawned(["sleep", "30"])], started_by_us=True)
        starting.set()
        release.wait(10)
        return PartState(name="worker", procs=[spawned(["sleep", "30"])], started_by_us=True)

    monkeypatch.setattr(worker, "start", worker_start)
    first = threading.Thread(target=stack.up, args=(cfg, pipe), kwargs={"say": lambda line: None})
    first.start()
    try:
        assert starting.wait(10)
        with pytest.raises(StackError, match=r"^another `shardline up/down` is running on ") as busy:
            stack.up(cfg, pipe, say=lambda line: None)
        assert "\n" not in str(busy.value)
        assert main(["down"]) == 1
        err = capsys.readouterr().err
        assert "another `shardline up/down` is running" in err and len(err.strip().splitlines()) == 1
    finally:
        release.set()
        first.join(10)
    state = read_state()
    assert len(spawned.all) == 1 and state is not None
    assert state.parts["worker"].procs == spawned.all and is_ours(spawned.all[0])  # the one started is recorded
    assert main(["down"]) == 0 and _gone(spawned.all[0])  # and the lock went with the first `up`


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
