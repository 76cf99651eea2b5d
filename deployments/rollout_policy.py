"""The canary's verdict as pure functions: from judged ramp steps (deployments/rollout_gates computes and judges
each) to the next move, the weights to ramp through, the operator commands a canary accepts, and the decision.

Nothing here talks to Ray, HTTP or MLflow: the decision object (deployments/canary_records) is computed from numbers
only, and is what gets logged and tested. The canary's verdict: promoted, rejected (a gate failed), inconclusive (the
evidence never sufficed; canary.on_inconclusive='extend' re-runs a step up to canary.max_extensions times first),
aborted (an operator's abort, no manual approval within canary.approval_timeout_s, or a pause longer than
canary.pause_timeout_s) or skipped. An operator's
promote or abort (OperatorCommand) ends the canary whatever the steps say; the decision records who and why.
"""

from __future__ import annotations

from typing import Literal

from deployments.canary_records import ACTIONS, CanaryDecision, CanaryState, OperatorCommand, StepMetrics
from deployments.config import CanaryConfig

TimedOut = Literal["", "approval", "pause"]  # what ran out of time: no manual approval, an operator's pause, neither


def next_move(step: StepMetrics, cfg: CanaryConfig) -> Literal["next", "extend", "stop"]:
    """After a judged step: go on to the next weight, run this step again (inconclusive, extend, re-runs left),
    or stop the ramp (a failure, or inconclusive with no re-run left)."""
    if step.outcome == "pass":
        return "next"
    if step.outcome == "inconclusive" and cfg.on_inconclusive == "extend" and step.attempt < cfg.max_extensions:
        return "extend"
    return "stop"


def hold_percent(cfg: CanaryConfig) -> int | None:
    """The weight a manual approval is awaited at (the last step below 100%); None with approval='auto'."""
    if cfg.approval == "auto":
        return None
    return max(s for s in cfg.steps if s < 100)


def ramp_steps(cfg: CanaryConfig) -> list[int]:
    """The weights the driver ramps through on its own: all of canary.steps, or with manual approval those up to
    the held one (the rest is the operator's promote)."""
    hold = hold_percent(cfg)
    return list(cfg.steps) if hold is None else [s for s in cfg.steps if s <= hold]


def command_error(state: CanaryState, action: str, model_name: str) -> str:
    """Why `action` cannot be given to a canary in `state` ("" when it can): the CLI's one-line refusal."""
    if action not in ACTIONS:
        return f"unknown action {action!r}: expected one of {', '.join(ACTIONS)}"
    if state == "none":
        return f"no canary of {model_name} is running; nothing to {action}"
    if state == "deciding":
        return f"the canary of {model_name} has been decided and the decision is being applied; too late to {action}"
    if action == "pause" and state != "running":
        return f"the canary of {model_name} is {state}; only a running canary can be paused"
    if action == "resume" and state != "paused":
        return f"the canary of {model_name} is {state}, not paused; nothing to resume"
    return ""


def _evidence(steps: list[StepMetrics], cfg: CanaryConfig) -> str:
    """The numbers behind a verdict, in one phrase."""
    if not steps:
        return "no step was judged"
    last = steps[-1]
    paired = sum(s.paired for s in steps)
    bpb = (
        f": bits/byte {last.challenger.bpb:.4f} vs {last.champion.bpb:.4f}"
        if last.challenger.bpb is not None and last.champion.bpb is not None
        else ""
    )
    bound = (
        f" ({cfg.confidence:.0%} upper bound of the difference {last.bpb_regression_upper:+.4f})"
        if last.bpb_regression_upper is not None
        else ""
    )
    return f"{len(steps)} steps up to {last.percent}% on {paired} paired requests{bpb}{bound}"


def decide_canary(
    model_name: str,
    candidate: str,
    baseline: str,
    steps: list[StepMetrics],
    cfg: CanaryConfig,
    ended_by: OperatorCommand | None = None,
    timed_out: TimedOut = "",
    commands: list[OperatorCommand] | None = None,
) -> CanaryDecision:
    """The verdict, in this order: an operator's promote or abort (`ended_by`) decides whatever the steps say; no manual
    approval within its timeout, or a pause longer than its timeout (`timed_out`), aborts; the first failing step
    rejects; a last step that stayed inconclusive is inconclusive; a ramp that stopped early is rejected; otherwise
    every step passed: promoted (with approval='manual' only by an operator's promote)."""
    gates: dict[str, float | str] = {
        "max_error_rate_increase": cfg.max_error_rate_increase,
        "max_p95_latency_ratio": cfg.max_p95_latency_ratio,
        "max_p99_latency_ratio": cfg.max_p99_latency_ratio,
        "max_bpb_regression": cfg.max_bpb_regression,
        "confidence": cfg.confidence,
        "min_requests": cfg.min_requests,
        "min_paired": cfg.min_paired,
        "bake_seconds": cfg.bake_seconds,
        "latency_floor_ms": cfg.latency_floor_ms,
        "mode": cfg.mode,
        "approval": cfg.approval,
        "on_inconclusive": cfg.on_inconclusive,
        "max_extensions": cfg.max_extensions,
    }
    common = dict(
        model_name=model_name,
        candidate=candidate,
        baseline=baseline,
        metrics=steps,
        gates=gates,
        commands=list(commands or []),
    )
    evidence = _evidence(steps, cfg)
    if ended_by is not None and ended_by.action in ("promote", "abort"):
        where = f"at {ended_by.percent}% ({ended_by.state})" if ended_by.percent is not None else ""
        why = f": {ended_by.reason}" if ended_by.reason else ""
        if ended_by.action == "promote":
            return CanaryDecision(
                verdict="promoted",
                decided_by="operator",
                **common,
                reason=f"promoted by {ended_by.user} {where}{why}; evidence so far: {evidence}",
            )
        return CanaryDecision(
            verdict="aborted",
            decided_by="operator",
            **common,
            reason=f"aborted by {ended_by.user} {where}{why}; rolled back; evidence: {evidence}",
        )
    if timed_out:
        what = (
            f"no approval within canary.approval_timeout_s={cfg.approval_timeout_s:g} s"
            if timed_out == "approval"
            else f"paused for longer than canary.pause_timeout_s={cfg.pause_timeout_s:g} s"
        )
        return CanaryDecision(
            verdict="aborted",
            decided_by="timeout",
            **common,
            reason=f"{what} at {steps[-1].percent if steps else 0}%; rolled back; evidence: {evidence}",
        )
    for step in steps:
        if step.failures:
            return CanaryDecision(
                verdict="rejected", reason=f"step {step.percent}%: " + "; ".join(step.failures), **common
            )
    if steps and steps[-1].outcome == "inconclusive":
        last = steps[-1]
        runs = f" after {last.attempt + 1} runs" if last.attempt else ""
        return CanaryDecision(
            verdict="inconclusive",
            **common,
            reason=(
                f"step {last.percent}% inconclusive{runs}: "
                + "; ".join(last.inconclusive)
                + f" (canary.on_inconclusive={cfg.on_inconclusive}); the champion stays"
            ),
        )
    target = cfg.steps[-1]
    if not steps or steps[-1].percent != target or cfg.approval == "manual":
        last_percent = steps[-1].percent if steps else 0
        return CanaryDecision(
            verdict="rejected",
            reason=f"ramp stopped at {last_percent}% before {target}%"
            + (" (approval='manual' and no operator promoted)" if cfg.approval == "manual" else ""),
            **common,
        )
    # latency is judged on paired score calls only (a completion's time is its length's): say when there were none
    unjudged = (
        ""
        if any(s.p95_ratio is not None for s in steps)
        else "; the latency gates were not judged: no /v1/score request was answered by both versions "
        "(canary.probe_rps > 0 sends such requests)"
    )
    return CanaryDecision(verdict="promoted", reason=f"version {candidate} passed {evidence}{unjudged}", **common)
