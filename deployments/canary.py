"""The canary policy: ramp traffic to the challenger, measure both versions on the same requests, decide, apply.

Measuring (drive_step), deciding (summarize_step, gate_step, decide_canary) and applying (apply_canary) are
separate: the decision object is computed from numbers only, and is what gets logged and tested.
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal

from pydantic import BaseModel, Field

from deployments.config import CanaryConfig
from deployments.registry import (
    CHAMPION, TAG_CANARY_DECISION, TAG_REJECTED, AliasChanged, move_alias, read_aliases, tag_rejected,
)

Verdict = Literal["promoted", "rejected", "skipped"]


class CanaryDecided(RuntimeError):
    """The canary reached a decision but could not apply it; re-running it would measure again, so don't."""


class Observation(BaseModel):
    """One HTTP request as the client saw it: what served it, and the champion's shadow score if any."""

    status: int  # HTTP status; 0 when no answer came back
    served: dict[str, Any] | None = None  # {"role", "version", "ok", "bpb", "bits", "bytes", "latency_ms"}
    shadow: dict[str, Any] | None = None
    client_ms: float = 0.0
    error: str = ""


class VersionStats(BaseModel):
    """One version's numbers at one ramp step."""

    version: str
    n: int = Field(description="Calls this version answered or failed (the champion's include shadow calls).")
    errors: int
    error_rate: float
    p95_ms: float | None = Field(description="p95 of model latency inside the replica; None without calls.")
    bpb: float | None = Field(description="Bits per byte over the requests the challenger served (paired).")


class StepMetrics(BaseModel):
    """One ramp step: the weight, both versions' numbers on the same requests, and the gate values."""

    percent: int
    requests: int
    challenger: VersionStats
    champion: VersionStats
    paired: int = Field(description="Challenger requests that both versions scored (the comparison's n).")
    challenger_paired_ms: list[float] = Field([], description="Challenger latency of each paired request.")
    champion_paired_ms: list[float] = Field([], description="Champion (shadow) latency of the same requests.")
    challenger_paired_p95_ms: float | None = Field(
        None, description="Challenger p95 on the paired requests of this and the earlier steps (what is gated).")
    champion_paired_p95_ms: float | None = Field(
        None, description="Champion p95 on the same requests as challenger_paired_p95_ms.")
    unattributed_errors: int = Field(0, description="Requests that failed before reaching a model.")
    client_p95_ms: float | None = None
    error_rate_increase: float = 0.0
    p95_ratio: float | None = None
    bpb_regression: float | None = None
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
    """What canary_deploy returns to the flow."""

    decision: Verdict
    reason: str
    steps: list[dict] = []
    champion_version: str
    challenger_version: str = ""
    final_challenger_percent: int | None = None  # the router's weight read back after applying the decision


def p95(values: list[float]) -> float | None:
    """Nearest-rank 95th percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def summarize_step(percent: int, observations: list[Observation], champion_version: str,
                   challenger_version: str, cfg: CanaryConfig, earlier: Iterable[StepMetrics] = ()) -> StepMetrics:
    """Per-version error rate, p95 latency and paired bits per byte of one step, and the gates' verdicts.

    `earlier` are the previous steps of the same canary: the latency gate pools their paired requests with this
    step's, because a p95 over the few requests of one step is its maximum, i.e. one scheduling hiccup.
    """
    calls: dict[str, list[dict[str, Any]]] = {"champion": [], "challenger": []}
    unattributed = 0
    ch_bits = ch_bytes = base_bits = base_bytes = 0.0
    paired = 0
    ch_ms: list[float] = []
    base_ms: list[float] = []
    for ob in observations:
        if ob.served is None:
            unattributed += 1
            continue
        calls[ob.served["role"]].append(ob.served)
        if ob.shadow is not None:
            calls["champion"].append(ob.shadow)
        if (ob.served["role"] == "challenger" and ob.served.get("ok") and ob.shadow is not None
                and ob.shadow.get("ok") and ob.served.get("bytes")):
            paired += 1
            ch_bits += ob.served["bits"]
            ch_bytes += ob.served["bytes"]
            base_bits += ob.shadow["bits"]
            base_bytes += ob.shadow["bytes"]
            ch_ms.append(ob.served["latency_ms"])
            base_ms.append(ob.shadow["latency_ms"])

    def stats(role: str, version: str, bpb: float | None) -> VersionStats:
        done = calls[role]
        errors = sum(1 for c in done if not c.get("ok"))
        return VersionStats(
            version=version, n=len(done), errors=errors, error_rate=errors / len(done) if done else 0.0,
            p95_ms=p95([c["latency_ms"] for c in done if c.get("ok")]), bpb=bpb,
        )

    step = StepMetrics(
        percent=percent,
        requests=len(observations),
        challenger=stats("challenger", challenger_version, ch_bits / ch_bytes if ch_bytes else None),
        champion=stats("champion", champion_version, base_bits / base_bytes if base_bytes else None),
        paired=paired,
        challenger_paired_ms=ch_ms,
        champion_paired_ms=base_ms,
        unattributed_errors=unattributed,
        client_p95_ms=p95([ob.client_ms for ob in observations if ob.status == 200]),
    )
    return gate_step(step, cfg, earlier)


def gate_step(step: StepMetrics, cfg: CanaryConfig, earlier: Iterable[StepMetrics] = ()) -> StepMetrics:
    """Fill in the gate values and the failures of a step (a new object; the input is not changed)."""
    ch, base = step.challenger, step.champion
    pooled = [*earlier, step]
    ch_p95 = p95([ms for s in pooled for ms in s.challenger_paired_ms])
    base_p95 = p95([ms for s in pooled for ms in s.champion_paired_ms])
    failures: list[str] = []
    increase = ch.error_rate - base.error_rate
    if increase > cfg.max_error_rate_increase:
        failures.append(
            f"error rate {ch.error_rate:.3f} (n={ch.n}) exceeds champion's {base.error_rate:.3f} (n={base.n}) "
            f"by {increase:.3f} > {cfg.max_error_rate_increase}"
        )
    ratio = None
    if ch_p95 is not None and base_p95 is not None:
        # same requests on both sides (request size drives latency); below the floor it is scheduling noise
        ratio = max(ch_p95, cfg.latency_floor_ms) / max(base_p95, cfg.latency_floor_ms)
        if ratio > cfg.max_p95_latency_ratio:
            failures.append(
                f"p95 latency {ch_p95:.1f} ms is {ratio:.2f}x champion's {base_p95:.1f} ms on the same "
                f"{sum(s.paired for s in pooled)} requests > {cfg.max_p95_latency_ratio}x"
            )
    regression = None
    if ch.bpb is not None and base.bpb is not None:
        regression = ch.bpb - base.bpb
        if regression > cfg.max_bpb_regression:
            failures.append(
                f"bits/byte {ch.bpb:.4f} vs champion's {base.bpb:.4f} on the same {step.paired} requests: "
                f"+{regression:.4f} > {cfg.max_bpb_regression}"
            )
    if step.unattributed_errors:
        failures.append(f"{step.unattributed_errors} of {step.requests} requests failed before reaching a model")
    return step.model_copy(update={
        "challenger_paired_p95_ms": ch_p95, "champion_paired_p95_ms": base_p95, "error_rate_increase": increase,
        "p95_ratio": ratio, "bpb_regression": regression, "failures": failures,
    })


def decide_canary(model_name: str, candidate: str, baseline: str, steps: list[StepMetrics],
                  cfg: CanaryConfig) -> CanaryDecision:
    """Promote when every step passed its gates and the challenger was measured; reject otherwise."""
    gates = {
        "max_error_rate_increase": cfg.max_error_rate_increase,
        "max_p95_latency_ratio": cfg.max_p95_latency_ratio,
        "max_bpb_regression": cfg.max_bpb_regression,
        "latency_floor_ms": cfg.latency_floor_ms,
    }
    common = dict(model_name=model_name, candidate=candidate, baseline=baseline, metrics=steps, gates=gates)
    for step in steps:
        if step.failures:
            reason = f"step {step.percent}%: " + "; ".join(step.failures)
            return CanaryDecision(verdict="rejected", reason=reason, **common)
    paired = sum(s.paired for s in steps)
    if paired == 0:
        return CanaryDecision(
            verdict="rejected", reason=f"no challenger request was scored by both versions in steps {cfg.steps}",
            **common,
        )
    last = steps[-1]
    if last.percent != cfg.steps[-1]:
        return CanaryDecision(
            verdict="rejected", reason=f"ramp stopped at {last.percent}% before {cfg.steps[-1]}%", **common,
        )
    reason = (
        f"version {candidate} passed {len(steps)} steps up to {last.percent}% on {paired} paired requests: "
        f"bits/byte {last.challenger.bpb:.4f} vs {last.champion.bpb:.4f}"
        if last.challenger.bpb is not None and last.champion.bpb is not None
        else f"version {candidate} passed {len(steps)} steps on {paired} paired requests"
    )
    return CanaryDecision(verdict="promoted", reason=reason, **common)


def skipped(model_name: str, candidate: str, baseline: str | None, reason: str) -> CanaryDecision:
    return CanaryDecision(model_name=model_name, candidate=candidate, baseline=baseline, verdict="skipped",
                          reason=reason)


def skip_reason(client: Any, cfg: CanaryConfig, model_name: str, champion: str | None, challenger: str) -> str:
    """Why no canary runs for `challenger` ("" when one should), read from the config and the registry.

    Raises:
        AliasChanged: `champion` no longer points at the version the promotion stage saw.
    """
    if not cfg.enabled:
        return "canary.enabled is false"
    if champion is None or champion == challenger:
        return f"no champion other than version {challenger} (first run)"
    current = read_aliases(client, model_name).get(CHAMPION)
    if current == challenger:
        return f"version {challenger} is already '{CHAMPION}' (decided by an earlier attempt)"
    if current != champion:
        raise AliasChanged(f"{model_name}: alias '{CHAMPION}' is at version {current}, the promotion stage saw "
                           f"{champion}; not running a canary against a champion that moved")
    rejected = client.get_model_version(model_name, challenger).tags.get(TAG_REJECTED)
    if rejected:
        return f"version {challenger} was already rejected: {rejected}"
    return ""


def apply_canary(client: Any, decision: CanaryDecision, set_percent: Callable[[int], int]) -> int:
    """Apply a decision to the router and the registry; return the router's challenger percent afterwards.

    promoted: `champion` moves to the candidate, compare-and-set against the baseline (AliasChanged if moved).
    rejected: all traffic back on the champion, the candidate tagged `rejected` with the reason.
    """
    if decision.verdict == "promoted":
        percent = set_percent(100)
        move_alias(client, decision.model_name, CHAMPION, decision.baseline, decision.candidate)
        client.set_model_version_tag(decision.model_name, decision.candidate, TAG_CANARY_DECISION, "promoted")
        return percent
    if decision.verdict == "rejected":
        percent = set_percent(0)
        tag_rejected(client, decision.model_name, decision.candidate, decision.reason)
        return percent
    return 0


def pick_payloads(texts: list[bytes], n: int, seed: int, step: int, max_bytes: int) -> list[bytes]:
    """`n` request bodies drawn from the held-out texts, reproducibly per (seed, step), cut to max_bytes."""
    usable = [t[:max_bytes] for t in texts if len(t) >= 2]
    if not usable:
        raise ValueError("no held-out text of at least 2 bytes to drive the canary with")
    rng = random.Random(f"{seed}:step{step}")
    return [usable[rng.randrange(len(usable))] for _ in range(n)]


def drive_step(url: str, payloads: Iterable[bytes], timeout_s: float = 60.0) -> list[Observation]:
    """POST each payload to the router, one at a time, and record what came back."""
    import httpx

    out = []
    with httpx.Client(timeout=timeout_s) as http:
        for body in payloads:
            t0 = time.perf_counter()
            try:
                r = http.post(url, content=body, headers={"content-type": "application/octet-stream"})
                ms = (time.perf_counter() - t0) * 1000.0
                data = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
                out.append(Observation(status=r.status_code, served=data.get("served"), shadow=data.get("shadow"),
                                       client_ms=ms, error="" if r.status_code == 200 else r.text[:300]))
            except httpx.HTTPError as e:
                out.append(Observation(status=0, client_ms=(time.perf_counter() - t0) * 1000.0,
                                       error=f"{type(e).__name__}: {e}"[:300]))
    return out


def run_canary(cfg: CanaryConfig, model_name: str, champion: str, challenger: str, texts: list[bytes],
               tracking_uri: str, on_step: Callable[[int, StepMetrics], None] | None = None,
               log: Callable[[CanaryDecision], None] | None = None, shutdown_serve: bool = True) -> CanaryResult:
    """Serve both versions, ramp through cfg.steps over HTTP, decide, apply, and take the app down.

    Ray must be initialised. Stops at the first failing step. `log` receives the decision once it was applied
    (or applying it failed).

    Raises:
        CanaryDecided: a decision was taken but applying it failed (do not re-run the canary for it).
    """
    from deployments.registry import client_for
    from deployments.serve_app import start_canary_app, stop_canary_app

    client = client_for(tracking_uri)
    decision = None
    try:  # the app comes down however this ends, also when it failed to come up
        app = start_canary_app(model_name, champion, challenger, tracking_uri, host=cfg.host, port=cfg.port,
                               seed=cfg.seed, max_request_bytes=cfg.max_request_bytes)
        steps: list[StepMetrics] = []
        for i, percent in enumerate(cfg.steps):
            app.set_challenger_percent(percent)
            payloads = pick_payloads(texts, cfg.requests_per_step, cfg.seed, i, cfg.max_request_bytes)
            step = summarize_step(percent, drive_step(app.url, payloads), champion, challenger, cfg, steps)
            steps.append(step)
            if on_step is not None:
                on_step(i, step)
            if step.failures:
                break
        decision = decide_canary(model_name, challenger, champion, steps, cfg)
        try:
            apply_canary(client, decision, app.set_challenger_percent)
            final_percent = app.challenger_percent()  # read back: what the router really does now
        finally:  # the decision is recorded also when applying it failed
            if log is not None:
                log(decision)
    except Exception as e:
        if decision is not None:
            raise CanaryDecided(f"canary decided '{decision.verdict}' ({decision.reason}) but applying it "
                                f"failed: {type(e).__name__}: {e}") from e
        raise
    finally:
        stop_canary_app(shutdown=shutdown_serve)
    return result_of(decision, final_percent)


def result_of(decision: CanaryDecision, final_percent: int | None = None, champion: str | None = None) -> CanaryResult:
    """The CanaryResult of a decision: the champion after applying it (unless given), the steps as plain dicts."""
    if champion is None:
        champion = decision.candidate if decision.verdict == "promoted" else (decision.baseline or decision.candidate)
    return CanaryResult(
        decision=decision.verdict, reason=decision.reason, champion_version=champion,
        challenger_version=decision.candidate, final_challenger_percent=final_percent,
        steps=[s.model_dump() for s in decision.metrics],
    )


def steps_table(steps: Iterable[StepMetrics | dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per ramp step with the numbers behind the verdict (for a Prefect table artifact)."""
    steps = [StepMetrics.model_validate(s) if isinstance(s, dict) else s for s in steps]

    def fmt(x: float | None, digits: int = 3) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    return [
        {
            "step": f"{s.percent}%", "requests": s.requests, "paired": s.paired,
            f"v{s.challenger.version} bpb": fmt(s.challenger.bpb), f"v{s.champion.version} bpb": fmt(s.champion.bpb),
            f"v{s.challenger.version} p95 ms": fmt(s.challenger_paired_p95_ms, 1),
            f"v{s.champion.version} p95 ms": fmt(s.champion_paired_p95_ms, 1),
            "error rate (ch/base)": f"{s.challenger.error_rate:.3f}/{s.champion.error_rate:.3f}",
            "verdict": "; ".join(s.failures) or "pass",
        }
        for s in steps
    ]


def log_decision(decision: CanaryDecision) -> None:
    """Log the decision to the active MLflow run: JSON artifact, `step{percent}.*` metrics, verdict tags."""
    import mlflow

    mlflow.log_dict(decision.model_dump(mode="json"), "canary_decision.json")
    for i, s in enumerate(decision.metrics):
        values: dict[str, float | None] = {
            "requests": s.requests, "paired": s.paired, "unattributed_errors": s.unattributed_errors,
            "client_p95_ms": s.client_p95_ms, "challenger.paired_p95_ms": s.challenger_paired_p95_ms,
            "champion.paired_p95_ms": s.champion_paired_p95_ms, "p95_ratio": s.p95_ratio,
            "bpb_regression": s.bpb_regression,
        }
        for role in ("challenger", "champion"):
            v: VersionStats = getattr(s, role)
            values |= {f"{role}.n": v.n, f"{role}.error_rate": v.error_rate, f"{role}.p95_ms": v.p95_ms,
                       f"{role}.bpb": v.bpb}
        mlflow.log_metrics({f"step{s.percent}.{k}": float(x) for k, x in values.items() if x is not None}, step=i)
    mlflow.set_tags({"shardline.canary_verdict": decision.verdict, "shardline.canary_reason": decision.reason[:5000]})
