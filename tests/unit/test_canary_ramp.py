"""The canary driver's ramp between the operator and the router: commands read where the weight or the verdict is
about to change, not only inside a step's collection, and a restarted router replica's evidence read from its start.

The registry is a real MLflow SQLite store (commands and state are model-version tags); the router the ramp reads
observations from and the Serve update it applies are stand-ins (no Ray in this tier): `applied` is the weight
each update would have given the challenger, `Router` serves the observations a real router would hold.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from deployments import rollout_ramp
from deployments.canary_control import DriverControl
from deployments.canary_records import OperatorCommand
from deployments.config import CanaryConfig, ServeConfig
from deployments.registry import TAG_CANARY_COMMAND, client_for
from deployments.rollout import _ramp_up
from deployments.rollout_ramp import Ramp

NAME = "m"


def _call(version: str) -> dict[str, Any]:
    return {"version": version, "ok": True, "bits": 200.0, "bytes": 100, "latency_ms": 10.0}


def _observation(seq: int, epoch: int) -> dict[str, Any]:
    """A challenger request paired with a champion score of the same text, both fine."""
    return {
        "seq": seq,
        "epoch": epoch,
        "op": "score",
        "role": "challenger",
        "probe": False,
        "challenger": _call("2"),
        "champion": None,
        "shadow": _call("1"),
        "fallback": False,
        "client_ok": True,
    }


class Router:
    """What a router's replicas hold: `batches` of (replica id, how many new observations) in the order reads get
    them; each read answers what that replica numbered at or past the cursor it was given."""

    def __init__(self, batches: list[tuple[str, int]] | None = None):
        self.batches = batches
        self.held: dict[str, list[dict[str, Any]]] = {}
        self.reads: list[tuple[str, int, int]] = []  # (replica, since, items answered)
        self.get_observations = self

    def remote(self, canary_id: str, epoch: int, since: int) -> Router:
        if self.batches is None:  # a busy router: 30 more on every read
            replica, new = "r", 30
        else:  # the batches, then nothing new on the last replica
            replica, new = self.batches.pop(0) if self.batches else (self.reads[-1][0], 0)
        held = self.held.setdefault(replica, [])
        held += [_observation(len(held) + i, epoch) for i in range(new)]
        items = [o for o in held if o["seq"] >= since]
        self.reads.append((replica, since, len(items)))
        self.answer = {"replica_id": replica, "next": len(held), "items": items}
        return self

    def result(self, timeout_s: float) -> dict[str, Any]:
        return self.answer


@pytest.fixture
def canary(mlflow_store, monkeypatch):
    """A registered model with versions 1 (champion) and 2 (challenger), and a factory of (ramp, weights applied,
    command writer) for a canary of version 2 under the given config."""
    uri, _ = mlflow_store
    client = client_for(uri)
    client.create_registered_model(NAME)
    for _ in range(2):
        client.create_model_version(NAME, source="file:///nowhere/model")
    applied: list[int] = []
    monkeypatch.setattr(rollout_ramp, "apply", lambda spec, serve, env: applied.append(spec.router.challenger_percent))
    router = Router()
    monkeypatch.setattr(rollout_ramp, "router_handle", lambda app: router)

    def start(**settings: Any) -> tuple[Ramp, list[int], Any, Router]:
        cfg = CanaryConfig(**({"min_requests": 20, "min_paired": 10, "bake_seconds": 0.0} | settings))
        canary_id = uuid.uuid4().hex
        control = DriverControl(client, cfg, NAME, "2", canary_id)
        ramp = Ramp(cfg, ServeConfig(), NAME, "1", "2", uri, "", None, control)

        def command(action: str) -> None:  # what `shardline canary ACTION` writes
            sent = OperatorCommand(id=uuid.uuid4().hex, canary_id=canary_id, action=action, user="ana", at=time.time())
            client.set_model_version_tag(NAME, "2", TAG_CANARY_COMMAND, sent.model_dump_json())

        return ramp, applied, command, router

    return start


def _once(ready: Any, act: Any, within_s: float = 30.0) -> threading.Thread:
    """Run `act` in a thread as soon as `ready()` holds (the driver got as far as the test needs): no fixed delay
    that a loaded machine could outrun or fall behind."""

    def wait_then_act() -> None:
        deadline = time.monotonic() + within_s
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.02)
        act()

    thread = threading.Thread(target=wait_then_act)
    thread.start()
    return thread


@pytest.mark.parametrize("action", ["pause", "abort"])
def test_a_command_given_while_a_step_is_judged_acts_before_the_weight_moves_on(canary, action):
    """Commands were read only inside a step's collection: a pause or abort given while the 10% step was summarised
    (its PromQL gates read, say) took effect only once 50% had been applied."""
    ramp, applied, command, _ = canary(steps=[10, 50, 100], control_poll_s=0.2, pause_timeout_s=60.0)
    steps: list = []
    resumed = []

    def on_step(index: int, step: Any) -> None:  # the operator acts while the 10% step is being judged
        if index == 0:
            command(action)
            if action == "pause":  # resumed once the driver acted on the pause (one command tag: not before)
                resumed.append(_once(lambda: len(ramp.control.applied) == 1, lambda: command("resume")))

    ended_by, stopped, paused_out = _ramp_up(ramp, ramp.cfg, "1", "2", steps, on_step)
    acted = ramp.control.applied[0]
    assert acted.action == action and acted.percent == 10 and acted.state == "running"
    if action == "abort":  # decided at 10%: the challenger never got 50%
        assert ended_by is not None and ended_by.action == "abort" and set(applied) == {10}
    else:  # held at 10% until the resume, then on through 50% and 100%
        resumed[0].join()
        assert ended_by is None and not stopped and not paused_out
        assert [c.action for c in ramp.control.applied] == ["pause", "resume"]
        assert ramp.control.applied[1].percent == 10 and applied[-1] == 100
        assert applied[: applied.index(50)] == [10, 10, 10]  # set, then republished by the pause and the resume


def test_an_abort_given_while_the_last_step_is_judged_decides_instead_of_a_promotion(canary):
    ramp, applied, command, _ = canary(steps=[10, 100], control_poll_s=0.2)
    steps: list = []
    ended_by, stopped, _ = _ramp_up(ramp, ramp.cfg, "1", "2", steps, lambda i, s: command("abort") if i == 1 else None)
    assert ended_by is not None and ended_by.action == "abort" and ramp.control.applied[0].percent == 100
    assert not stopped and len(steps) == 2


def test_a_pause_between_steps_that_outlasts_its_timeout_rolls_back(canary):
    ramp, _, command, _ = canary(steps=[10, 100], control_poll_s=0.2, pause_timeout_s=1.0)
    command("pause")
    assert ramp.between_steps() == (None, True)
    assert ramp.control.state == "deciding"


def test_a_promote_given_in_the_last_poll_interval_before_the_approval_deadline_is_taken(canary):
    """The wait for approval ended at its deadline without a last read: a promote written after the last poll was
    lost and the canary aborted as timed out."""
    ramp, _, command, _ = canary(
        steps=[10, 100], approval="manual", approval_timeout_s=3.0, control_poll_s=30.0, lease_s=60.0
    )
    ramp.percent = 10
    # after the wait's first poll (which sets the next one 30 s on): only a last read at the deadline can see it
    operator = _once(lambda: ramp.control.next_poll > 0, lambda: command("promote"))
    got = ramp.await_approval()
    operator.join()
    assert got is not None and got.action == "promote"


def test_a_restarted_router_replica_s_first_observations_are_read_from_its_start(canary):
    """After a restart the new replica numbers from 0; the read that found it had asked past its first ones (the old
    replica's cursor), and the cursor then moved on: those observations were never read."""
    ramp, _, _, router = canary(steps=[10, 100], min_requests=20, min_paired=10, step_timeout_s=30.0)
    router.batches = [("a", 12), ("b", 12)]  # 12 on the first replica, which restarts; 12 more on the next
    got = ramp.collect()
    assert len(got.observations) == 24 and got.shortfall == ""
    assert router.reads[:3] == [("a", 0, 12), ("b", 12, 0), ("b", 0, 12)]


def test_a_command_whose_audit_record_cannot_be_logged_is_still_sent_and_acted_on(canary, monkeypatch, caplog):
    """The command is the version's tag; a copy is logged on the canary's run. Logging that copy failed (no write
    access to the artifact store from the operator's machine) after the tag was written: the CLI exited 1 for a
    pause the driver then applied."""
    from deployments import canary_control

    ramp, _, _, _ = canary(steps=[10, 100], control_poll_s=0.1)
    client = ramp.control.client
    client.set_registered_model_alias(NAME, "champion", "1")
    client.set_registered_model_alias(NAME, "challenger", "2")
    ramp.set(10, 1)  # the driver's state, published with its lease

    def unwritable(client: Any, command: OperatorCommand) -> None:
        raise PermissionError("Access Denied (s3://mlflow-artifacts/1/run1/artifacts)")

    monkeypatch.setattr(canary_control, "record_command", unwritable)

    def drive() -> None:  # the driver's polls while its step collects, for at most 10 s
        deadline = time.monotonic() + 10
        while not ramp.control.applied and time.monotonic() < deadline:
            ramp._poll()
            time.sleep(0.05)

    driver = threading.Thread(target=drive)
    driver.start()
    command, status = canary_control.send_command(client, NAME, "pause", "look at the logs", "ana", wait_s=20)
    driver.join()
    assert status.state == "paused" and ramp.control.applied[0].id == command.id
    assert "pause was sent, but its record on the canary's run was not logged: Access Denied" in caplog.text
