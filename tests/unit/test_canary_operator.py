"""Canary policy beyond one step's gates: what follows an inconclusive step, manual approval, operator commands,
and PromQL gates."""

from __future__ import annotations

import pytest
from support.canary_steps import CFG, noisy, step_of

from deployments.canary_records import OperatorCommand, result_of, steps_table
from deployments.config import CanaryConfig, PromQLGate
from deployments.promql import PromQLError, read_gate, render, value_of
from deployments.rollout_gates import apply_promql, judge_promql
from deployments.rollout_policy import command_error, decide_canary, hold_percent, next_move, ramp_steps

EXTEND = CFG.model_copy(update={"on_inconclusive": "extend", "max_extensions": 2})


def test_on_inconclusive_decides_between_rolling_back_and_running_the_step_again():
    thin = step_of(50, noisy(3, 2.0, 2.0))  # 3 pairs < 4
    assert thin.outcome == "inconclusive"
    assert next_move(thin, CFG) == "stop"  # on_inconclusive=rollback
    assert next_move(thin, EXTEND) == "extend"
    assert next_move(thin.model_copy(update={"attempt": 1}), EXTEND) == "extend"
    assert next_move(thin.model_copy(update={"attempt": 2}), EXTEND) == "stop"  # 2 re-runs used
    assert next_move(step_of(50, noisy(20, 2.10, 2.00)), EXTEND) == "stop"  # a failure is never re-run
    assert next_move(step_of(50, noisy(8, 2.0, 2.0)), EXTEND) == "next"


def test_an_extended_step_that_gets_its_evidence_is_promoted_and_one_that_never_does_is_inconclusive():
    first = step_of(10, noisy(8, 2.0, 2.02))
    thin = step_of(50, noisy(3, 2.0, 2.02), earlier=[first])
    rerun = step_of(50, noisy(8, 2.0, 2.02), earlier=[first, thin]).model_copy(update={"attempt": 1})
    last = step_of(100, noisy(8, 2.0, 2.02), earlier=[first, thin, rerun])
    decision = decide_canary("m", "2", "1", [first, thin, rerun, last], EXTEND)
    assert decision.verdict == "promoted" and "4 steps up to 100% on 27 paired requests" in decision.reason
    assert decision.gates["on_inconclusive"] == "extend" and decision.gates["max_extensions"] == 2
    still_thin = [thin.model_copy(update={"attempt": a}) for a in (0, 1, 2)]
    decision = decide_canary("m", "2", "1", [first, *still_thin], EXTEND)
    assert decision.verdict == "inconclusive" and decision.decided_by == "policy"
    assert decision.reason.startswith("step 50% inconclusive after 3 runs: only 3 paired requests")
    assert result_of(decision, 0).champion_version == "1"


MANUAL = CFG.model_copy(update={"approval": "manual", "approval_timeout_s": 60.0})


def _command(action, percent=50, state="awaiting-approval", reason="looks good on the dashboards"):
    return OperatorCommand(
        id="c1",
        canary_id="k",
        action=action,
        user="ana",
        reason=reason,
        at=1.0,
        applied_at=2.0,
        percent=percent,
        state=state,
    )


def test_manual_approval_holds_the_last_step_below_100_and_only_an_operator_promotes():
    assert hold_percent(CFG) is None and ramp_steps(CFG) == [10, 50, 100]
    assert hold_percent(MANUAL) == 50 and ramp_steps(MANUAL) == [10, 50]
    assert ramp_steps(MANUAL.model_copy(update={"steps": [5, 20, 60]})) == [5, 20, 60]
    steps = [step_of(10, noisy(8, 2.0, 2.02)), step_of(50, noisy(8, 2.0, 2.02))]
    assert decide_canary("m", "2", "1", steps, MANUAL).verdict == "rejected"  # passing alone never promotes
    approved = decide_canary("m", "2", "1", steps, MANUAL, ended_by=_command("promote"), commands=[_command("promote")])
    assert approved.verdict == "promoted" and approved.decided_by == "operator"
    assert approved.reason.startswith(
        "promoted by ana at 50% (awaiting-approval): looks good on the dashboards; "
        "evidence so far: 2 steps up to 50% on 16 paired requests"
    )
    assert [c.action for c in approved.commands] == ["promote"]
    timed_out = decide_canary("m", "2", "1", steps, MANUAL, timed_out="approval")
    assert timed_out.verdict == "aborted" and timed_out.decided_by == "timeout"
    assert timed_out.reason.startswith("no approval within canary.approval_timeout_s=60 s at 50%; rolled back")


def test_a_pause_that_outlasts_its_timeout_rolls_back_whatever_the_step_showed():
    cfg = CFG.model_copy(update={"pause_timeout_s": 900.0})
    failing = [step_of(10, noisy(20, 2.10, 2.00))]  # the operator paused it to look: a timeout is no verdict on it
    paused_out = decide_canary("m", "2", "1", failing, cfg, timed_out="pause")
    assert paused_out.verdict == "aborted" and paused_out.decided_by == "timeout"
    assert paused_out.reason.startswith("paused for longer than canary.pause_timeout_s=900 s at 10%; rolled back")
    with pytest.raises(ValueError, match="pause_timeout_s"):
        CanaryConfig(pause_timeout_s=0)


def test_by_default_a_run_queued_behind_an_unapproved_canary_outlasts_its_approval_and_pause_waits():
    # the queued run holds a trained, validated model: it should get the lock when that canary rolls back
    defaults = CanaryConfig()
    assert defaults.lock_timeout_s > defaults.approval_timeout_s + defaults.pause_timeout_s


def test_manual_approval_needs_a_step_below_100():
    with pytest.raises(ValueError, match=r"canary.steps=\[100\] has none"):
        CanaryConfig(approval="manual", steps=[100])


def test_an_operator_abort_or_early_promote_decides_whatever_the_steps_say():
    failing = [step_of(10, noisy(20, 2.10, 2.00))]
    promoted = decide_canary("m", "2", "1", failing, CFG, ended_by=_command("promote", 10, "running", ""))
    assert promoted.verdict == "promoted" and promoted.reason.startswith("promoted by ana at 10% (running); ")
    good = [step_of(10, noisy(8, 2.0, 2.02))]
    aborted = decide_canary("m", "2", "1", good, CFG, ended_by=_command("abort", 10, "paused", "incident"))
    assert aborted.verdict == "aborted" and aborted.decided_by == "operator"
    assert aborted.reason.startswith("aborted by ana at 10% (paused): incident; rolled back; evidence: 1 steps")
    assert result_of(aborted, 0).champion_version == "1" and result_of(promoted, 100).champion_version == "2"


@pytest.mark.parametrize(
    "state, action, error",
    [
        ("running", "pause", ""),
        ("running", "promote", ""),
        ("running", "abort", ""),
        ("paused", "resume", ""),
        ("paused", "promote", ""),
        ("paused", "abort", ""),
        ("awaiting-approval", "promote", ""),
        ("awaiting-approval", "abort", ""),
        ("running", "resume", "the canary of m is running, not paused; nothing to resume"),
        ("paused", "pause", "the canary of m is paused; only a running canary can be paused"),
        ("awaiting-approval", "pause", "the canary of m is awaiting-approval; only a running canary can be paused"),
        ("none", "pause", "no canary of m is running; nothing to pause"),
        ("none", "abort", "no canary of m is running; nothing to abort"),
        ("running", "stop", "unknown action 'stop': expected one of pause, resume, promote, abort"),
        # decided, being applied: a command now would be acknowledged and then never acted on
        ("deciding", "abort", "the canary of m has been decided and the decision is being applied; too late to abort"),
        ("deciding", "pause", "the canary of m has been decided and the decision is being applied; too late to pause"),
    ],
)
def test_which_commands_a_canary_accepts_in_each_state(state, action, error):
    assert command_error(state, action, "m") == error


def test_an_inconclusive_step_reads_as_such_in_the_table():
    rows = steps_table([step_of(10, noisy(3, 2.0, 2.0))])
    assert rows[0]["verdict"].startswith("inconclusive: only 3 paired requests")


def _gate(**kw):
    return PromQLGate(**({"name": "errors", "query": "sum(rate(x{version='$challenger'}[1m]))"} | kw))


def test_a_promql_gate_passes_inside_its_bounds_and_fails_outside():
    q = "sum(rate(x{version='2'}[1m]))"
    assert judge_promql(_gate(max=0.05), q, 0.02).verdict == "pass"
    failed = judge_promql(_gate(max=0.05), q, 0.08)
    assert (failed.verdict, failed.value, failed.message) == ("fail", 0.08, "PromQL gate errors: 0.08 > max 0.05")
    low = judge_promql(_gate(min=100, max=500), q, 12.0)
    assert low.verdict == "fail" and low.message == "PromQL gate errors: 12 < min 100"
    assert judge_promql(_gate(min=100, max=500), q, 100.0).message == "PromQL gate errors: 100 within min 100, max 500"
    # a ratio at the bound by float rounding is at it, not past it (as the built-in gates judge)
    assert 0.1 * 3 > 0.3 and judge_promql(_gate(max=0.3), q, 0.1 * 3).verdict == "pass"
    assert judge_promql(_gate(min=0.3), q, 0.3 - 1e-12).verdict == "pass"
    assert judge_promql(_gate(max=0.3), q, 0.30001).verdict == "fail"


def test_a_promql_gate_without_a_value_is_no_data_not_a_pass():
    assert (
        judge_promql(_gate(max=1), "q", None).message == "PromQL gate errors: no sample: too little evidence to judge"
    )
    failed_query = judge_promql(_gate(max=1), "q", None, "query failed: ConnectError: refused")
    assert failed_query.verdict == "no-data" and "query failed: ConnectError: refused" in failed_query.message
    assert judge_promql(_gate(max=1), "q", float("nan")).verdict == "no-data"


def test_critical_promql_gates_decide_and_report_only_ones_never_do():
    step = step_of(10, noisy(8, 2.0, 2.02))
    readings = [
        judge_promql(_gate(name="p99", max=0.5), "q1", 0.9),
        judge_promql(_gate(name="cost", max=1.0, critical=False), "q2", 7.0),
        judge_promql(_gate(name="saturation", max=0.8, critical=False), "q3", None),
    ]
    gated = apply_promql(step, readings)
    assert gated.failures == ["PromQL gate p99: 0.9 > max 0.5"] and gated.inconclusive == []
    assert [r.verdict for r in gated.promql] == ["fail", "fail", "no-data"]  # all recorded
    assert step.failures == [] and step.promql == []  # the input is not changed
    assert decide_canary("m", "2", "1", [gated], CFG).reason == "step 10%: PromQL gate p99: 0.9 > max 0.5"
    report_only = apply_promql(step, readings[1:])
    assert report_only.outcome == "pass" and len(report_only.promql) == 2
    no_data = apply_promql(step, [judge_promql(_gate(name="p99", max=0.5), "q1", None)])
    assert no_data.outcome == "inconclusive"


def test_promql_gates_need_a_threshold_and_a_server():
    with pytest.raises(ValueError, match=r"give max, min or both"):
        PromQLGate(name="g", query="up")
    with pytest.raises(ValueError, match=r"canary.promql_gates need canary.prometheus_url"):
        CanaryConfig(promql_gates=[_gate(max=1)])


def test_an_instant_query_answer_gives_one_value():
    def vector(*values):
        return {
            "status": "success",
            "data": {
                "resultType": "vector",
                "result": [{"metric": {"version": str(i)}, "value": [1.0, v]} for i, v in enumerate(values)],
            },
        }

    assert value_of(vector("0.25")) == 0.25
    assert value_of(vector()) is None and value_of(vector("NaN")) is None
    assert value_of({"status": "success", "data": {"resultType": "scalar", "result": [1.0, "3"]}}) == 3.0
    with pytest.raises(PromQLError, match=r"2 series; aggregate the query to one"):
        value_of(vector("1", "2"))
    with pytest.raises(PromQLError, match=r"bad_data: parse error"):
        value_of({"status": "error", "errorType": "bad_data", "error": "parse error"})
    assert (
        render("rate(x{model='$model',v='$challenger'}[1m]) / $champion", "m", "1", "2")
        == "rate(x{model='m',v='2'}[1m]) / 1"
    )
    with pytest.raises(PromQLError, match=r"^model 'm\"} or vector\(1\) #' has a quote, backslash or newline"):
        render('x{model="$model"}', 'm"} or vector(1) #', "1", "2")
    refused = read_gate("http://127.0.0.1:9", _gate(max=1), "a'b", "1", "2")
    assert refused.verdict == "no-data" and 'query failed: model "a\'b" has a quote' in refused.message
