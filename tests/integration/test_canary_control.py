"""Operator control of a live canary, for real: Ray Serve over HTTP under loopback load, MLflow on SQLite, the
`shardline canary` command called in-process while the rollout driver runs in a thread (as it would in a worker).

A canary is paused (its weight holds across more than a step's bake and several lease renewals, and no step is
judged), resumed, then promoted early; a shadow-mode canary with manual approval waits in awaiting-approval, the
challenger answering no client, until an operator promotes it; an approval that never comes, and a pause nobody
resumes, roll back. The tests
share one endpoint, and each canaries a version it registers against whatever is champion when it starts, so they
pass in any order (release_candidate).
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from support.load import Load
from support.serve_support import NAME, bigram_logits, corpus, log_model, register, serving_world

from deployments import endpoint, serve_build
from deployments.canary_control import read_status
from deployments.config import CanaryConfig
from deployments.registry import CHALLENGER, TAG_CANARY_DECISION, TAG_CANARY_ID, read_aliases
from deployments.rollout import run_rollout
from flows import cli

pytestmark = pytest.mark.slow

CFG = CanaryConfig(
    steps=[10, 50, 100],
    min_requests=6,
    bake_seconds=4.0,
    step_timeout_s=90,
    probe_rps=6.0,
    min_paired=5,
    seed=5,
    lease_s=10.0,
    latency_floor_ms=25.0,
    # These tests are about an operator's control, not latency (test_endpoint.py gates a slow challenger). A
    # challenger's first calls can be cold: CI of 2026-12-05 rejected the shadow canary's on "p95 latency 77.1 ms
    # is 3.09x champion's 12.6 ms on the same 12 requests", its first two paired calls 77 and 75 ms, then 24 to 6.
    max_p95_latency_ratio=20.0,
    max_p99_latency_ratio=20.0,
    control_poll_s=0.3,
)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    fit, _ = corpus()
    tables = {
        "weak": bigram_logits(fit, smoothing=50.0),
        "good": bigram_logits(fit, smoothing=0.05),
        "good2": bigram_logits(fit, smoothing=0.04),
    }
    saved = dict(os.environ)  # `shardline canary` runs in this process; whatever it sets is put back
    try:
        with serving_world(tmp_path_factory.mktemp("home"), "canary-control-it", tables) as w:
            yield {**w, "url": endpoint.reconcile(w["serve"], NAME, w["uri"]).url}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def shardline_canary(capsys, world, *args: str) -> tuple[int, dict | None, str]:
    """`shardline canary ARGS --json` in this process: (exit code, the JSON it printed, stderr)."""
    capsys.readouterr()
    code = cli.main(["canary", *args, "--model", NAME, "--json", "--set", f"registry.tracking_uri={world['uri']}"])
    out = capsys.readouterr()
    lines = [line for line in out.out.splitlines() if line.startswith("{")]
    return code, json.loads(lines[-1]) if lines else None, out.err


class Driver(threading.Thread):
    """run_rollout in a thread, as the canary stage would run it, logging to a canary-stage MLflow run."""

    def __init__(self, world, cfg: CanaryConfig, champion: str, challenger: str):
        super().__init__(daemon=True)
        client = world["client"]
        self.run_id = client.create_run(
            world["exp"], run_name=f"canary-v{challenger}", tags={"shardline.stage": "canary_deploy"}
        ).info.run_id
        self.args = (cfg, world["serve"], NAME, champion, challenger, world["uri"], world["heldout"])
        self.client, self.steps, self.result, self.error = client, [], None, None

    def log_decision(self, decision) -> None:
        self.client.log_dict(self.run_id, decision.model_dump(mode="json"), "canary_decision.json")

    def run(self) -> None:
        try:
            self.result = run_rollout(
                *self.args,
                run_id=self.run_id,
                log_decision=self.log_decision,
                on_step=lambda i, s: self.steps.append(s),
            )
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def wait_for(predicate, timeout: float, what: str, driver: Driver):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and driver.is_alive():
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(
        f"gave up waiting for {what}: driver error {driver.error!r}, result "
        f"{driver.result.reason if driver.result else None}, steps "
        f"{[(s.percent, s.failures, s.inconclusive) for s in driver.steps]}"
    )


def release_candidate(world, table: str, name: str = "") -> tuple[str, str]:
    """(the champion now, a newly registered version of `table`): each test canaries against whatever an earlier
    test left as champion (world's first version when it runs alone), so none depends on the order they run in."""
    client = world["client"]
    champion = read_aliases(client, NAME)["champion"]
    version = register(client, *log_model(world["tables"][table], name or table, world["exp"], client)).version
    assert version != champion
    return champion, version


def assert_aborted_back_to(world, load, base: str, ver: str) -> None:
    """A canary that timed out: no client saw a failure, `base` is champion and alone served, and `ver` is marked
    aborted, not rejected (it may be canaried again)."""
    client = world["client"]
    assert not load.failed, load.failed[:5]
    aliases = read_aliases(client, NAME)
    assert aliases["champion"] == base and CHALLENGER not in aliases
    tags = client.get_model_version(NAME, ver).tags
    assert tags[TAG_CANARY_DECISION] == "aborted" and "rejected" not in tags
    assert endpoint.served_versions(serve_build.app_name_for(world["serve"], NAME)) == [base]


def test_an_operator_pauses_resumes_and_promotes_a_live_canary_early(world, capsys, monkeypatch):
    monkeypatch.setenv("SHARDLINE_USER", "ana")
    client, _uri = world["client"], world["uri"]
    base, ver = release_candidate(world, "good")
    code, status, err = shardline_canary(capsys, world, "pause", "--reason", "nothing runs")
    assert (
        code == 1
        and status is None
        and err.strip() == (f"shardline: canary pause: no canary of {NAME} is running; nothing to pause")
    )
    app = serve_build.app_name_for(world["serve"], NAME)
    with Load(world["url"], world["texts"], rps=6.0, max_seconds=240) as load:
        driver = Driver(world, CFG, base, ver)
        driver.start()
        wait_for(
            lambda: read_status(client, NAME).state == "running" and read_status(client, NAME).percent > 0,
            120,
            "the canary to run",
            driver,
        )
        code, out, err = shardline_canary(capsys, world, "pause", "--reason", "checking the dashboards")
        assert code == 0, err
        assert out["status"]["state"] == "paused" and out["command"]["user"] == "ana"
        held, judged = out["status"]["percent"], len(driver.steps)
        assert held in (10, 50)
        # held for longer than a step's bake and than the lease itself (so only its renewals keep the weight):
        # the router's weight stays, nothing is judged
        samples, start = [], time.monotonic()
        while time.monotonic() - start < CFG.lease_s + 2:
            samples.append((endpoint.read_state(app)["effective_percent"], read_status(client, NAME).state))
            time.sleep(0.5)
        # the loop above spans the whole hold whatever each read costs; a slow machine gets fewer samples of it
        assert set(samples) == {(held, "paused")} and len(samples) >= 5 and len(driver.steps) == judged
        code, status, _ = shardline_canary(capsys, world, "status")
        assert code == 0 and {
            k: status[k] for k in ("model", "state", "champion_version", "challenger_version", "percent")
        } == {"model": NAME, "state": "paused", "champion_version": base, "challenger_version": ver, "percent": held}
        assert status["step"] == CFG.steps.index(held) + 1 and status["steps"] == 3
        code, _, err = shardline_canary(capsys, world, "pause")
        assert code == 1 and "is paused; only a running canary can be paused" in err
        code, out, err = shardline_canary(capsys, world, "resume", "--reason", "dashboards fine")
        assert code == 0 and out["status"]["state"] == "running", err
        wait_for(
            lambda: read_status(client, NAME).percent == 50 or read_status(client, NAME).state == "none",
            120,
            "the 50% step",
            driver,
        )
        code, out, err = shardline_canary(capsys, world, "promote", "--reason", "ship it before the freeze")
        assert code == 0, err
        driver.join(timeout=120)
        time.sleep(1.0)  # a few requests after the promotion
    assert driver.error is None, driver.error
    result = driver.result
    assert result.decision == "promoted" and result.reason.startswith(
        "promoted by ana at 50% (running): ship it before the freeze; evidence so far: "
    ), result.reason
    assert [s["percent"] for s in result.steps][-1] == 50  # 100% was skipped: the operator promoted early
    assert out["status"]["state"] == "none" and out["status"]["champion_version"] == ver
    assert not load.failed and load.answers, load.failed[:5]
    versions = [a.version for a in load.answers]
    assert versions[0] == base and versions[-1] == ver
    # the registry tells the truth
    aliases = read_aliases(client, NAME)
    assert aliases["champion"] == ver and CHALLENGER not in aliases
    mv = client.get_model_version(NAME, ver)
    assert mv.tags[TAG_CANARY_DECISION] == "promoted"
    assert mv.description.startswith(f"Trained on dataset unknown by train run {mv.run_id}.\n")
    assert f"Canary against champion v{base}: promoted (operator, " in mv.description and "ship it" in mv.description
    # every command is on the canary stage's run (found by its tag) and in the decision artifact
    run = client.get_run(driver.run_id)
    assert run.data.tags[TAG_CANARY_ID] == out["command"]["canary_id"]
    recorded = sorted(a.path for a in client.list_artifacts(driver.run_id, "canary_commands"))
    assert [p.rsplit("-", 2)[1] for p in recorded] == ["pause", "resume", "promote"]
    decision = json.loads(open(client.download_artifacts(driver.run_id, "canary_decision.json")).read())
    assert [(c["action"], c["user"], c["reason"]) for c in decision["commands"]] == [
        ("pause", "ana", "checking the dashboards"),
        ("resume", "ana", "dashboards fine"),
        ("promote", "ana", "ship it before the freeze"),
    ]
    assert decision["decided_by"] == "operator" and all(c["applied_at"] >= c["at"] for c in decision["commands"])
    code, status, _ = shardline_canary(capsys, world, "status")
    assert code == 0 and (status["state"], status["champion_version"], status["challenger_version"]) == (
        "none",
        ver,
        None,
    )


def test_a_shadow_canary_with_manual_approval_waits_until_an_operator_promotes(world, capsys, monkeypatch):
    monkeypatch.setenv("SHARDLINE_USER", "bo")
    client = world["client"]
    base, ver = release_candidate(world, "good2")
    cfg = CFG.model_copy(
        update={
            "steps": [20, 50, 100],
            "approval": "manual",
            "approval_timeout_s": 120.0,
            "mode": "shadow",
            "bake_seconds": 2.0,
        }
    )
    with Load(world["url"], world["texts"], rps=6.0, max_seconds=240) as load:
        driver = Driver(world, cfg, base, ver)
        driver.start()
        wait_for(lambda: read_status(client, NAME).state == "awaiting-approval", 150, "awaiting-approval", driver)
        code, status, _ = shardline_canary(capsys, world, "status")
        assert (status["state"], status["percent"], status["challenger_version"]) == ("awaiting-approval", 50, ver)
        assert status["approval_deadline"] > time.time() + 60
        time.sleep(3.0)  # longer than a step's bake: still waiting, nothing more judged
        assert read_status(client, NAME).state == "awaiting-approval" and len(driver.steps) == 2
        assert endpoint.read_state(serve_build.app_name_for(world["serve"], NAME))["effective_percent"] == 50
        code, _, err = shardline_canary(capsys, world, "pause")
        assert code == 1 and "is awaiting-approval; only a running canary can be paused" in err
        before_promote = time.time()
        code, out, err = shardline_canary(capsys, world, "promote", "--reason", "approved")
        assert code == 0, err
        driver.join(timeout=120)
        time.sleep(1.0)
    assert driver.error is None, driver.error
    result = driver.result
    assert result.decision == "promoted" and result.reason.startswith(
        "promoted by bo at 50% (awaiting-approval): approved"
    ), result.reason
    assert [s["percent"] for s in result.steps] == [20, 50]
    # shadow: the challenger's answers were evidence, never a client's answer
    for step in result.steps:
        assert step["challenger"]["n"] >= cfg.min_requests and step["paired"] >= cfg.min_paired
    assert not load.failed, load.failed[:5]
    assert {a.version for a in load.answers if a.t < before_promote} == {base}
    assert load.answers[-1].version == ver
    aliases = read_aliases(client, NAME)
    assert aliases["champion"] == ver and CHALLENGER not in aliases


def test_a_manual_approval_that_never_comes_rolls_back_when_it_times_out(world, capsys):
    client = world["client"]
    base, ver = release_candidate(world, "good", "good-again")
    cfg = CFG.model_copy(
        update={"steps": [30, 100], "approval": "manual", "approval_timeout_s": 4.0, "bake_seconds": 2.0}
    )
    with Load(world["url"], world["texts"], rps=6.0, max_seconds=240) as load:
        driver = Driver(world, cfg, base, ver)
        driver.start()
        wait_for(lambda: read_status(client, NAME).state == "awaiting-approval", 150, "awaiting-approval", driver)
        driver.join(timeout=120)
    assert driver.error is None, driver.error
    result = driver.result
    assert result.decision == "aborted" and result.reason.startswith(
        "no approval within canary.approval_timeout_s=4 s at 30%; rolled back"
    ), result.reason
    assert_aborted_back_to(world, load, base, ver)
    code, status, _ = shardline_canary(capsys, world, "status")
    assert (status["state"], status["champion_version"], status["challenger_version"]) == ("none", base, None)


def test_a_pause_nobody_resumes_rolls_back_when_it_times_out(world, capsys, monkeypatch):
    monkeypatch.setenv("SHARDLINE_USER", "cy")
    client = world["client"]
    base, ver = release_candidate(world, "good", "good-paused")
    # a long bake: the 30% step is still baking when the operator pauses it
    cfg = CFG.model_copy(update={"steps": [30, 100], "pause_timeout_s": 4.0, "bake_seconds": 60.0})
    with Load(world["url"], world["texts"], rps=6.0, max_seconds=240) as load:
        driver = Driver(world, cfg, base, ver)
        driver.start()
        wait_for(lambda: read_status(client, NAME).percent == 30, 150, "the 30% step", driver)
        code, out, err = shardline_canary(capsys, world, "pause", "--reason", "lunch")
        assert code == 0, err
        assert out["status"]["state"] == "paused" and out["status"]["pause_deadline"] > time.time()
        driver.join(timeout=120)
    assert driver.error is None, driver.error
    result = driver.result
    assert result.decision == "aborted" and result.reason.startswith(
        "paused for longer than canary.pause_timeout_s=4 s at 30%; rolled back"
    ), result.reason
    paused = result.steps[-1]  # judged on what it had when the pause began: not a pass, whatever that was
    assert paused["percent"] == 30 and paused["failures"] == []
    assert paused["inconclusive"][0] == "paused for longer than canary.pause_timeout_s=4 s: not judged"
    assert_aborted_back_to(world, load, base, ver)


class JudgingOperator(Driver):
    """A Driver whose operator gives `action` while step `at` is being judged (after its evidence is in, before the
    next weight or the verdict is set: as if its PromQL gates took a while), without waiting for it to be acted on."""

    def __init__(self, world, cfg: CanaryConfig, champion: str, challenger: str, action: str, at: int):
        super().__init__(world, cfg, champion, challenger)
        self.action, self.at = action, at

    def run(self) -> None:
        from deployments.canary_control import CommandRefused, send_command

        def on_step(index: int, step) -> None:
            self.steps.append(step)
            if index == self.at:
                try:  # written at once; acted on only once this step's judgement returns
                    send_command(self.client, NAME, self.action, "seen on the dashboards", "dee", wait_s=0)
                except CommandRefused:
                    pass

        try:
            self.result = run_rollout(*self.args, run_id=self.run_id, log_decision=self.log_decision, on_step=on_step)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def _commands(driver: Driver) -> list[tuple[str, int]]:
    decision = json.loads(open(driver.client.download_artifacts(driver.run_id, "canary_decision.json")).read())
    return [(c["action"], c["percent"]) for c in decision["commands"]]


@pytest.mark.parametrize("action", ["pause", "abort"])
def test_a_command_given_while_a_step_is_judged_acts_before_the_weight_moves_on(world, capsys, action):
    """Commands were read only while a step collected evidence: a pause or abort given while the 10% step was
    judged took effect once 50% had been applied."""
    client = world["client"]
    base, ver = release_candidate(world, "good", f"good-judged-{action}")
    cfg = CFG.model_copy(update={"bake_seconds": 2.0, "pause_timeout_s": 120.0})
    app = serve_build.app_name_for(world["serve"], NAME)
    with Load(world["url"], world["texts"], rps=6.0, max_seconds=240) as load:
        driver = JudgingOperator(world, cfg, base, ver, action, at=0)
        driver.start()
        if action == "pause":
            wait_for(lambda: read_status(client, NAME).state == "paused", 150, "the pause", driver)
            assert read_status(client, NAME).percent == 10 and endpoint.read_state(app)["effective_percent"] == 10
            code, _, err = shardline_canary(capsys, world, "resume", "--reason", "fine")
            assert code == 0, err
        driver.join(timeout=180)
    assert driver.error is None, driver.error
    if action == "abort":  # decided at 10%: the challenger never got 50%
        assert driver.result.decision == "aborted" and [s["percent"] for s in driver.result.steps] == [10]
        assert _commands(driver) == [("abort", 10)]
        assert_aborted_back_to(world, load, base, ver)
    else:  # held at 10% until the resume, then on through 50% and 100%
        assert driver.result.decision == "promoted" and [s["percent"] for s in driver.result.steps] == [10, 50, 100]
        assert _commands(driver) == [("pause", 10), ("resume", 10)] and not load.failed, load.failed[:5]


def test_an_abort_given_while_the_last_step_is_judged_decides_instead_of_a_promotion(world):
    base, ver = release_candidate(world, "good", "good-last-judged")
    cfg = CFG.model_copy(update={"steps": [10, 100], "bake_seconds": 2.0})
    with Load(world["url"], world["texts"], rps=6.0, max_seconds=240) as load:
        driver = JudgingOperator(world, cfg, base, ver, "abort", at=1)
        driver.start()
        driver.join(timeout=180)
    assert driver.error is None, driver.error
    assert driver.result.decision == "aborted" and [s["percent"] for s in driver.result.steps] == [10, 100]
    assert _commands(driver) == [("abort", 100)]
    assert_aborted_back_to(world, load, base, ver)


def test_a_pause_given_between_steps_that_outlasts_its_timeout_rolls_back(world):
    base, ver = release_candidate(world, "good", "good-paused-between")
    cfg = CFG.model_copy(update={"steps": [10, 100], "bake_seconds": 2.0, "pause_timeout_s": 3.0})
    with Load(world["url"], world["texts"], rps=6.0, max_seconds=240) as load:
        driver = JudgingOperator(world, cfg, base, ver, "pause", at=0)
        driver.start()
        driver.join(timeout=180)
    assert driver.error is None, driver.error
    assert driver.result.decision == "aborted" and driver.result.reason.startswith(
        "paused for longer than canary.pause_timeout_s=3 s at 10%; rolled back"
    ), driver.result.reason
    assert [s["percent"] for s in driver.result.steps] == [10] and _commands(driver) == [("pause", 10)]
    assert_aborted_back_to(world, load, base, ver)


def test_a_promote_given_after_the_approval_wait_s_last_poll_is_taken_at_its_deadline(world, capsys):
    """The wait for approval ended at its deadline without a last read: a promote written after its last poll (here
    its only one: canary.control_poll_s is longer than the wait) was lost and the canary aborted as timed out."""
    client = world["client"]
    base, ver = release_candidate(world, "good", "good-late-approval")
    cfg = CFG.model_copy(
        update={
            "steps": [30, 100],
            "approval": "manual",
            "approval_timeout_s": 8.0,
            "control_poll_s": 60.0,
            "bake_seconds": 2.0,
        }
    )
    with Load(world["url"], world["texts"], rps=6.0, max_seconds=240) as load:
        driver = Driver(world, cfg, base, ver)
        driver.start()
        wait_for(lambda: read_status(client, NAME).state == "awaiting-approval", 150, "awaiting-approval", driver)
        code, _, err = shardline_canary(capsys, world, "promote", "--reason", "just in time")
        assert code == 0, err
        driver.join(timeout=120)
    assert driver.error is None, driver.error
    assert driver.result.decision == "promoted" and "at 30% (awaiting-approval): just in time" in driver.result.reason
    assert not load.failed, load.failed[:5]
    assert read_aliases(client, NAME)["champion"] == ver
