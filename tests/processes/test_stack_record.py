"""The stack's record with real short-lived processes: writers at once keep it whole, a second `up` or `down` while
one runs fails at once (the stack lock), and `status` reads the PostgreSQL part up while its server accepts
connections. Nothing here starts Prefect, MLflow or Ray."""

from __future__ import annotations

import socket
import sys
import threading
import time

from support.stack_procs import gone

from flows.cli.root import main
from flows.stack import stack
from flows.stack.postgres import parse_backend
from flows.stack.procs import stop
from flows.stack.state import PartState, StackState, read_state, state_path, write_state

# ---- two `up`s at once: the record stays whole and one server of each part is started (state, stack.up) --------


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


def test_a_second_up_or_down_while_one_runs_fails_at_once_and_starts_nothing(home, spawned, capsys):
    """Each `up` read the record before the other wrote it, so each started a worker and only one stayed recorded:
    a running `up` (here a process holding the stack lock as `up` does) makes the next `up` or `down` fail at once,
    in one line, having read and started nothing; the lock goes with the process that held it."""
    holder = spawned([sys.executable, "-c", HOLDS_THE_LOCK])
    deadline = time.monotonic() + 30
    while not (home / "lock-held").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (home / "lock-held").exists()
    for command in (["up", "--set", "stack.prometheus=false"], ["down"]):
        assert main(command) == 1, command
        err = capsys.readouterr().err.strip()
        assert err.startswith("shardline: another `shardline up/down` is running on ") and "\n" not in err
    assert not state_path().exists()
    stop(holder, grace_s=2.0)
    assert gone(holder) and main(["down"]) == 0  # the lock went with the process that held it


# a process holding $SHARDLINE_HOME's stack lock, as a running `up` or `down` does, until it is stopped
HOLDS_THE_LOCK = (
    "import os, pathlib, time\n"
    "from flows.stack.state import stack_lock\n"
    "with stack_lock():\n"
    "    pathlib.Path(os.environ['SHARDLINE_HOME'], 'lock-held').touch()\n"
    "    time.sleep(60)\n"
)


# ---- `status` of the PostgreSQL part: up while its server accepts connections (state.part_up) ---------------------


def test_status_shows_the_postgres_backend_up_while_it_accepts_connections(home):
    """shardline starts no PostgreSQL, so the part has no processes and no health URL: it always read as DOWN. The
    record `up` makes of the backend names its host, which `status` dials."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    part = stack.postgres_part(parse_backend(f"postgresql://u@127.0.0.1:{port}/x"), [])
    write_state(StackState(home=str(home), parts={"postgres": part}))
    try:
        assert stack.status()["postgres"]["up"] is True
    finally:
        listener.close()
    assert stack.status()["postgres"]["up"] is False
    unresolvable = PartState(name="postgres", port=5432, detail={"host": "db.invalid"})
    assert stack.dump_status(StackState(home=str(home), parts={"postgres": unresolvable}))["postgres"]["up"] is False
