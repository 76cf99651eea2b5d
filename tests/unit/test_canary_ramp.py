"""The canary driver's pure parts and its operator channel without Serve: how one read of a router's observations
is taken (a restarted router replica's are read from its start), and a command whose audit copy cannot be logged.

Commands read where the weight or the verdict is about to change run on a real Ray Serve in
tests/integration/test_canary_control.py; the registry here is a real MLflow SQLite store.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from deployments.canary_control import DriverControl
from deployments.canary_records import OperatorCommand
from deployments.config import CanaryConfig
from deployments.registry import client_for
from deployments.rollout_ramp import take_observations

NAME = "m"


def _read(replica: str, since: int, held: int) -> dict[str, Any]:
    """What a router replica holding `held` observations answers a read from `since`."""
    return {"replica_id": replica, "next": held, "items": [{"seq": n} for n in range(since, held)]}


def test_a_restarted_router_replica_s_first_observations_are_read_from_its_start():
    """After a restart the new replica numbers from 0; the read that found it had asked past its first ones (the old
    replica's cursor), and the cursor then moved on: those observations were never read."""
    seen: dict = {}
    replica, cursor = take_observations(_read("a", 0, 12), "", 0, seen)
    assert (replica, cursor, len(seen)) == ("a", 12, 12)
    replica, cursor = take_observations(_read("b", 12, 12), replica, cursor, seen)  # restarted, 12 new ones
    assert (replica, cursor, len(seen)) == ("b", 0, 12)  # that read is dropped: it asked past them
    replica, cursor = take_observations(_read("b", 0, 12), replica, cursor, seen)
    assert (replica, cursor, len(seen)) == ("b", 12, 24)  # the old replica's are kept beside the new one's
    replica, cursor = take_observations(_read("b", 12, 15), replica, cursor, seen)
    assert (cursor, len(seen)) == (15, 27)


def test_a_command_whose_audit_record_cannot_be_logged_is_still_sent_and_acted_on(mlflow_store, monkeypatch, caplog):
    """The command is the version's tag; a copy is logged on the canary's run. Logging that copy failed (no write
    access to the artifact store from the operator's machine) after the tag was written: the CLI exited 1 for a
    pause the driver then applied."""
    from deployments import canary_control

    uri, _ = mlflow_store
    client = client_for(uri)
    client.create_registered_model(NAME)
    for _ in range(2):
        client.create_model_version(NAME, source="file:///nowhere/model")
    client.set_registered_model_alias(NAME, "champion", "1")
    client.set_registered_model_alias(NAME, "challenger", "2")
    control = DriverControl(client, CanaryConfig(control_poll_s=0.1), NAME, "2", uuid.uuid4().hex)
    control.publish(10, time.time() + 20)  # the driver's state, with its lease

    def unwritable(client: Any, command: OperatorCommand) -> None:
        raise PermissionError("Access Denied (s3://mlflow-artifacts/1/run1/artifacts)")

    monkeypatch.setattr(canary_control, "record_command", unwritable)

    def drive() -> None:  # the driver's polls while its step collects, for at most 10 s
        deadline = time.monotonic() + 10
        while not control.applied and time.monotonic() < deadline:
            if control.poll(10) is not None:
                control.publish(10, time.time() + 20)  # acted on: state and ack published
            time.sleep(0.05)

    driver = threading.Thread(target=drive)
    driver.start()
    command, status = canary_control.send_command(client, NAME, "pause", "look at the logs", "ana", wait_s=20)
    driver.join()
    assert status.state == "paused" and control.applied[0].id == command.id
    assert "pause was sent, but its record on the canary's run was not logged: Access Denied" in caplog.text
