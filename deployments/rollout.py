"""The rollout driver: takes a challenger through the ramp on the live endpoint and applies the policy's decision.

Once the challenger's replicas are up, it gets `canary.warmup_requests` requests of its own (never evidence), so
that its one-time costs are not judged as its latency; their latencies are on the decision. Per step
(deployments/rollout_ramp): a lightweight router update sets the weight and renews the canary's lease;
the step bakes on the live requests (topped up by labelled probe traffic when asked) until it has `min_requests`
challenger requests and `bake_seconds` passed, or fails at `step_timeout_s`; rollout_gates judges it. The
registry is the desired state: a promotion moves `champion` first (compare-and-set) and then reconciles the
application to it; a rollback puts all traffic on the champion at once, tags the version (rejected,
inconclusive or aborted) and removes it. Either way the `challenger` alias goes and the version's description says
what it was trained on and how it was decided. If this process dies, the lease runs out and the router goes back
to the champion by itself; the next reconcile removes the orphan.

An operator steers a running canary through deployments/canary_control (MLflow model-version tags): the driver
publishes its state with every lease renewal and polls for commands while a step bakes or an approval is awaited.
pause: the step is not judged (its timeout clock stops) but the lease is renewed, so the router keeps the weight,
for at most canary.pause_timeout_s (then it rolls back, verdict aborted, as for an approval that never came);
resume: the step goes on; promote: the remaining steps are skipped and the version promoted now; abort: rolled
back now. With canary.approval='manual' the ramp holds its last step below 100% in state awaiting-approval until
an operator promotes or aborts, or canary.approval_timeout_s passes (then it rolls back).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from deployments import canary_control
from deployments.canary_records import CanaryDecision, CanaryResult, OperatorCommand, StepMetrics, result_of
from deployments.config import CanaryConfig, ServeConfig
from deployments.endpoint import EndpointError, read_state, reconcile
from deployments.registry import (
    CHALLENGER,
    CHAMPION,
    TAG_CANARY_DECISION,
    TAG_CANARY_ID,
    TAG_CANARY_REASON,
    TAG_REJECTED,
    AliasChanged,
    clear_challenger,
    client_for,
    describe_version,
    move_alias,
    read_aliases,
    tag_rejected,
)
from deployments.rollout_gates import apply_promql, summarize_step
from deployments.rollout_policy import TimedOut, decide_canary, hold_percent, next_move, ramp_steps
from deployments.rollout_ramp import Prober, Ramp, warm_up

log = logging.getLogger(__name__)
# how long `canary status` shows a decided canary as being applied before it reads as abandoned (its driver died)
DECIDING_S = 600.0


class CanaryDecided(RuntimeError):
    """The canary reached a decision but could not apply it; re-running it would measure again, so don't."""


def skip_reason(client: Any, cfg: CanaryConfig, model_name: str, champion: str | None, challenger: str) -> str:
    """Why no canary runs for `challenger` ("" when one should), read from the config and the registry.

    Raises:
        AliasChanged: `champion` no longer points at the version the promotion stage saw.
    """
    if not cfg.enabled:
        return "canary.enabled is false"
    rejected = client.get_model_version(model_name, challenger).tags.get(TAG_REJECTED)
    if champion is None and rejected:  # a rerun reused a rejected version after its champion's alias was removed
        return f"version {challenger} was already rejected: {rejected}; no champion to serve"
    if champion is None or champion == challenger:
        return f"no champion other than version {challenger} (first run)"
    current = read_aliases(client, model_name).get(CHAMPION)
    if current == challenger:
        return f"version {challenger} is already '{CHAMPION}' (decided by an earlier attempt)"
    if current != champion:
        raise AliasChanged(
            f"{model_name}: alias '{CHAMPION}' is at version {current}, the promotion stage saw "
            f"{champion}; not running a canary against a champion that moved"
        )
    if rejected:
        return f"version {challenger} was already rejected: {rejected}"
    return ""


def run_rollout(
    cfg: CanaryConfig,
    serve: ServeConfig,
    model_name: str,
    champion: str,
    challenger: str,
    tracking_uri: str,
    probe_texts: list[bytes],
    token: str = "",
    token_sha256: str = "",
    runtime_env: dict[str, Any] | None = None,
    on_step: Callable[[int, StepMetrics], None] | None = None,
    log_decision: Callable[[CanaryDecision], None] | None = None,
    run_id: str = "",
) -> CanaryResult:
    """Ramp `challenger` against `champion` on the live endpoint, decide, apply; the endpoint keeps serving.

    Ray must be initialised. `log_decision` receives the decision once it was applied (or applying it failed).
    `run_id`: the canary stage's MLflow run; it is tagged with the canary's id, so operator commands are logged on
    it (deployments/canary_control).

    Raises:
        CanaryDecided: a decision was taken but applying it failed (do not re-run the canary for it).
        AliasChanged: the registry's champion is not `champion` any more.
    """
    client = client_for(tracking_uri)
    found = reconcile(serve, model_name, tracking_uri, token_sha256, runtime_env)  # removes a dead canary's orphan
    tag_abandoned(client, model_name, [v for v in found.orphaned if v != challenger])  # a rerun may retry it
    if found.champion != champion:
        raise AliasChanged(f"{model_name}: the registry's champion is {found.champion}, the canary expected {champion}")
    control = canary_control.DriverControl(client, cfg, model_name, challenger, uuid.uuid4().hex)
    ramp = Ramp(cfg, serve, model_name, champion, challenger, tracking_uri, token_sha256, runtime_env, control)
    # the registry says which version is under canary (the promotion stage set it too; a canary of an older
    # version, flows/canary_version.py, did not), and the stage's run says which canary it ran
    client.set_registered_model_alias(model_name, CHALLENGER, challenger)
    if run_id:
        client.set_tag(run_id, TAG_CANARY_ID, control.canary_id)
    decision: CanaryDecision | None = None
    steps: list[StepMetrics] = []
    try:
        try:
            ramp.set(0, 0)  # the challenger's replicas are healthy (serve.run waited) before it gets any traffic
        except EndpointError as e:  # a version that cannot start is a rejected version, not a retry
            decision = CanaryDecision(
                model_name=model_name,
                candidate=challenger,
                baseline=champion,
                verdict="rejected",
                reason=f"version {challenger} did not start: {e}",
            )
            return _finish(
                client, decision, ramp, serve, tracking_uri, token_sha256, runtime_env, log_decision, found.url
            )
        warmup = warm_up(found.url, model_name, probe_texts, cfg, token)
        prober = (
            Prober(found.url, probe_texts, cfg.probe_rps, cfg.max_probe_bytes, cfg.seed, token, model_name)
            if cfg.probe_rps > 0
            else None
        )
        if prober is not None:
            prober.__enter__()
        ended_by: OperatorCommand | None = None
        timed_out: TimedOut = ""
        try:
            ended_by, stopped, paused_out = _ramp_up(ramp, cfg, champion, challenger, steps, on_step)
            if stopped:
                ramp.champion_only()  # no more traffic on a failing (or unjudgeable) challenger while we decide
                timed_out = "pause" if paused_out else ""
            elif ended_by is None and hold_percent(cfg) is not None:
                ended_by = ramp.await_approval()
                timed_out = "approval" if ended_by is None else ""
        finally:
            if prober is not None:
                prober.__exit__(None, None, None)
        decision = decide_canary(model_name, challenger, champion, steps, cfg, ended_by, timed_out, control.applied)
        decision = decision.model_copy(update={"warmup": warmup})
    except BaseException:
        _best_effort(ramp.champion_only)  # undecided: the champion serves everything; the registry is untouched
        raise
    return _finish(client, decision, ramp, serve, tracking_uri, token_sha256, runtime_env, log_decision, found.url)


def _ramp_up(
    ramp: Ramp,
    cfg: CanaryConfig,
    champion: str,
    challenger: str,
    steps: list[StepMetrics],
    on_step: Callable[[int, StepMetrics], None] | None,
) -> tuple[OperatorCommand | None, bool, bool]:
    """Each weight of the ramp in turn, an inconclusive step again while canary.on_inconclusive allows; appends the
    judged steps. Returns (the operator's promote or abort that ended it, whether a step stopped it, whether that
    was a pause that outlasted canary.pause_timeout_s)."""
    epoch = 0
    for percent in ramp_steps(cfg):
        ramp.attempt = 0
        while True:
            epoch += 1
            ramp.set(percent, epoch)
            got = ramp.collect()
            step = summarize_step(
                percent, got.observations, champion, challenger, cfg, steps, got.seconds, got.shortfall, cfg.seed
            ).model_copy(update={"attempt": ramp.attempt})
            if cfg.promql_gates:
                from deployments.promql import read_gates

                step = apply_promql(step, read_gates(cfg, ramp.base.model_name, champion, challenger))
            steps.append(step)
            if on_step is not None:
                on_step(len(steps) - 1, step)
            if got.command is not None:
                return got.command, False, False
            if got.paused_out:  # an operator's pause outlasted canary.pause_timeout_s: roll back
                return None, True, True
            move = next_move(step, cfg)
            if move == "stop":
                return None, True, False
            if move == "next":
                command, paused_out = ramp.between_steps()  # before the next weight, or the verdict, is set
                if command is not None or paused_out:
                    return command, paused_out, paused_out
                break
            ramp.attempt += 1
            log.info(
                "step %d%% inconclusive (%s); running it again (%d of canary.max_extensions=%d)",
                percent,
                "; ".join(step.inconclusive),
                ramp.attempt,
                cfg.max_extensions,
            )
    return None, False, False


def _finish(
    client: Any,
    decision: CanaryDecision,
    ramp: Ramp,
    serve: ServeConfig,
    tracking_uri: str,
    token_sha256: str,
    runtime_env: dict[str, Any] | None,
    log_decision: Callable[[CanaryDecision], None] | None,
    url: str,
) -> CanaryResult:
    if ramp.control is not None:  # a command sent from now on is refused, not taken and then silently dropped
        ramp.control.state = "deciding"  # also in whatever the ramp publishes while the decision is applied
        ramp.control.publish(
            ramp.percent, time.time() + DECIDING_S, ramp.attempt, state="deciding", verdict=decision.verdict
        )
    try:
        final = apply_decision(client, decision, ramp, serve, tracking_uri, token_sha256, runtime_env)
    except Exception as e:
        raise CanaryDecided(
            f"canary decided '{decision.verdict}' ({decision.reason}) but applying it failed: {type(e).__name__}: {e}"
        ) from e
    finally:  # the decision is recorded also when applying it failed
        if log_decision is not None:
            log_decision(decision)
        if ramp.control is not None:  # status reads `none` with the verdict; a waiting `canary promote` returns
            ramp.control.publish(
                ramp.percent, 0.0, ramp.attempt, state="none", verdict=decision.verdict, reason=decision.reason[:2000]
            )
    state = read_state(ramp.app)
    percent = state["effective_percent"] if state else None
    return result_of(decision, percent, champion=final, endpoint_url=url)


def outcome_text(decision: CanaryDecision) -> str:
    """How a version was decided, for its registry description: verdict, by whom, when, the reason with its numbers."""
    when = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime())
    against = f" against champion v{decision.baseline}" if decision.baseline else ""
    return f"Canary{against}: {decision.verdict} ({decision.decided_by}, {when}): {decision.reason}"


def apply_decision(
    client: Any,
    decision: CanaryDecision,
    ramp: Ramp,
    serve: ServeConfig,
    tracking_uri: str,
    token_sha256: str,
    runtime_env: dict[str, Any] | None,
) -> str:
    """Registry first (the desired state), then the application follows it; returns the champion afterwards.

    promoted: `champion` moves to the candidate (compare-and-set: AliasChanged if it moved), then reconcile serves
    it at 100% and drains and removes the old champion. Otherwise: champion-only routing at once; a rejected
    candidate is tagged rejected with the reason (a rerun skips it), an inconclusive or aborted one only records
    its verdict (it may be canaried again); then reconcile removes it. Either way the `challenger` alias goes and
    the candidate's description says how it was decided.
    """
    name = decision.model_name
    if decision.verdict == "promoted":
        try:
            move_alias(client, name, CHAMPION, decision.baseline, decision.candidate)
        except AliasChanged:
            _best_effort(lambda: reconcile(serve, name, tracking_uri, token_sha256, runtime_env))
            raise
        client.set_model_version_tag(name, decision.candidate, TAG_CANARY_DECISION, "promoted")
    else:
        ramp.champion_only()
        if decision.verdict == "rejected":
            tag_rejected(client, name, decision.candidate, decision.reason)
        else:
            client.set_model_version_tag(name, decision.candidate, TAG_CANARY_DECISION, decision.verdict)
    client.set_model_version_tag(name, decision.candidate, TAG_CANARY_REASON, decision.reason[:5000])
    clear_challenger(client, name, decision.candidate)
    describe_version(client, name, decision.candidate, outcome_text(decision))
    return str(reconcile(serve, name, tracking_uri, token_sha256, runtime_env).champion)


def describe_skipped(client: Any, name: str, version: str, why: str) -> None:
    """A version that got no canary: once it is the champion (the first one) it is no challenger any more, and its
    description says so; one waiting as challenger (canary.enabled false) keeps the alias."""
    if read_aliases(client, name).get(CHAMPION) == version:
        clear_challenger(client, name, version)
        if TAG_CANARY_DECISION not in (client.get_model_version(name, version).tags or {}):  # not decided before
            describe_version(client, name, version, f"Champion without a canary: {why}.")


def tag_abandoned(client: Any, name: str, versions: list[str]) -> None:
    """Versions whose canary died undecided (their deployment was found orphaned and removed) say so."""
    for version in versions:
        if TAG_CANARY_DECISION not in client.get_model_version(name, version).tags:
            client.set_model_version_tag(name, version, TAG_CANARY_DECISION, "abandoned")
            client.set_model_version_tag(
                name,
                version,
                TAG_CANARY_REASON,
                "its canary ended without a decision (the driver died); the lease returned "
                "all traffic to the champion and the deployment was removed",
            )


def _best_effort(action: Callable[[], Any]) -> None:
    try:
        action()
    except Exception as e:  # noqa: BLE001 - on a failure path; the lease and the next reconcile are the backstop
        log.warning("restoring champion-only routing: %s: %s", type(e).__name__, e)


def log_decision(decision: CanaryDecision) -> None:
    """Log the decision to the active MLflow run: JSON artifact, `step{percent}.*` metrics, verdict tags."""
    import mlflow

    mlflow.log_dict(decision.model_dump(mode="json"), "canary_decision.json")
    for i, s in enumerate(decision.metrics):
        values: dict[str, float | None] = {
            "requests": s.requests,
            "probe_requests": s.probe_requests,
            "paired": s.paired,
            "seconds": s.seconds,
            "failed_requests": s.failed_requests,
            "fallbacks": s.fallbacks,
            "challenger.paired_p95_ms": s.challenger_paired_p95_ms,
            "champion.paired_p95_ms": s.champion_paired_p95_ms,
            "p95_ratio": s.p95_ratio,
            "p99_ratio": s.p99_ratio,
            "bpb_regression": s.bpb_regression,
            "bpb_regression_upper": s.bpb_regression_upper,
        }
        values |= {f"promql.{r.name}": r.value for r in s.promql}
        for role in ("challenger", "champion"):
            v = getattr(s, role)
            values |= {
                f"{role}.n": v.n,
                f"{role}.error_rate": v.error_rate,
                f"{role}.p95_ms": v.p95_ms,
                f"{role}.bpb": v.bpb,
            }
        mlflow.log_metrics({f"step{s.percent}.{k}": float(x) for k, x in values.items() if x is not None}, step=i)
    if decision.warmup is not None and decision.warmup.latency_ms:
        lat = decision.warmup.latency_ms
        mlflow.log_metrics(
            {"warmup.requests": decision.warmup.requests, "warmup.failed": decision.warmup.failed}
            | {"warmup.first_ms": lat[0], "warmup.last_ms": lat[-1]}
        )
    mlflow.set_tags(
        {
            "shardline.canary_verdict": decision.verdict,
            "shardline.canary_decided_by": decision.decided_by,
            TAG_CANARY_REASON: decision.reason[:5000],
        }
    )
