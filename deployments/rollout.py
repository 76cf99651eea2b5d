"""The rollout driver: takes a challenger through the ramp on the live endpoint and applies the policy's decision.

Per step: a lightweight router update sets the weight and renews the canary's lease; the step bakes on the live
requests (topped up by labelled probe traffic when asked) until it has `min_requests` challenger requests and
`bake_seconds` passed, or fails at `step_timeout_s`; rollout_policy judges it. The registry is the desired state:
a promotion moves `champion` first (compare-and-set) and then reconciles the application to it; a rollback puts
all traffic on the champion at once, tags the version rejected and removes it. If this process dies, the lease
runs out and the router goes back to the champion by itself; the next reconcile removes the orphan.
"""
from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from deployments.config import CanaryConfig, ServeConfig
from deployments.endpoint import AppSpec, EndpointError, apply, app_name_for, reconcile, read_state, router_config, router_handle
from deployments.registry import (
    CHAMPION, TAG_CANARY_DECISION, TAG_REJECTED, AliasChanged, client_for, move_alias, read_aliases, tag_rejected,
)
from deployments.rollout_policy import (
    CanaryDecision, CanaryResult, StepMetrics, decide_canary, result_of, summarize_step,
)
from deployments.serve_app import PROBE_HEADER

log = logging.getLogger(__name__)


class CanaryDecided(RuntimeError):
    """The canary reached a decision but could not apply it; re-running it would measure again, so don't."""


class Prober:
    """Probe traffic: held-out texts POSTed to /v1/score at a fixed rate, labelled as probe, until stopped."""

    def __init__(self, url: str, texts: list[bytes], rps: float, max_bytes: int, seed: int, token: str = ""):
        usable = [t[:max_bytes].decode("utf-8", errors="ignore") for t in texts]
        self.texts = [t for t in usable if len(t.encode()) >= 2]
        if not self.texts:
            raise ValueError("no held-out text of at least 2 bytes to probe the endpoint with")
        self.url, self.rps, self.rng = f"{url}/v1/score", rps, random.Random(f"{seed}:probe")
        self.headers = {PROBE_HEADER: "1", **({"authorization": f"Bearer {token}"} if token else {})}
        self.sent = self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardline-probe", daemon=True)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=60) as http:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    r = http.post(self.url, json={"text": self.rng.choice(self.texts)}, headers=self.headers)
                    self.failed += r.status_code != 200
                except httpx.HTTPError:
                    self.failed += 1
                self.sent += 1
                self._stop.wait(max(0.0, 1.0 / self.rps - (time.monotonic() - t0)))


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


class _Ramp:
    """The application's state during one canary: both versions deployed, the router's weight, epoch and lease."""

    def __init__(self, cfg: CanaryConfig, serve: ServeConfig, model_name: str, champion: str, challenger: str,
                 tracking_uri: str, token_sha256: str, runtime_env: dict[str, Any] | None):
        self.cfg, self.serve, self.runtime_env = cfg, serve, runtime_env
        self.app = app_name_for(serve, model_name)
        self.tracking_uri = tracking_uri
        self.versions = [champion, challenger]
        self.canary_id = uuid.uuid4().hex
        self.base = router_config(serve, model_name, champion, token_sha256, seed=cfg.seed,
                                  shadow_share=cfg.shadow_share)
        self.challenger = challenger
        self.percent, self.epoch = 0, 0

    def set(self, percent: int, epoch: int) -> None:
        """Weight and step, with a fresh lease; the champion's replicas are untouched (a lightweight update)."""
        self.percent, self.epoch = percent, epoch
        router = self.base.model_copy(update={"challenger": self.challenger, "challenger_percent": percent,
                                              "canary_id": self.canary_id,
                                              "epoch": epoch, "lease_expires_at": time.time() + self.cfg.lease_s})
        apply(AppSpec(app_name=self.app, tracking_uri=self.tracking_uri, versions=self.versions, router=router),
              self.serve, self.runtime_env)

    def champion_only(self) -> None:
        """All traffic back on the champion at once; the challenger stays deployed until reconcile removes it."""
        apply(AppSpec(app_name=self.app, tracking_uri=self.tracking_uri, versions=self.versions, router=self.base),
              self.serve, self.runtime_env)

    def collect(self) -> tuple[list[dict[str, Any]], float, str]:
        """Observations of the current step once it has enough evidence, the seconds it took, and the reason
        it failed for lack of evidence ("" when it did not). Renews the lease while it waits."""
        cfg = self.cfg
        start = time.monotonic()
        renew_at = start + cfg.lease_s / 3
        seen: dict[tuple[str, int], dict[str, Any]] = {}
        cursor, replica = 0, ""
        while True:
            try:
                got = router_handle(self.app).get_observations.remote(self.canary_id, self.epoch, cursor).result(timeout_s=30)
                if got["replica_id"] != replica:  # a restarted router starts counting again; keep what we saw
                    replica, cursor = got["replica_id"], 0
                for ob in got["items"]:
                    seen[(replica, ob["seq"])] = ob
                cursor = got["next"]
            except Exception as e:  # noqa: BLE001 - a router restarting mid-step; its user_config survives
                log.warning("reading the router's observations: %s: %s", type(e).__name__, e)
            n = sum(1 for ob in seen.values() if ob.get("challenger") is not None)
            elapsed = time.monotonic() - start
            if n >= cfg.min_requests and elapsed >= cfg.bake_seconds:
                return list(seen.values()), elapsed, ""
            if elapsed >= cfg.step_timeout_s:
                return list(seen.values()), elapsed, (
                    f"too little evidence: {n} of canary.min_requests={cfg.min_requests} challenger requests in "
                    f"{elapsed:.0f} s (canary.step_timeout_s={cfg.step_timeout_s})")
            if time.monotonic() >= renew_at:
                self.set(self.percent, self.epoch)
                renew_at = time.monotonic() + cfg.lease_s / 3
            time.sleep(0.25)


def run_rollout(cfg: CanaryConfig, serve: ServeConfig, model_name: str, champion: str, challenger: str,
                tracking_uri: str, probe_texts: list[bytes], token: str = "", token_sha256: str = "",
                runtime_env: dict[str, Any] | None = None,
                on_step: Callable[[int, StepMetrics], None] | None = None,
                log_decision: Callable[[CanaryDecision], None] | None = None) -> CanaryResult:
    """Ramp `challenger` against `champion` on the live endpoint, decide, apply; the endpoint keeps serving.

    Ray must be initialised. `log_decision` receives the decision once it was applied (or applying it failed).

    Raises:
        CanaryDecided: a decision was taken but applying it failed (do not re-run the canary for it).
        AliasChanged: the registry's champion is not `champion` any more.
    """
    client = client_for(tracking_uri)
    found = reconcile(serve, model_name, tracking_uri, token_sha256, runtime_env)  # removes a dead canary's orphan
    tag_abandoned(client, model_name, found.removed)
    if found.champion != champion:
        raise AliasChanged(f"{model_name}: the registry's champion is {found.champion}, the canary expected {champion}")
    ramp = _Ramp(cfg, serve, model_name, champion, challenger, tracking_uri, token_sha256, runtime_env)
    decision: CanaryDecision | None = None
    steps: list[StepMetrics] = []
    try:
        try:
            ramp.set(0, 0)  # the challenger's replicas are healthy (serve.run waited) before it gets any traffic
        except EndpointError as e:  # a version that cannot start is a rejected version, not a retry
            decision = CanaryDecision(model_name=model_name, candidate=challenger, baseline=champion,
                                      verdict="rejected", reason=f"version {challenger} did not start: {e}")
            return _finish(client, decision, ramp, serve, tracking_uri, token_sha256, runtime_env, log_decision,
                           found.url)
        prober = Prober(found.url, probe_texts, cfg.probe_rps, cfg.max_probe_bytes, cfg.seed, token) \
            if cfg.probe_rps > 0 else None
        if prober is not None:
            prober.__enter__()
        try:
            for i, percent in enumerate(cfg.steps):
                ramp.set(percent, i + 1)
                observations, seconds, no_evidence = ramp.collect()
                step = summarize_step(percent, observations, champion, challenger, cfg, steps, seconds, no_evidence,
                                      cfg.seed)
                steps.append(step)
                if on_step is not None:
                    on_step(i, step)
                if step.failures:
                    ramp.champion_only()  # no more traffic on a failing challenger while we decide
                    break
        finally:
            if prober is not None:
                prober.__exit__(None, None, None)
        decision = decide_canary(model_name, challenger, champion, steps, cfg)
    except BaseException:
        _best_effort(ramp.champion_only)  # undecided: the champion serves everything; the registry is untouched
        raise
    return _finish(client, decision, ramp, serve, tracking_uri, token_sha256, runtime_env, log_decision, found.url)


def _finish(client: Any, decision: CanaryDecision, ramp: _Ramp, serve: ServeConfig, tracking_uri: str,
            token_sha256: str, runtime_env: dict[str, Any] | None,
            log_decision: Callable[[CanaryDecision], None] | None, url: str) -> CanaryResult:
    try:
        final = apply_decision(client, decision, ramp, serve, tracking_uri, token_sha256, runtime_env)
    except Exception as e:
        raise CanaryDecided(f"canary decided '{decision.verdict}' ({decision.reason}) but applying it failed: "
                            f"{type(e).__name__}: {e}") from e
    finally:  # the decision is recorded also when applying it failed
        if log_decision is not None:
            log_decision(decision)
    state = read_state(ramp.app)
    percent = state["effective_percent"] if state else None
    return result_of(decision, percent, champion=final, endpoint_url=url)


def apply_decision(client: Any, decision: CanaryDecision, ramp: _Ramp, serve: ServeConfig, tracking_uri: str,
                   token_sha256: str, runtime_env: dict[str, Any] | None) -> str:
    """Registry first (the desired state), then the application follows it; returns the champion afterwards.

    promoted: `champion` moves to the candidate (compare-and-set: AliasChanged if it moved), then reconcile serves
    it at 100% and drains and removes the old champion. rejected: champion-only routing at once, the candidate
    tagged rejected with the reason, then reconcile removes it.
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
        tag_rejected(client, name, decision.candidate, decision.reason)
    return str(reconcile(serve, name, tracking_uri, token_sha256, runtime_env).champion)


def tag_abandoned(client: Any, name: str, versions: list[str]) -> None:
    """Versions whose canary died undecided (their deployment was found orphaned and removed) say so."""
    for version in versions:
        if TAG_CANARY_DECISION not in client.get_model_version(name, version).tags:
            client.set_model_version_tag(name, version, TAG_CANARY_DECISION, "abandoned")
            client.set_model_version_tag(name, version, "shardline.canary_reason",
                                         "its canary ended without a decision (the driver died); the lease returned "
                                         "all traffic to the champion and the deployment was removed")


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
            "requests": s.requests, "probe_requests": s.probe_requests, "paired": s.paired, "seconds": s.seconds,
            "failed_requests": s.failed_requests, "fallbacks": s.fallbacks,
            "challenger.paired_p95_ms": s.challenger_paired_p95_ms, "champion.paired_p95_ms": s.champion_paired_p95_ms,
            "p95_ratio": s.p95_ratio, "p99_ratio": s.p99_ratio, "bpb_regression": s.bpb_regression,
            "bpb_regression_upper": s.bpb_regression_upper,
        }
        for role in ("challenger", "champion"):
            v = getattr(s, role)
            values |= {f"{role}.n": v.n, f"{role}.error_rate": v.error_rate, f"{role}.p95_ms": v.p95_ms,
                       f"{role}.bpb": v.bpb}
        mlflow.log_metrics({f"step{s.percent}.{k}": float(x) for k, x in values.items() if x is not None}, step=i)
    mlflow.set_tags({"shardline.canary_verdict": decision.verdict, "shardline.canary_reason": decision.reason[:5000]})
