"""Canary policy as pure functions: a step's numbers from the router's observations, each gate, the verdict.
(What follows an inconclusive step, manual approval, operator commands and PromQL gates: test_canary_operator.py.)"""

from __future__ import annotations

import pytest
from support.canary_steps import CFG, call, challenger_failed, noisy, ob, step_of, to_challenger, to_champion

from deployments.canary_records import StepMetrics, VersionStats, result_of, skipped, steps_table
from deployments.canary_stats import p95, paired_upper_bound
from deployments.rollout_gates import MIN_SAMPLES_P99, errors_already_fail, gate_step, missing_evidence
from deployments.rollout_policy import decide_canary


def test_p95_is_nearest_rank():
    assert p95([]) is None
    assert p95([7.0]) == 7.0
    assert p95([float(i) for i in range(1, 101)]) == 95.0
    assert p95([1.0, 2.0, 3.0, 100.0]) == 100.0


def test_challenger_requests_are_paired_with_the_champion_shadow():
    obs = [
        to_challenger(2.0, 2.5, nbytes=100),
        to_challenger(3.0, 3.5, nbytes=300, probe=True),
        to_challenger(2.0, 2.0, nbytes=100, ch_ms=500.0, op="complete"),  # paired bits, latency not comparable
        to_challenger(9.0, shadow=False),
    ]  # not shadow-scored: no pair
    obs += [to_champion(9.0)] * 3
    step = step_of(50, obs, CFG.model_copy(update={"min_paired": 2}))
    assert (step.requests, step.probe_requests, step.paired) == (7, 1, 3)
    assert step.challenger.n == 4 and step.champion.n == 6  # 3 served + 3 shadow
    # byte-weighted over the paired requests only: neither side's unpaired 9.0 bpb requests count
    assert step.challenger.bpb == pytest.approx((200 + 900 + 200) / 500)
    assert step.champion.bpb == pytest.approx((250 + 1050 + 200) / 500)
    assert step.bpb_regression == pytest.approx(-0.4)
    assert step.challenger_paired_ms == [10.0, 10.0] and step.champion_paired_ms == [10.0, 10.0]
    assert step.paired_deltas[1] == [900.0, 1050.0, 300.0]
    assert step.failures == []


def test_a_step_waits_for_paired_requests_as_well_as_challenger_requests():
    cfg = CFG.model_copy(update={"min_requests": 4, "min_paired": 3})
    # shadow_share < 1: four challenger requests, only two scored by the champion as well
    obs = [to_challenger(), to_challenger(), to_challenger(shadow=False), challenger_failed(), to_champion()]
    assert missing_evidence(obs, cfg) == "2 of canary.min_paired=3 paired requests"
    assert missing_evidence([*obs, to_challenger()], cfg) == ""
    assert missing_evidence([to_champion()], cfg) == (
        "0 of canary.min_requests=4 challenger requests, 0 of canary.min_paired=3 paired requests"
    )


def test_a_good_challenger_is_promoted_after_all_steps():
    steps = []
    for p in (10, 50, 100):
        steps.append(step_of(p, noisy(12, 2.00, 2.02) + [to_champion()] * 4, earlier=steps))
    decision = decide_canary("m", "2", "1", steps, CFG)
    assert decision.verdict == "promoted" and (decision.candidate, decision.baseline) == ("2", "1")
    assert "passed 3 steps up to 100% on 36 paired requests" in decision.reason
    assert "2.0000 vs 2.0200" in decision.reason and "not judged" not in decision.reason
    assert decision.gates["max_bpb_regression"] == 0.05 and decision.gates["min_paired"] == 4
    result = result_of(decision, 100, endpoint_url="http://127.0.0.1:8000")
    assert (result.decision, result.champion_version, result.challenger_version) == ("promoted", "2", "2")
    assert result.final_challenger_percent == 100
    assert [s["percent"] for s in result.steps] == [10, 50, 100]
    assert "paired_deltas" not in result.steps[0] and result.steps[0]["paired"] == 12


def test_a_point_estimate_within_the_gate_is_not_enough_with_few_noisy_pairs():
    # per-request differences +0.30, -0.20, +0.25, -0.25: mean +0.025 < 0.05, but 4 pairs say little
    obs = [to_challenger(2.30, 2.0), to_challenger(1.80, 2.0), to_challenger(2.25, 2.0), to_challenger(1.75, 2.0)]
    step = step_of(10, obs)
    assert step.paired == 4
    assert step.bpb_regression == pytest.approx(0.025)
    assert step.bpb_regression_upper > 0.15
    assert len(step.failures) == 1
    assert "+0.0250, 95% upper bound" in step.failures[0] and "> 0.05" in step.failures[0]
    decision = decide_canary("m", "2", "1", [step], CFG)
    assert decision.verdict == "rejected" and decision.reason.startswith("step 10%: bits/byte 2.0250")
    assert result_of(decision, 0).champion_version == "1"


def test_a_consistent_regression_beyond_the_gate_rejects_and_a_small_one_passes():
    bad = step_of(10, noisy(20, 2.10, 2.00))
    assert bad.bpb_regression == pytest.approx(0.10) and bad.bpb_regression_upper >= 0.10
    assert any("bits/byte 2.1000 vs champion's 2.0000 on the same 20 requests" in f for f in bad.failures)
    small = step_of(10, noisy(20, 2.02, 2.00, spread=0.005))
    assert small.bpb_regression == pytest.approx(0.02) and 0.02 <= small.bpb_regression_upper < 0.05
    assert small.failures == []


def test_a_large_consistent_improvement_passes():
    step = step_of(10, noisy(12, 1.50, 2.00, spread=0.05))
    assert step.bpb_regression == pytest.approx(-0.50)
    assert step.bpb_regression_upper < -0.45 and step.failures == []


def test_too_few_paired_requests_make_the_step_inconclusive_not_failed():
    # excellent numbers, but 3 pairs < min_paired=4: too little evidence is never a pass, and no failure either
    step = step_of(10, [to_challenger(1.0, 2.0)] * 3 + [to_challenger(1.0, shadow=False)] * 10)
    assert step.paired == 3 and step.bpb_regression is None and step.bpb_regression_upper is None
    assert step.failures == [] and step.outcome == "inconclusive"
    assert step.inconclusive == ["only 3 paired requests < canary.min_paired=4: too little evidence to judge quality"]
    decision = decide_canary("m", "2", "1", [step], CFG)
    assert decision.verdict == "inconclusive"
    assert decision.reason == (
        "step 10% inconclusive: only 3 paired requests < canary.min_paired=4: too little "
        "evidence to judge quality (canary.on_inconclusive=rollback); the champion stays"
    )
    assert result_of(decision, 0).champion_version == "1"


def test_an_evidence_shortfall_makes_the_step_inconclusive():
    why = "too little evidence: 3 of canary.min_requests=20 challenger requests in 120 s"
    step = step_of(10, noisy(12, 2.0, 2.0), evidence_failure=why)
    assert step.failures == [] and step.inconclusive == [why] and step.outcome == "inconclusive"
    assert decide_canary("m", "2", "1", [step], CFG).reason.startswith(f"step 10% inconclusive: {why}")


def test_a_breached_gate_outweighs_a_shortfall_in_the_same_step():
    # a regression measured on the pairs there are is a failure even if the request count fell short
    step = step_of(10, noisy(20, 2.10, 2.00), evidence_failure="too little evidence: 5 of 20")
    assert step.outcome == "fail" and step.inconclusive == ["too little evidence: 5 of 20"]
    assert decide_canary("m", "2", "1", [step], CFG).verdict == "rejected"


def test_error_rate_increase_rejects():
    step = step_of(50, [challenger_failed()] + noisy(4, 2.0, 2.0) + [to_champion()] * 3)
    assert step.challenger.n == 5 and step.challenger.errors == 1 and step.challenger.error_rate == pytest.approx(0.2)
    assert step.champion.n == 9 and step.champion.errors == 0  # 5 shadow + 1 fallback + 3 served
    assert (step.fallbacks, step.failed_requests) == (1, 0)  # the client was answered
    assert step.error_rate_increase == pytest.approx(0.2)
    assert step.failures == ["error rate 0.200 (n=5) exceeds champion's 0.000 (n=9) by 0.200 > 0.0"]
    allowed = step_of(
        50, [challenger_failed()] + noisy(4, 2.0, 2.0), CFG.model_copy(update={"max_error_rate_increase": 0.25})
    )
    assert allowed.failures == []


def test_a_challenger_failing_its_requests_ends_the_step_before_its_pairs_come():
    cfg = CFG.model_copy(update={"min_requests": 4, "min_paired": 10})
    failing = [challenger_failed()] * 3 + [to_champion()] * 5
    assert errors_already_fail(failing, cfg) == ""  # 3 of min_requests=4: not judged yet
    failing.append(challenger_failed())
    assert missing_evidence(failing, cfg) == "0 of canary.min_paired=10 paired requests"
    assert errors_already_fail(failing, cfg) == "error rate 1.000 on 4 challenger requests already fails the gate"
    step = step_of(50, failing, cfg)  # what the ramp judges when it ends the step there
    assert step.outcome == "fail" and step.failures[0].startswith("error rate 1.000 (n=4)")
    assert decide_canary("m", "2", "1", [step], cfg).verdict == "rejected"
    # errors within canary.max_error_rate_increase, or no more than the champion's, wait for the pairs as before
    mixed = [challenger_failed()] + [to_challenger()] * 3
    assert errors_already_fail(mixed, cfg.model_copy(update={"max_error_rate_increase": 0.25})) == ""
    assert errors_already_fail(mixed, cfg) == "error rate 0.250 on 4 challenger requests already fails the gate"
    # the champion's own errors count against the increase: 1.000 - 4/12 = 0.667
    both_fail = [challenger_failed()] * 4 + [to_champion(ok=False)] * 4
    assert errors_already_fail(both_fail, cfg.model_copy(update={"max_error_rate_increase": 0.7})) == ""
    assert errors_already_fail(both_fail, cfg.model_copy(update={"max_error_rate_increase": 0.6})) != ""


def test_p95_latency_ratio_rejects():
    step = step_of(100, [to_challenger(ch_ms=40.0, base_ms=10.0)] * 10)
    assert step.p95_ratio == pytest.approx(4.0)
    assert step.failures == ["p95 latency 40.0 ms is 4.00x champion's 10.0 ms on the same 10 requests > 3.0x"]


def test_latency_below_the_floor_is_not_a_regression():
    # 3 ms vs 1 ms is 3x, but both are under the 5 ms floor: scheduling noise
    assert step_of(100, [to_challenger(ch_ms=3.0, base_ms=1.0)] * 10).p95_ratio == pytest.approx(1.0)
    # 12 ms vs 2 ms is 6x raw, 12/5 = 2.4x with the floor: passes the 3x gate
    step = step_of(100, [to_challenger(ch_ms=12.0, base_ms=2.0)] * 10)
    assert step.p95_ratio == pytest.approx(2.4) and step.failures == []


def test_latency_is_compared_on_the_same_requests_only():
    # the champion's fast answers to other requests do not make the challenger look slow
    step = step_of(10, [to_challenger(ch_ms=30.0, base_ms=25.0)] * 5 + [to_champion(ms=6.0)] * 20)
    assert step.champion_paired_p95_ms == 25.0 and step.challenger_paired_p95_ms == 30.0
    assert step.p95_ratio == pytest.approx(1.2) and step.failures == []


def test_p99_is_judged_only_from_enough_pooled_samples():
    normal = [to_challenger(ch_ms=10.0, base_ms=10.0)]
    spiky = normal * 38 + [to_challenger(ch_ms=100.0, base_ms=10.0)] * 2  # 2 of 40 are 10x slower
    alone = step_of(50, spiky)
    assert alone.p99_ratio is None and alone.p95_ratio == pytest.approx(1.0) and alone.failures == []
    earlier = [step_of(10, normal * (MIN_SAMPLES_P99 - 41))]  # pooled: one short of the minimum
    assert step_of(50, spiky, earlier=earlier).p99_ratio is None
    earlier = [step_of(10, normal * (MIN_SAMPLES_P99 - 40))]  # pooled: exactly MIN_SAMPLES_P99
    judged = step_of(50, spiky, earlier=earlier)
    assert judged.p99_ratio == pytest.approx(10.0) and judged.p95_ratio == pytest.approx(1.0)
    assert judged.failures == [
        f"p99 latency 100.0 ms is 10.00x champion's 10.0 ms on the same {MIN_SAMPLES_P99} requests > 5.0x"
    ]


def test_requests_whose_client_got_no_answer_fail_the_step_when_the_challenger_was_routed_them():
    """A failure the champion alone served says nothing of the challenger (in shadow mode it serves every client):
    the step is inconclusive, and the version is not rejected for it."""
    step = step_of(10, noisy(4, 2.0, 2.0) + [to_champion(ok=False)] + [to_champion()] * 2)
    assert step.failed_requests == 1 and step.champion.errors == 1 and step.failures == []
    assert step.inconclusive == ["1 of 7 requests the champion alone answered got no model answer"]
    both_failed = challenger_failed() | {"champion": to_champion(ok=False)["champion"], "client_ok": False}
    step = step_of(10, noisy(4, 2.0, 2.0) + [both_failed])  # routed to the challenger, its fallback failed too
    assert step.failures[-1] == "1 of 5 requests routed to the challenger got no model answer"


def test_the_first_failing_step_is_the_reason():
    good = step_of(10, noisy(4, 2.0, 2.0))
    worse_bpb = step_of(50, noisy(4, 3.0, 2.0), earlier=[good])
    slow = step_of(100, [to_challenger(ch_ms=90.0)] * 4, earlier=[good, worse_bpb])
    decision = decide_canary("m", "2", "1", [good, worse_bpb, slow], CFG)
    assert decision.verdict == "rejected" and decision.reason.startswith("step 50%: bits/byte 3.0000")
    assert "latency" not in decision.reason


def test_a_ramp_that_stopped_early_is_not_promoted():
    decision = decide_canary("m", "2", "1", [step_of(10, noisy(4, 2.0, 2.0))], CFG)
    assert decision.verdict == "rejected" and decision.reason == "ramp stopped at 10% before 100%"
    assert decide_canary("m", "2", "1", [], CFG).reason == "ramp stopped at 0% before 100%"


def test_gate_step_does_not_change_its_input():
    ch = VersionStats(version="2", n=4, errors=0, error_rate=0.0, p95_ms=1.0, bpb=3.0)
    base = VersionStats(version="1", n=4, errors=0, error_rate=0.0, p95_ms=1.0, bpb=2.0)
    deltas = [[300.0, 200.0, 100.0]] * 4
    step = StepMetrics(percent=10, requests=4, challenger=ch, champion=base, paired=4, paired_deltas=deltas)
    before = step.model_dump()
    gated = gate_step(step, CFG)
    assert step.model_dump() == before and step.failures == [] and step.bpb_regression is None
    assert gated.bpb_regression == pytest.approx(1.0) and len(gated.failures) == 1


def test_the_bootstrap_is_deterministic_for_a_seed():
    deltas = [[200.0 + (i * 37 % 23) - 11, 200.0, 100.0 + i] for i in range(12)]
    first = paired_upper_bound(deltas, 0.95, seed=7)
    assert paired_upper_bound(deltas, 0.95, seed=7) == first
    assert paired_upper_bound(deltas, 0.95, seed=8)[1] != first[1]
    assert first[0] == pytest.approx(sum(d[0] - d[1] for d in deltas) / sum(d[2] for d in deltas))
    assert first[0] < first[1] < paired_upper_bound(deltas, 0.99, seed=7)[1]
    obs = [to_challenger(2.30, 2.0), to_challenger(1.80, 2.0), to_challenger(2.25, 2.0), to_challenger(1.75, 2.0)]
    assert step_of(10, obs, seed=3).bpb_regression_upper == step_of(10, obs, seed=3).bpb_regression_upper


def test_steps_table_has_one_row_per_step_with_the_numbers():
    steps = [step_of(10, noisy(4, 2.0, 2.5, spread=0.0)), step_of(50, noisy(4, 3.0, 2.0, spread=0.0))]
    rows = steps_table([steps[0], steps[1].model_dump()])  # StepMetrics, or the dicts CanaryResult carries
    assert [r["step"] for r in rows] == ["10%", "50%"]
    assert rows[0]["v2 bpb"] == "2.000" and rows[0]["v1 bpb"] == "2.500" and rows[0]["verdict"] == "pass"
    assert rows[0]["bpb diff (upper)"] == "-0.500 (-0.500)" and rows[0]["requests (probe)"] == "4 (0)"
    assert rows[0]["v2 p95 ms"] == "10.0" and rows[0]["error rate (ch/base)"] == "0.000/0.000"
    assert rows[1]["verdict"].startswith("bits/byte 3.0000")
    result = result_of(decide_canary("m", "2", "1", steps, CFG), 0)
    assert [r["step"] for r in steps_table(result.steps)] == ["10%", "50%"]


def test_a_skipped_canary_keeps_the_champion():
    result = result_of(skipped("m", "2", "1", "canary.enabled is false"), 0)
    assert (result.decision, result.champion_version, result.reason) == ("skipped", "1", "canary.enabled is false")
    assert result_of(skipped("m", "1", None, "first run"), 0).champion_version == "1"


def test_evidence_exactly_at_a_limit_passes_and_a_zero_ms_baseline_is_no_crash():
    """8/20 - 6/20 is 0.10000000000000003 in floats, and 15.3 / 5.1 is 3.0000000000000004: at the limit, not past it."""
    at_limit = CFG.model_copy(update={"max_error_rate_increase": 0.1, "max_p95_latency_ratio": 3.0})
    errors = [ob("score", "challenger", challenger=call("2", ok=ok)) for ok in [False] * 8 + [True] * 12]
    errors += [ob("score", "champion", champion=call("1", ok=ok)) for ok in [False] * 6 + [True] * 14]
    step = step_of(10, errors, cfg=at_limit)
    assert (step.challenger.error_rate, step.champion.error_rate) == (0.4, 0.3)
    assert step.error_rate_increase > 0.1 and not any("error rate" in f for f in step.failures)
    no_floor = at_limit.model_copy(update={"latency_floor_ms": 0.0})
    slow = step_of(10, [to_challenger(ch_ms=15.3, base_ms=5.1)] * 6, cfg=no_floor)
    assert slow.p95_ratio > 3.0 and slow.failures == []
    zero = step_of(10, [to_challenger(ch_ms=1.0, base_ms=0.0)] * 6, cfg=no_floor)
    assert zero.p95_ratio == float("inf") and zero.failures[0].startswith("p95 latency 1.0 ms is infx")


def test_a_promotion_on_completions_alone_says_its_latency_was_not_judged():
    # completions are paired for quality (the champion scores the same text) but their time is their length's
    steps = []
    for p in (10, 100):
        obs = [to_challenger(2.00 + i % 2 * 0.01, 2.02, op="complete", ch_ms=900.0) for i in range(12)]
        steps.append(step_of(p, obs, earlier=steps))
    assert all(s.p95_ratio is None for s in steps)
    decision = decide_canary("m", "2", "1", steps, CFG)
    assert decision.verdict == "promoted" and decision.reason.endswith(
        "; the latency gates were not judged: no /v1/score request was answered by both versions "
        "(canary.probe_rps > 0 sends such requests)"
    )
