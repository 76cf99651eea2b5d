"""The canary policy as pure functions: numbers of one ramp step from the router's observations, the gates, the verdict.

Nothing here talks to Ray, HTTP or MLflow: the decision object is computed from numbers only, and is what gets
logged and tested. An observation is one request as the router recorded it (deployments/serve_app.Router._record):
the challenger's call (when routed to it), the champion's served call, and the champion's shadow score of the same
text. Quality is judged on paired requests (both versions scored the same text) with a paired bootstrap bound;
latency on the paired score calls, pooled with the earlier steps'; errors on every call either version made.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, Field

from deployments.config import CanaryConfig

Verdict = Literal["promoted", "rejected", "skipped"]
BOOTSTRAP_RESAMPLES = 2000
# A tail percentile over fewer samples is its maximum, i.e. one scheduling hiccup: p99 is judged from this many
# pooled paired calls on (p95 from canary.min_paired, as every step that passes has that many).
MIN_SAMPLES_P99 = 100


class VersionStats(BaseModel):
    """One version's numbers at one ramp step."""

    version: str
    n: int = Field(description="Calls this version answered or failed (the champion's include shadow calls).")
    errors: int
    error_rate: float
    p95_ms: float | None = Field(description="p95 model latency of its successful score calls; None without.")
    bpb: float | None = Field(description="Bits per byte over the paired requests.")


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
        [], description="Per paired request: [challenger bits, champion bits, bytes] (the bootstrap's input).")
    challenger_paired_ms: list[float] = Field([], description="Challenger latency of each paired score call.")
    champion_paired_ms: list[float] = Field([], description="Champion (shadow) latency of the same calls.")
    challenger_paired_p95_ms: float | None = None
    champion_paired_p95_ms: float | None = None
    p95_ratio: float | None = None
    p99_ratio: float | None = None
    failed_requests: int = Field(0, description="Requests whose client got no model answer.")
    fallbacks: int = Field(0, description="Challenger failures the champion answered instead.")
    error_rate_increase: float = 0.0
    bpb_regression: float | None = Field(None, description="Challenger minus champion bits/byte, paired.")
    bpb_regression_upper: float | None = Field(None, description="Its one-sided bootstrap upper bound.")
    confidence: float = 0.95
    failures: list[str] = []


class CanaryDecision(BaseModel):
    """Compare, then act: the candidate, its baseline, the per-step metrics, the verdict and why."""

    model_name: str
    candidate: str
    baseline: str | None
    verdict: Verdict
    reason: str
    metrics: list[StepMetrics] = []
    gates: dict[str, float] = {}


class CanaryResult(BaseModel):
    """What the canary stage returns to the flow."""

    decision: Verdict
    reason: str
    steps: list[dict] = []
    champion_version: str
    challenger_version: str = ""
    endpoint_url: str = ""
    final_challenger_percent: int | None = None  # the router's weight read back after applying the decision


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in (0, 1]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def p95(values: list[float]) -> float | None:
    return percentile(values, 0.95)


def paired_upper_bound(deltas: list[list[float]], confidence: float, seed: int) -> tuple[float, float]:
    """(bpb difference, its one-sided upper bound) from a paired bootstrap over requests.

    Each entry is [challenger bits, champion bits, bytes] of one request; the statistic is the byte-weighted
    difference sum(ch - base) / sum(bytes). Resampling whole requests keeps each pair together.
    """
    import numpy as np

    arr = np.asarray(deltas, dtype=np.float64)
    diff, nbytes = arr[:, 0] - arr[:, 1], arr[:, 2]
    point = float(diff.sum() / nbytes.sum())
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(arr), size=(BOOTSTRAP_RESAMPLES, len(arr)))
    stats = diff[idx].sum(axis=1) / nbytes[idx].sum(axis=1)
    return point, float(np.quantile(stats, confidence))


def summarize_step(percent: int, observations: list[dict[str, Any]], champion: str, challenger: str,
                   cfg: CanaryConfig, earlier: Iterable[StepMetrics] = (), seconds: float = 0.0,
                   evidence_failure: str = "", seed: int = 0) -> StepMetrics:
    """Per-version errors, latency and paired bits per byte of one step, then its gates."""
    ch_calls: list[dict[str, Any]] = []
    base_calls: list[dict[str, Any]] = []
    deltas: list[list[float]] = []
    ch_ms: list[float] = []
    base_ms: list[float] = []
    for ob in observations:
        ch, served, shadow = ob.get("challenger"), ob.get("champion"), ob.get("shadow")
        if ch is not None:
            ch_calls.append(ch)
        for call in (served, shadow):
            if call is not None:
                base_calls.append(call)
        if ch and ch.get("ok") and shadow and shadow.get("ok") and ch.get("bytes"):
            deltas.append([float(ch["bits"]), float(shadow["bits"]), float(ch["bytes"])])
            if ob.get("op") == "score":
                ch_ms.append(float(ch["latency_ms"]))
                base_ms.append(float(shadow["latency_ms"]))

    def stats(calls: list[dict[str, Any]], version: str) -> VersionStats:
        errors = sum(1 for c in calls if not c.get("ok"))
        col = 0 if version == challenger else 1
        bpb = sum(d[col] for d in deltas) / sum(d[2] for d in deltas) if deltas else None
        return VersionStats(version=version, n=len(calls), errors=errors,
                            error_rate=errors / len(calls) if calls else 0.0,
                            p95_ms=p95([c["latency_ms"] for c in calls if c.get("ok")]), bpb=bpb)

    step = StepMetrics(
        percent=percent, requests=len(observations), probe_requests=sum(1 for o in observations if o.get("probe")),
        seconds=seconds, challenger=stats(ch_calls, challenger), champion=stats(base_calls, champion),
        paired=len(deltas), paired_deltas=deltas, challenger_paired_ms=ch_ms, champion_paired_ms=base_ms,
        failed_requests=sum(1 for o in observations if not o.get("client_ok", True)),
        fallbacks=sum(1 for o in observations if o.get("fallback")), confidence=cfg.confidence,
    )
    return gate_step(step, cfg, earlier, evidence_failure, seed)


def gate_step(step: StepMetrics, cfg: CanaryConfig, earlier: Iterable[StepMetrics] = (), evidence_failure: str = "",
              seed: int = 0) -> StepMetrics:
    """Fill in the gate values and the failures of a step (a new object; the input is not changed)."""
    ch, base = step.challenger, step.champion
    pooled = [*earlier, step]
    failures: list[str] = [evidence_failure] if evidence_failure else []
    increase = ch.error_rate - base.error_rate
    if increase > cfg.max_error_rate_increase:
        failures.append(f"error rate {ch.error_rate:.3f} (n={ch.n}) exceeds champion's {base.error_rate:.3f} "
                        f"(n={base.n}) by {increase:.3f} > {cfg.max_error_rate_increase}")
    ch_lat = [ms for s in pooled for ms in s.challenger_paired_ms]
    base_lat = [ms for s in pooled for ms in s.champion_paired_ms]
    ratios: dict[float, float | None] = {}
    for q, limit in ((0.95, cfg.max_p95_latency_ratio), (0.99, cfg.max_p99_latency_ratio)):
        a, b = percentile(ch_lat, q), percentile(base_lat, q)
        ratios[q] = None
        if a is None or b is None or (q == 0.99 and len(ch_lat) < MIN_SAMPLES_P99):
            continue
        # same requests on both sides (request size drives latency); below the floor it is scheduling noise
        ratios[q] = max(a, cfg.latency_floor_ms) / max(b, cfg.latency_floor_ms)
        if ratios[q] > limit:
            failures.append(f"p{round(q * 100)} latency {a:.1f} ms is {ratios[q]:.2f}x champion's {b:.1f} ms on the "
                            f"same {len(ch_lat)} requests > {limit}x")
    point = upper = None
    if len(step.paired_deltas) < cfg.min_paired:
        failures.append(f"only {len(step.paired_deltas)} paired requests < canary.min_paired={cfg.min_paired}: too little "
                        "evidence to judge quality")
    else:
        point, upper = paired_upper_bound(step.paired_deltas, cfg.confidence, seed + step.percent)
        if upper > cfg.max_bpb_regression:
            failures.append(
                f"bits/byte {ch.bpb:.4f} vs champion's {base.bpb:.4f} on the same {step.paired} requests: "
                f"{point:+.4f}, {cfg.confidence:.0%} upper bound {upper:+.4f} > {cfg.max_bpb_regression}")
    if step.failed_requests:
        failures.append(f"{step.failed_requests} of {step.requests} requests got no model answer")
    return step.model_copy(update={
        "challenger_paired_p95_ms": percentile(ch_lat, 0.95), "champion_paired_p95_ms": percentile(base_lat, 0.95),
        "error_rate_increase": increase, "p95_ratio": ratios[0.95], "p99_ratio": ratios[0.99],
        "bpb_regression": point, "bpb_regression_upper": upper, "failures": failures,
    })


def decide_canary(model_name: str, candidate: str, baseline: str, steps: list[StepMetrics],
                  cfg: CanaryConfig) -> CanaryDecision:
    """Promote when every step of the ramp ran and passed its gates; reject at the first failing step."""
    gates = {
        "max_error_rate_increase": cfg.max_error_rate_increase, "max_p95_latency_ratio": cfg.max_p95_latency_ratio,
        "max_p99_latency_ratio": cfg.max_p99_latency_ratio, "max_bpb_regression": cfg.max_bpb_regression,
        "confidence": cfg.confidence, "min_requests": cfg.min_requests, "min_paired": cfg.min_paired,
        "bake_seconds": cfg.bake_seconds, "latency_floor_ms": cfg.latency_floor_ms,
    }
    common = dict(model_name=model_name, candidate=candidate, baseline=baseline, metrics=steps, gates=gates)
    for step in steps:
        if step.failures:
            return CanaryDecision(verdict="rejected", reason=f"step {step.percent}%: " + "; ".join(step.failures),
                                  **common)
    if not steps or steps[-1].percent != cfg.steps[-1]:
        last = steps[-1].percent if steps else 0
        return CanaryDecision(verdict="rejected", reason=f"ramp stopped at {last}% before {cfg.steps[-1]}%", **common)
    last = steps[-1]
    paired = sum(s.paired for s in steps)
    reason = (f"version {candidate} passed {len(steps)} steps up to {last.percent}% on {paired} paired requests: "
              f"bits/byte {last.challenger.bpb:.4f} vs {last.champion.bpb:.4f} "
              f"({cfg.confidence:.0%} upper bound of the difference {last.bpb_regression_upper:+.4f})")
    return CanaryDecision(verdict="promoted", reason=reason, **common)


def skipped(model_name: str, candidate: str, baseline: str | None, reason: str) -> CanaryDecision:
    return CanaryDecision(model_name=model_name, candidate=candidate, baseline=baseline, verdict="skipped",
                          reason=reason)


def steps_table(steps: Iterable[StepMetrics | dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per ramp step with the numbers behind the verdict (for a Prefect table artifact)."""
    steps = [StepMetrics.model_validate(s) if isinstance(s, dict) else s for s in steps]

    def fmt(x: float | None, digits: int = 3) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    return [
        {
            "step": f"{s.percent}%", "requests (probe)": f"{s.requests} ({s.probe_requests})", "paired": s.paired,
            "seconds": fmt(s.seconds, 1),
            f"v{s.challenger.version} bpb": fmt(s.challenger.bpb), f"v{s.champion.version} bpb": fmt(s.champion.bpb),
            "bpb diff (upper)": f"{fmt(s.bpb_regression)} ({fmt(s.bpb_regression_upper)})",
            f"v{s.challenger.version} p95 ms": fmt(s.challenger_paired_p95_ms, 1),
            f"v{s.champion.version} p95 ms": fmt(s.champion_paired_p95_ms, 1),
            "error rate (ch/base)": f"{s.challenger.error_rate:.3f}/{s.champion.error_rate:.3f}",
            "verdict": "; ".join(s.failures) or "pass",
        }
        for s in steps
    ]


def result_of(decision: CanaryDecision, final_percent: int | None = None, champion: str | None = None,
              endpoint_url: str = "") -> CanaryResult:
    """The CanaryResult of a decision: the champion after applying it (unless given), the steps as plain dicts."""
    if champion is None:
        champion = decision.candidate if decision.verdict == "promoted" else (decision.baseline or decision.candidate)
    return CanaryResult(
        decision=decision.verdict, reason=decision.reason, champion_version=champion,
        challenger_version=decision.candidate, final_challenger_percent=final_percent, endpoint_url=endpoint_url,
        steps=[s.model_dump(exclude={"paired_deltas", "challenger_paired_ms", "champion_paired_ms"})
               for s in decision.metrics],
    )
