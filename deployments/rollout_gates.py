"""The evidence of one canary ramp step and its gates, as pure functions: the router's observations summarised into
the step's numbers (StepMetrics), the early stops while a step runs (too little evidence so far, an error rate that
already fails), each gate judged, PromQL gate readings applied. deployments/rollout_policy turns judged steps into
the ramp's next move and the verdict.

An observation is one request as the router recorded it (deployments/serve_app.Router._record): the challenger's
call (when routed to it), the champion's served call, and the champion's shadow score of the same text. Quality is
judged on paired requests (both versions scored the same text) with a paired bootstrap bound; latency on the paired
score calls, pooled with the earlier steps'; errors on every call either version made. A step ends pass, fail (a
gate was breached) or inconclusive (too little evidence to judge: a shortfall is not a failure).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from deployments.canary_records import GateReading, StepMetrics, VersionStats
from deployments.canary_stats import p95, paired_upper_bound, percentile
from deployments.config import CanaryConfig, PromQLGate

# a gate is breached past its limit, not by float rounding at it (8/20 - 6/20 is 0.10000000000000003 > 0.1)
EPSILON = 1e-9

# A tail percentile over fewer samples is its maximum, i.e. one scheduling hiccup: p99 is judged from this many
# pooled paired calls on (p95 from canary.min_paired, as every step that passes has that many).
MIN_SAMPLES_P99 = 100


def is_paired(ob: dict[str, Any]) -> bool:
    """Both versions scored this observation's text: the challenger's call and the champion's shadow score answered."""
    ch, shadow = ob.get("challenger"), ob.get("shadow")
    return bool(ch and ch.get("ok") and shadow and shadow.get("ok") and ch.get("bytes"))


def missing_evidence(observations: Iterable[dict[str, Any]], cfg: CanaryConfig) -> str:
    """'' once a step's observations can be judged: canary.min_requests challenger requests and canary.min_paired
    paired ones (with shadow_share < 1 the pairs lag the requests); else what is still missing, for the message of
    a step that times out. Ending a step at min_requests alone would leave its quality and latency gates to too few
    pairs."""
    requests = paired = 0
    for ob in observations:
        requests += ob.get("challenger") is not None
        paired += is_paired(ob)
    lacking = []
    if requests < cfg.min_requests:
        lacking.append(f"{requests} of canary.min_requests={cfg.min_requests} challenger requests")
    if paired < cfg.min_paired:
        lacking.append(f"{paired} of canary.min_paired={cfg.min_paired} paired requests")
    return ", ".join(lacking)


def errors_already_fail(observations: Iterable[dict[str, Any]], cfg: CanaryConfig) -> str:
    """The error-rate failure of a step that has its canary.min_requests challenger requests but not yet its pairs,
    else ''. A challenger that errors cannot be paired (no score), so waiting for canary.min_paired would keep it on
    live traffic until canary.step_timeout_s only to reach the same verdict: the step ends here and is judged
    (Argo Rollouts' failureLimit, Flagger's failed checks). The rate is the one summarize_step judges: every call of
    either version so far."""
    ch_calls, base_calls = _calls_by_side(observations)
    if len(ch_calls) < cfg.min_requests:
        return ""
    ch_rate = _error_rate(ch_calls)
    if ch_rate - _error_rate(base_calls) <= cfg.max_error_rate_increase + EPSILON:
        return ""
    return f"error rate {ch_rate:.3f} on {len(ch_calls)} challenger requests already fails the gate"


def _ratio(a: float, b: float) -> float:
    """a / b; a 0 ms baseline (latency_floor_ms = 0) makes a slower challenger infinitely slower, not a crash."""
    if b > 0:
        return a / b
    return 1.0 if a <= 0 else math.inf


def _calls_by_side(observations: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every call of the challenger, and every call of the baseline (the champion serving, or its shadow copy of a
    challenger request), in order: what both the early error check and the step's gates count."""
    ch_calls: list[dict[str, Any]] = []
    base_calls: list[dict[str, Any]] = []
    for ob in observations:
        if (ch := ob.get("challenger")) is not None:
            ch_calls.append(ch)
        base_calls.extend(c for c in (ob.get("champion"), ob.get("shadow")) if c is not None)
    return ch_calls, base_calls


def _error_rate(calls: list[dict[str, Any]]) -> float:
    return sum(1 for c in calls if not c.get("ok")) / len(calls) if calls else 0.0


def summarize_step(
    percent: int,
    observations: list[dict[str, Any]],
    champion: str,
    challenger: str,
    cfg: CanaryConfig,
    earlier: Iterable[StepMetrics] = (),
    seconds: float = 0.0,
    evidence_failure: str = "",
    seed: int = 0,
) -> StepMetrics:
    """Per-version errors, latency and paired bits per byte of one step, then its gates."""
    ch_calls, base_calls = _calls_by_side(observations)
    deltas: list[list[float]] = []
    ch_ms: list[float] = []
    base_ms: list[float] = []
    for ob in observations:
        ch, shadow = ob.get("challenger"), ob.get("shadow")
        if ch and shadow and is_paired(ob):  # ch and shadow first: mypy narrows on them
            deltas.append([float(ch["bits"]), float(shadow["bits"]), float(ch["bytes"])])
            if ob.get("op") == "score":
                ch_ms.append(float(ch["latency_ms"]))
                base_ms.append(float(shadow["latency_ms"]))

    def stats(calls: list[dict[str, Any]], version: str) -> VersionStats:
        errors = sum(1 for c in calls if not c.get("ok"))
        col = 0 if version == challenger else 1
        bpb = sum(d[col] for d in deltas) / sum(d[2] for d in deltas) if deltas else None
        return VersionStats(
            version=version,
            n=len(calls),
            errors=errors,
            error_rate=_error_rate(calls),
            p95_ms=p95([c["latency_ms"] for c in calls if c.get("ok")]),
            bpb=bpb,
        )

    step = StepMetrics(
        percent=percent,
        requests=len(observations),
        probe_requests=sum(1 for o in observations if o.get("probe")),
        seconds=seconds,
        challenger=stats(ch_calls, challenger),
        champion=stats(base_calls, champion),
        paired=len(deltas),
        paired_deltas=deltas,
        challenger_paired_ms=ch_ms,
        champion_paired_ms=base_ms,
        failed_requests=sum(1 for o in observations if not o.get("client_ok", True)),
        challenger_failed_requests=sum(
            1 for o in observations if not o.get("client_ok", True) and o.get("role") == "challenger"
        ),
        fallbacks=sum(1 for o in observations if o.get("fallback")),
        confidence=cfg.confidence,
    )
    return gate_step(step, cfg, earlier, evidence_failure, seed)


def gate_step(
    step: StepMetrics, cfg: CanaryConfig, earlier: Iterable[StepMetrics] = (), evidence_failure: str = "", seed: int = 0
) -> StepMetrics:
    """Fill in the gate values and the failures of a step (a new object; the input is not changed)."""
    ch, base = step.challenger, step.champion
    pooled = [*earlier, step]
    failures: list[str] = []
    inconclusive: list[str] = [evidence_failure] if evidence_failure else []
    increase = ch.error_rate - base.error_rate
    if increase > cfg.max_error_rate_increase + EPSILON:
        failures.append(
            f"error rate {ch.error_rate:.3f} (n={ch.n}) exceeds champion's {base.error_rate:.3f} "
            f"(n={base.n}) by {increase:.3f} > {cfg.max_error_rate_increase}"
        )
    ch_lat = [ms for s in pooled for ms in s.challenger_paired_ms]
    base_lat = [ms for s in pooled for ms in s.champion_paired_ms]
    ratios: dict[float, float | None] = {}
    for q, limit in ((0.95, cfg.max_p95_latency_ratio), (0.99, cfg.max_p99_latency_ratio)):
        a, b = percentile(ch_lat, q), percentile(base_lat, q)
        ratios[q] = None
        if a is None or b is None or (q == 0.99 and len(ch_lat) < MIN_SAMPLES_P99):
            continue
        # same requests on both sides (request size drives latency); below the floor it is scheduling noise
        ratio = ratios[q] = _ratio(max(a, cfg.latency_floor_ms), max(b, cfg.latency_floor_ms))
        if ratio > limit + EPSILON:
            failures.append(
                f"p{round(q * 100)} latency {a:.1f} ms is {ratio:.2f}x champion's {b:.1f} ms on the "
                f"same {len(ch_lat)} requests > {limit}x"
            )
    point = upper = None
    if len(step.paired_deltas) < cfg.min_paired:
        inconclusive.append(
            f"only {len(step.paired_deltas)} paired requests < canary.min_paired={cfg.min_paired}: too little "
            "evidence to judge quality"
        )
    else:
        point, upper = paired_upper_bound(step.paired_deltas, cfg.confidence, seed + step.percent)
        if upper > cfg.max_bpb_regression:
            failures.append(
                f"bits/byte {ch.bpb:.4f} vs champion's {base.bpb:.4f} on the same {step.paired} requests: "
                f"{point:+.4f}, {cfg.confidence:.0%} upper bound {upper:+.4f} > {cfg.max_bpb_regression}"
            )
    if step.challenger_failed_requests:
        failures.append(
            f"{step.challenger_failed_requests} of {step.requests} requests routed to the challenger got no model "
            "answer"
        )
    if champion_failed := step.failed_requests - step.challenger_failed_requests:
        # the champion alone answered these (every request in shadow mode): they say nothing of the challenger,
        # and a version is not rejected for them; the step cannot be judged while its baseline fails
        inconclusive.append(
            f"{champion_failed} of {step.requests} requests the champion alone answered got no model answer"
        )
    return step.model_copy(
        update={
            "challenger_paired_p95_ms": percentile(ch_lat, 0.95),
            "champion_paired_p95_ms": percentile(base_lat, 0.95),
            "error_rate_increase": increase,
            "p95_ratio": ratios[0.95],
            "p99_ratio": ratios[0.99],
            "bpb_regression": point,
            "bpb_regression_upper": upper,
            "failures": failures,
            "inconclusive": inconclusive,
        }
    )


def judge_promql(gate: PromQLGate, query: str, value: float | None, error: str = "") -> GateReading:
    """A PromQL gate's reading: fail outside [min, max]; no-data without a value (no sample, or the query failed)."""
    kind = "" if gate.critical else " (report-only)"
    if value is None or math.isnan(value):
        why = error or "no sample"
        return GateReading(
            name=gate.name,
            query=query,
            value=None,
            critical=gate.critical,
            verdict="no-data",
            message=f"PromQL gate {gate.name}{kind}: {why}: too little evidence to judge",
        )
    breach = []
    if gate.max is not None and value > gate.max + EPSILON:  # past the bound, not at it by float rounding
        breach.append(f"> max {gate.max:g}")
    if gate.min is not None and value < gate.min - EPSILON:
        breach.append(f"< min {gate.min:g}")
    verdict = "fail" if breach else "pass"
    bounds = " and ".join(breach) or "within " + ", ".join(
        f"{k} {v:g}" for k, v in (("min", gate.min), ("max", gate.max)) if v is not None
    )
    return GateReading(
        name=gate.name,
        query=query,
        value=value,
        critical=gate.critical,
        verdict=verdict,
        message=f"PromQL gate {gate.name}{kind}: {value:g} {bounds}",
    )


def apply_promql(step: StepMetrics, readings: list[GateReading]) -> StepMetrics:
    """The step with its PromQL readings: a critical gate's breach is a failure, its missing value makes the step
    inconclusive; report-only gates are recorded and never decide (a new object; the input is not changed)."""
    return step.model_copy(
        update={
            "promql": readings,
            "failures": [*step.failures, *(r.message for r in readings if r.critical and r.verdict == "fail")],
            "inconclusive": [
                *step.inconclusive,
                *(r.message for r in readings if r.critical and r.verdict == "no-data"),
            ],
        }
    )
