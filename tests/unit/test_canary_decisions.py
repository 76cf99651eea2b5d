"""Canary policy as pure functions: per-step numbers from observations, each gate, and the final verdict."""
from __future__ import annotations

import pytest

from deployments.canary import (
    Observation, StepMetrics, VersionStats, decide_canary, gate_step, p95, pick_payloads, result_of, steps_table,
    summarize_step,
)
from deployments.config import CanaryConfig

CFG = CanaryConfig(max_error_rate_increase=0.0, max_p95_latency_ratio=3.0, max_bpb_regression=0.05,
                   latency_floor_ms=5.0)


def _call(role, version, bpb=2.0, nbytes=100, ms=10.0, ok=True):
    if not ok:
        return {"role": role, "version": version, "ok": False, "error": "RuntimeError: boom"}
    return {"role": role, "version": version, "ok": True, "bits": bpb * nbytes, "bytes": nbytes, "bpb": bpb,
            "latency_ms": ms}


def _to_challenger(ch_bpb=2.0, base_bpb=2.0, ch_ms=10.0, base_ms=10.0, ok=True, nbytes=100):
    served = _call("challenger", "2", ch_bpb, nbytes, ch_ms, ok)
    shadow = _call("champion", "1", base_bpb, nbytes, base_ms)
    return Observation(status=200 if ok else 500, served=served, shadow=shadow, client_ms=12.0)


def _to_champion(bpb=2.0, ms=10.0, ok=True):
    return Observation(status=200 if ok else 500, served=_call("champion", "1", bpb, 100, ms, ok), client_ms=11.0)


def _step(percent, observations, cfg=CFG):
    return summarize_step(percent, observations, "1", "2", cfg)


def test_p95_is_nearest_rank():
    assert p95([]) is None
    assert p95([7.0]) == 7.0
    assert p95([float(i) for i in range(1, 101)]) == 95.0
    assert p95([1.0, 2.0, 3.0, 100.0]) == 100.0


def test_summary_pairs_challenger_requests_with_the_champion_shadow():
    obs = [_to_challenger(2.0, 2.5, nbytes=100), _to_challenger(3.0, 3.5, nbytes=300)] + [_to_champion(9.0)] * 3
    step = _step(50, obs)
    assert step.requests == 5 and step.paired == 2
    assert step.challenger.n == 2 and step.champion.n == 5  # 3 served + 2 shadow
    # byte-weighted over the paired requests only: the champion's own 9.0 bpb requests do not count
    assert step.challenger.bpb == pytest.approx((200 + 900) / 400)
    assert step.champion.bpb == pytest.approx((250 + 1050) / 400)
    assert step.bpb_regression == pytest.approx(-0.5)
    assert step.failures == []


def test_a_good_challenger_is_promoted_after_all_steps():
    steps = [_step(p, [_to_challenger(2.00, 2.02)] * 3 + [_to_champion()] * 2) for p in (10, 50, 100)]
    decision = decide_canary("m", "2", "1", steps, CFG)
    assert decision.verdict == "promoted"
    assert decision.candidate == "2" and decision.baseline == "1"
    assert "passed 3 steps" in decision.reason and "2.0000 vs 2.0200" in decision.reason
    result = result_of(decision, 100)
    assert result.champion_version == "2" and result.decision == "promoted"
    assert [s["percent"] for s in result.steps] == [10, 50, 100]


def test_bpb_regression_beyond_the_gate_rejects():
    step = _step(10, [_to_challenger(2.10, 2.00)] * 4)
    assert step.bpb_regression == pytest.approx(0.10)
    assert len(step.failures) == 1 and "bits/byte 2.1000 vs champion's 2.0000" in step.failures[0]
    decision = decide_canary("m", "2", "1", [step], CFG)
    assert decision.verdict == "rejected" and decision.reason.startswith("step 10%: bits/byte")
    assert result_of(decision, 0).champion_version == "1"


def test_bpb_regression_within_the_gate_passes():
    step = _step(10, [_to_challenger(2.04, 2.00)] * 4)
    assert step.failures == []


def test_error_rate_increase_rejects():
    step = _step(50, [_to_challenger(ok=False)] + [_to_challenger()] * 3 + [_to_champion()] * 4)
    assert step.challenger.errors == 1 and step.challenger.error_rate == pytest.approx(0.25)
    assert step.champion.error_rate == 0.0
    assert step.error_rate_increase == pytest.approx(0.25)
    assert any("error rate 0.250" in f for f in step.failures)


def test_error_rate_increase_within_allowance_passes():
    cfg = CFG.model_copy(update={"max_error_rate_increase": 0.3})
    step = _step(50, [_to_challenger(ok=False)] + [_to_challenger()] * 3, cfg)
    assert step.failures == []


def test_p95_latency_ratio_rejects():
    step = _step(100, [_to_challenger(ch_ms=40.0, base_ms=10.0)] * 5)
    assert step.p95_ratio == pytest.approx(4.0)
    assert any("p95 latency 40.0 ms is 4.00x" in f for f in step.failures)


def test_latency_below_the_floor_is_not_a_regression():
    # 0.3 ms vs 0.1 ms is 3x, but both are under the 5 ms floor: scheduling noise
    step = _step(100, [_to_challenger(ch_ms=0.3, base_ms=0.1)] * 5)
    assert step.p95_ratio == pytest.approx(1.0) and step.failures == []


def test_requests_that_never_reached_a_model_fail_the_step():
    step = _step(10, [Observation(status=0, error="ConnectError")] + [_to_champion()] * 3)
    assert step.unattributed_errors == 1
    assert step.failures == ["1 of 4 requests failed before reaching a model"]


def test_the_first_failing_step_is_the_reason():
    good = _step(10, [_to_challenger()] * 2)
    bad = _step(50, [_to_challenger(3.0, 2.0)] * 2)
    decision = decide_canary("m", "2", "1", [good, bad], CFG)
    assert decision.verdict == "rejected" and decision.reason.startswith("step 50%")


def test_no_challenger_evidence_rejects():
    steps = [_step(p, [_to_champion()] * 3) for p in (10, 50, 100)]
    decision = decide_canary("m", "2", "1", steps, CFG)
    assert decision.verdict == "rejected" and "no challenger request" in decision.reason


def test_a_ramp_that_stopped_early_is_not_promoted():
    steps = [_step(10, [_to_challenger()] * 2)]
    decision = decide_canary("m", "2", "1", steps, CFG)
    assert decision.verdict == "rejected" and "before 100%" in decision.reason


def test_gate_step_does_not_change_its_input():
    stats = VersionStats(version="2", n=1, errors=0, error_rate=0.0, p95_ms=1.0, bpb=5.0)
    base = VersionStats(version="1", n=1, errors=0, error_rate=0.0, p95_ms=1.0, bpb=1.0)
    step = StepMetrics(percent=10, requests=1, challenger=stats, champion=base, paired=1)
    gated = gate_step(step, CFG)
    assert step.failures == [] and len(gated.failures) == 1


def test_payloads_are_reproducible_per_seed_and_step():
    texts = [bytes([65 + i]) * (10 + i) for i in range(20)] + [b"x"]
    a = pick_payloads(texts, 8, seed=1, step=0, max_bytes=12)
    assert a == pick_payloads(texts, 8, seed=1, step=0, max_bytes=12)
    assert a != pick_payloads(texts, 8, seed=1, step=1, max_bytes=12)
    assert all(2 <= len(p) <= 12 for p in a)
    with pytest.raises(ValueError, match="no held-out text"):
        pick_payloads([b"", b"x"], 3, seed=0, step=0, max_bytes=10)


def test_latency_is_compared_on_the_same_requests_only():
    # the champion's fast answers to other (e.g. shorter) requests do not make the challenger look slow
    obs = [_to_challenger(ch_ms=30.0, base_ms=25.0)] * 3 + [_to_champion(ms=6.0)] * 7
    step = _step(10, obs)
    assert step.champion.p95_ms == 25.0 and step.champion_paired_p95_ms == 25.0
    assert step.challenger_paired_p95_ms == 30.0
    assert step.p95_ratio == pytest.approx(1.2) and step.failures == []


def test_latency_gate_pools_the_paired_requests_of_earlier_steps():
    # one 48 ms hiccup among 4 paired requests is this step's p95; pooled with 19 earlier pairs it is not
    earlier = [_step(10, [_to_challenger(ch_ms=6.0, base_ms=6.0)] * 19)]
    spike = [_to_challenger(ch_ms=48.0, base_ms=6.0)] + [_to_challenger(ch_ms=6.0, base_ms=6.0)] * 3
    assert _step(50, spike).failures  # alone: 8x
    pooled = summarize_step(50, spike, "1", "2", CFG, earlier)
    assert pooled.challenger_paired_p95_ms == 6.0 and pooled.failures == []
    # a consistent regression still fails once pooled
    slow = [_to_challenger(ch_ms=30.0, base_ms=6.0)] * 20
    assert summarize_step(50, slow, "1", "2", CFG, earlier).p95_ratio == pytest.approx(5.0)


def test_steps_table_has_one_row_per_step_with_the_numbers():
    steps = [_step(10, [_to_challenger(2.0, 2.5)] * 2), _step(50, [_to_challenger(3.0, 2.0)] * 2)]
    rows = steps_table([steps[0], steps[1].model_dump()])  # StepMetrics, or the dicts CanaryResult carries
    assert [r["step"] for r in rows] == ["10%", "50%"]
    assert rows[0]["v2 bpb"] == "2.000" and rows[0]["v1 bpb"] == "2.500" and rows[0]["verdict"] == "pass"
    assert rows[1]["verdict"].startswith("bits/byte 3.0000")
