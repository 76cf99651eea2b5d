"""The operator channel's pure parts: a canary's status from the registry's aliases and the driver's state tag
(a lapsed lease reads as no canary), and the description a decided version gets."""

from __future__ import annotations

from deployments.canary_control import status_of
from deployments.registry import version_description
from infra.names import TAG_DATASET_DIGEST, TAG_TRAIN_RUN_ID

NOW = 1_000_000.0
ALIASES = {"champion": "1", "challenger": "2"}


def _state(**kw):
    return {
        "canary_id": "k",
        "state": "running",
        "percent": 50,
        "step": 2,
        "steps": 3,
        "attempt": 0,
        "mode": "canary",
        "approval": "auto",
        "lease_expires_at": NOW + 10,
        "lease_s": 20.0,
        "updated_at": NOW - 1,
        "approval_deadline": None,
        "ack": None,
    } | kw


def test_a_live_canary_reports_its_state_step_and_weight():
    status = status_of("m", ALIASES, _state(state="paused", ack="c1"), NOW)
    assert (status.model, status.state, status.champion_version, status.challenger_version) == ("m", "paused", "1", "2")
    assert (status.step, status.steps, status.percent, status.canary_id, status.ack) == (2, 3, 50, "k", "c1")


def test_a_paused_canary_says_when_it_rolls_back_unless_resumed():
    import time

    from flows.cli.canary import describe

    now = time.time()
    live = {"lease_expires_at": now + 10}
    status = status_of("m", ALIASES, _state(state="paused", pause_deadline=now + 600.4, **live), now)
    assert status.pause_deadline is not None
    line = describe(status)
    assert line.startswith("m: paused at 50% (step 2 of 3), champion v1, challenger v2, mode canary, canary k")
    assert line.endswith("; rolls back in 600 s unless resumed")
    running = status_of("m", ALIASES, _state(pause_deadline=None, **live), now)
    assert "rolls back" not in describe(running)


def test_a_canary_whose_decision_is_being_applied_reads_as_deciding_not_abandoned():
    """Applying a verdict (registry, then a redeploy) can outlast two leases; its driver published how long."""
    status = status_of("m", ALIASES, _state(state="deciding", lease_expires_at=NOW + 500), NOW)
    assert status.state == "deciding" and status.last_verdict is None


def test_a_canary_whose_lease_lapsed_a_whole_lease_ago_is_no_canary():
    # a renewal late by less than a lease (a loaded machine) is still a live driver
    assert status_of("m", ALIASES, _state(lease_expires_at=NOW - 19.9), NOW).state == "running"
    # the driver died: the router has gone back to the champion by itself, so nothing can be paused or promoted
    status = status_of("m", ALIASES, _state(lease_expires_at=NOW - 20.1), NOW)
    assert (status.state, status.percent, status.challenger_version) == ("none", 0, "2")
    assert status.last_verdict == "abandoned" and "stopped renewing its lease" in status.last_reason


def test_a_decided_canary_is_no_canary_and_says_how_it_ended():
    status = status_of(
        "m", ALIASES, _state(state="none", lease_expires_at=0.0, verdict="aborted", reason="by ana"), NOW
    )
    assert (status.state, status.last_verdict, status.last_reason) == ("none", "aborted", "by ana")
    # once decided the challenger alias is gone: no challenger, whatever tag is left
    assert status_of("m", {"champion": "2"}, _state(), NOW).model_dump(exclude_none=True) == {
        "model": "m",
        "state": "none",
        "champion_version": "2",
        "percent": 0,
        "attempt": 0,
    }


def test_a_version_description_says_what_it_was_trained_on_and_how_it_was_decided():
    tags = {TAG_DATASET_DIGEST: "d1g3st", TAG_TRAIN_RUN_ID: "run-7"}
    text = version_description(tags, "run-x", "Canary against champion v1: promoted (policy, ...): passed")
    assert text == (
        "Trained on dataset d1g3st by train run run-7.\nCanary against champion v1: promoted (policy, ...): passed"
    )
    assert version_description({}, "run-x", "Champion without a canary: first run.").startswith(
        "Trained on dataset unknown by train run run-x.\n"
    )


def test_a_mistyped_sqlite_registry_is_refused_and_not_created(tmp_path, monkeypatch, capsys):
    """`canary status` against a SQLite path that does not exist read as "no canary" while MLflow created an empty
    registry there; it is a bad argument (exit 2) naming the path. shardline's own store may be created."""
    from flows.cli.canary import canary_command, missing_store

    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    typo = tmp_path / "mlflw.db"
    assert canary_command("status", "m", f"sqlite:///{typo}") == 2
    assert capsys.readouterr().err.strip() == (
        f"shardline: canary status: no MLflow database at {typo}: check registry.tracking_uri or "
        "$MLFLOW_TRACKING_URI (a `shardline up` stack's server is used when neither is set)"
    )
    assert not typo.exists()
    assert missing_store(f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}") == ""  # the default store, made on use
    typo.write_bytes(b"")
    assert missing_store(f"sqlite:///{typo}") == "" and missing_store("http://127.0.0.1:5000") == ""
