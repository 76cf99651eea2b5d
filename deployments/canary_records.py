"""What a canary records: each ramp step's numbers, the operator's commands, the decision and the stage's result.

These are the objects the policy (deployments/rollout_gates, deployments/rollout_policy) computes and the driver logs:
the decision is an MLflow JSON artifact and tags, the steps a Prefect table, the result what the canary stage returns
to the flow.
Plain data, no behaviour beyond presenting it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, Field

Verdict = Literal["promoted", "rejected", "inconclusive", "aborted", "skipped"]
StepOutcome = Literal["pass", "fail", "inconclusive"]
Action = Literal["pause", "resume", "promote", "abort"]
# deciding: the verdict is in and being applied (registry, then traffic); no command can change it any more
CanaryState = Literal["running", "paused", "awaiting-approval", "deciding", "none"]
ACTIONS: tuple[str, ...] = ("pause", "resume", "promote", "abort")


class VersionStats(BaseModel):
    """One version's numbers at one ramp step."""

    version: str
    n: int = Field(description="Calls this version answered or failed (the champion's include shadow calls).")
    errors: int
    error_rate: float
    p95_ms: float | None = Field(description="p95 model latency of its successful score calls; None without.")
    bpb: float | None = Field(description="Bits per byte over the paired requests.")


class GateReading(BaseModel):
    """One PromQL gate's value at the end of a step and what it says."""

    name: str
    query: str = Field(description="The query as sent (placeholders replaced).")
    value: float | None
    critical: bool
    verdict: Literal["pass", "fail", "no-data"]
    message: str


class StepMetrics(BaseModel):
    """One ramp step: the weight, both versions' numbers on the same requests, the gate values and failures."""

    percent: int
    requests: int = Field(description="Requests the router recorded at this step (live and probe).")
    probe_requests: int = 0
    seconds: float = 0.0
    challenger: VersionStats
    champion: VersionStats
    paired: int = Field(description="Challenger requests that both versions scored (the quality comparison's n).")
    paired_deltas: list[list[float]] = Field(
        [], description="Per paired request: [challenger bits, champion bits, bytes] (the bootstrap's input)."
    )
    challenger_paired_ms: list[float] = Field([], description="Challenger latency of each paired score call.")
    champion_paired_ms: list[float] = Field([], description="Champion (shadow) latency of the same calls.")
    challenger_paired_p95_ms: float | None = None
    champion_paired_p95_ms: float | None = None
    p95_ratio: float | None = None
    p99_ratio: float | None = None
    failed_requests: int = Field(0, description="Requests whose client got no model answer.")
    challenger_failed_requests: int = Field(
        0, description="Of those, the ones routed to the challenger (the rest the champion alone answered)."
    )
    fallbacks: int = Field(0, description="Challenger failures the champion answered instead.")
    error_rate_increase: float = 0.0
    bpb_regression: float | None = Field(None, description="Challenger minus champion bits/byte, paired.")
    bpb_regression_upper: float | None = Field(None, description="Its one-sided bootstrap upper bound.")
    confidence: float = 0.95
    failures: list[str] = Field([], description="Gates this step breached (the step failed).")
    inconclusive: list[str] = Field([], description="Why the evidence did not suffice to judge (no failure).")
    attempt: int = Field(0, description="0 for the step's first run, n for its n-th re-run (on_inconclusive).")
    promql: list[GateReading] = Field([], description="canary.promql_gates read at the end of the step.")

    @property
    def outcome(self) -> StepOutcome:
        return "fail" if self.failures else "inconclusive" if self.inconclusive else "pass"


class OperatorCommand(BaseModel):
    """An operator's command to a running canary, as written by `shardline canary ACTION` and read by the driver."""

    id: str
    canary_id: str = Field(description="The canary it was given to; a driver ignores commands to another canary.")
    action: Action
    user: str
    reason: str = ""
    at: float = Field(description="When it was given (epoch seconds).")
    applied_at: float | None = Field(None, description="When the driver acted on it; None until then.")
    percent: int | None = Field(None, description="The weight the canary was at when the driver acted on it.")
    state: CanaryState | None = Field(None, description="The canary's state when the driver acted on it.")


class Warmup(BaseModel):
    """The challenger's warm-up before the first step: what it cost, so a cold start is visible, not judged."""

    requests: int = Field(description="Warm-up requests sent (x-shardline-variant: challenger; never evidence).")
    failed: int = Field(description="Of them, those that got no 200 answer.")
    latency_ms: list[float] = Field([], description="Client-side latency of each request, in the order sent.")


class CanaryDecision(BaseModel):
    """Compare, then act: the candidate, its baseline, the per-step metrics, the verdict and why."""

    model_name: str
    candidate: str
    baseline: str | None
    verdict: Verdict
    reason: str
    decided_by: Literal["policy", "operator", "timeout"] = "policy"
    metrics: list[StepMetrics] = []
    gates: dict[str, float | str] = {}
    commands: list[OperatorCommand] = Field([], description="Operator commands the driver acted on, in order.")
    warmup: Warmup | None = Field(None, description="The challenger's warm-up; None when none was sent.")


class CanaryResult(BaseModel):
    """What the canary stage returns to the flow."""

    decision: Verdict
    reason: str
    steps: list[dict] = []
    champion_version: str
    challenger_version: str = ""
    endpoint_url: str = ""
    final_challenger_percent: int | None = None  # the router's weight read back after applying the decision


def skipped(model_name: str, candidate: str, baseline: str | None, reason: str) -> CanaryDecision:
    return CanaryDecision(
        model_name=model_name, candidate=candidate, baseline=baseline, verdict="skipped", reason=reason
    )


def steps_table(steps: Iterable[StepMetrics | dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per ramp step with the numbers behind the verdict (for a Prefect table artifact)."""
    judged = [StepMetrics.model_validate(s) if isinstance(s, dict) else s for s in steps]

    def fmt(x: float | None, digits: int = 3) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    return [
        {
            "step": f"{s.percent}%",
            "requests (probe)": f"{s.requests} ({s.probe_requests})",
            "paired": s.paired,
            "seconds": fmt(s.seconds, 1),
            f"v{s.challenger.version} bpb": fmt(s.challenger.bpb),
            f"v{s.champion.version} bpb": fmt(s.champion.bpb),
            "bpb diff (upper)": f"{fmt(s.bpb_regression)} ({fmt(s.bpb_regression_upper)})",
            f"v{s.challenger.version} p95 ms": fmt(s.challenger_paired_p95_ms, 1),
            f"v{s.champion.version} p95 ms": fmt(s.champion_paired_p95_ms, 1),
            "error rate (ch/base)": f"{s.challenger.error_rate:.3f}/{s.champion.error_rate:.3f}",
            "verdict": "; ".join(s.failures)
            or ("inconclusive: " + "; ".join(s.inconclusive) if s.inconclusive else "pass"),
        }
        for s in judged
    ]


def result_of(
    decision: CanaryDecision, final_percent: int | None = None, champion: str | None = None, endpoint_url: str = ""
) -> CanaryResult:
    """The CanaryResult of a decision: the champion after applying it (unless given), the steps as plain dicts."""
    if champion is None:
        champion = decision.candidate if decision.verdict == "promoted" else (decision.baseline or decision.candidate)
    return CanaryResult(
        decision=decision.verdict,
        reason=decision.reason,
        champion_version=champion,
        challenger_version=decision.candidate,
        final_challenger_percent=final_percent,
        endpoint_url=endpoint_url,
        steps=[
            s.model_dump(exclude={"paired_deltas", "challenger_paired_ms", "champion_paired_ms"})
            for s in decision.metrics
        ],
    )
