"""The ramp of one canary: the router's weight, epoch and lease on the live application, the evidence each step
collects from the routers, and probe traffic that tops it up.

`Ramp.set` is a lightweight router update (the champion's replicas are untouched) that also renews the lease;
`Ramp.collect` reads the observations a step's requests left in the router (a restarted router starts counting
again; what was seen is kept) while polling the operator's commands (deployments/canary_control) and renewing the
lease, until the step has `canary.min_requests` challenger requests, `canary.min_paired` of them paired with a
champion score, and `canary.bake_seconds` passed, or `canary.step_timeout_s` ran out, or (sooner) the challenger's
errors already fail the error-rate gate on `canary.min_requests` requests. `warm_up` sends the challenger its
first calls before any step counts. The rollout driver
(deployments/rollout) decides what to do with each step.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from typing import Any, NamedTuple

from deployments import canary_control
from deployments.canary_records import OperatorCommand, Warmup
from deployments.config import CanaryConfig, ServeConfig
from deployments.endpoint import apply, router_handle
from deployments.rollout_gates import errors_already_fail, missing_evidence
from deployments.router_config import PROBE_HEADER, VARIANT_HEADER
from deployments.serve_build import AppSpec, app_name_for, router_config
from infra.redact import first_line

log = logging.getLogger(__name__)


WARMUP_BUDGET_S = 60.0  # a challenger that hangs holds the canary no longer than this; its steps then judge it


def _auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def _usable(texts: list[bytes], max_bytes: int) -> list[str]:
    cut = [t[:max_bytes].decode("utf-8", errors="ignore") for t in texts]
    return [t for t in cut if len(t.encode()) >= 2]


def warm_up(
    url: str, model: str, texts: list[bytes], cfg: CanaryConfig, token: str = "", budget_s: float = WARMUP_BUDGET_S
) -> Warmup | None:
    """`canary.warmup_requests` requests to `model`'s challenger alone before the first step counts, one at a time,
    alternately /v1/score and /v1/completions (2 tokens, greedy) on held-out texts, each with `x-shardline-variant:
    challenger`, which the router routes past the weight and never records as evidence (nor as the version's
    latency in its metrics). They pay the challenger's one-time costs (the routers' first calls to a new deployment,
    its first forward passes) that the first step would otherwise judge as its latency. Failures are recorded, not
    judged: the steps judge. At most `budget_s`, and half the canary's lease (no renewal happens meanwhile). None
    when there are none to send."""
    import httpx

    n = cfg.warmup_requests
    if n <= 0:
        return None
    budget_s = min(budget_s, cfg.lease_s / 2)
    usable = _usable(texts, cfg.max_probe_bytes) or ["shardline warm-up"]
    headers = {VARIANT_HEADER: "challenger", **_auth(token)}
    latency: list[float] = []
    failed = 0
    deadline = time.monotonic() + budget_s
    with httpx.Client() as http:
        for i in range(n):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            text = usable[i % len(usable)]
            path, body = (
                ("/v1/score", {"model": model, "text": text})
                if i % 2 == 0
                else ("/v1/completions", {"model": model, "prompt": text, "max_tokens": 2, "temperature": 0.0})
            )
            t0 = time.perf_counter()
            try:
                failed += http.post(url + path, json=body, headers=headers, timeout=min(30.0, left)).status_code != 200
            except Exception as e:  # noqa: BLE001 - best effort: a bad URL or a dead replica is the steps' to judge
                failed += 1
                log.warning("challenger warm-up: %s: %s", type(e).__name__, first_line(e))
            latency.append(round((time.perf_counter() - t0) * 1000, 2))
    warmup = Warmup(requests=len(latency), failed=failed, latency_ms=latency)
    log.info(
        "challenger warm-up: %d requests, %d failed, first %.1f ms, last %.1f ms",
        warmup.requests,
        failed,
        latency[0] if latency else 0.0,
        latency[-1] if latency else 0.0,
    )
    return warmup


class Prober:
    """Probe traffic: held-out texts POSTed to /v1/score at a fixed rate, labelled as probe, until stopped."""

    def __init__(
        self, url: str, texts: list[bytes], rps: float, max_bytes: int, seed: int, token: str = "", model: str = ""
    ):
        self.texts = _usable(texts, max_bytes)
        if not self.texts:
            raise ValueError("no held-out text of at least 2 bytes to probe the endpoint with")
        self.url, self.rps, self.rng = f"{url}/v1/score", rps, random.Random(f"{seed}:probe")
        self.model = model  # the gateway in front of several models routes by it
        self.headers = {PROBE_HEADER: "1", **_auth(token)}
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
                    body = {"text": self.rng.choice(self.texts), **({"model": self.model} if self.model else {})}
                    r = http.post(self.url, json=body, headers=self.headers)
                    self.failed += r.status_code != 200
                except httpx.HTTPError:
                    self.failed += 1
                self.sent += 1
                self._stop.wait(max(0.0, 1.0 / self.rps - (time.monotonic() - t0)))


class Collected(NamedTuple):
    """What one step's collection ended with: its observations and seconds, the evidence shortfall ("" when it had
    enough), the operator's promote or abort that ended it early (None when the evidence did) and whether an
    operator's pause outlasted canary.pause_timeout_s (then the canary rolls back)."""

    observations: list[dict[str, Any]]
    seconds: float
    shortfall: str
    command: OperatorCommand | None
    paused_out: bool = False


def take_observations(
    got: dict[str, Any], replica: str, cursor: int, seen: dict[tuple[str, int], dict[str, Any]]
) -> tuple[str, int]:
    """Add one read of the router's observations (`got`: replica_id, items from `cursor` on, next) to `seen`, keyed
    by (replica, seq); the (replica, cursor) the next read asks with. A restarted router replica numbers from 0 again:
    a read that asked it past its first observations (the old replica's cursor) is dropped and the next asks from 0,
    or those were never read; what was seen of the old replica is kept."""
    if got["replica_id"] != replica:
        asked, replica = cursor, got["replica_id"]
        if asked:
            return replica, 0
    for ob in got["items"]:
        seen[(replica, ob["seq"])] = ob
    return replica, got["next"]


class Ramp:
    """The application's state during one canary: both versions deployed, the router's weight, epoch and lease."""

    def __init__(
        self,
        cfg: CanaryConfig,
        serve: ServeConfig,
        model_name: str,
        champion: str,
        challenger: str,
        tracking_uri: str,
        token_sha256: str,
        runtime_env: dict[str, Any] | None,
        control: canary_control.DriverControl | None = None,
    ):
        self.cfg, self.serve, self.runtime_env = cfg, serve, runtime_env
        self.app = app_name_for(serve, model_name)
        self.tracking_uri = tracking_uri
        self.versions = [champion, challenger]
        self.canary_id = control.canary_id if control is not None else uuid.uuid4().hex
        self.control = control
        self.base = router_config(
            serve, model_name, champion, token_sha256, seed=cfg.seed, shadow_share=cfg.shadow_share, mode=cfg.mode
        )
        self.challenger = challenger
        self.percent, self.epoch, self.attempt = 0, 0, 0

    def set(self, percent: int, epoch: int) -> None:
        """Weight and step, with a fresh lease; the champion's replicas are untouched (a lightweight update)."""
        self.percent, self.epoch = percent, epoch
        lease = time.time() + self.cfg.lease_s
        router = self.base.model_copy(
            update={
                "challenger": self.challenger,
                "challenger_percent": percent,
                "canary_id": self.canary_id,
                "epoch": epoch,
                "lease_expires_at": lease,
                "lease_s": self.cfg.lease_s,
            }
        )
        apply(
            AppSpec(app_name=self.app, tracking_uri=self.tracking_uri, versions=self.versions, router=router),
            self.serve,
            self.runtime_env,
        )
        if self.control is not None:
            self.control.publish(percent, lease, self.attempt)

    def champion_only(self) -> None:
        """All traffic back on the champion at once; the challenger stays deployed until reconcile removes it."""
        apply(
            AppSpec(app_name=self.app, tracking_uri=self.tracking_uri, versions=self.versions, router=self.base),
            self.serve,
            self.runtime_env,
        )

    def _poll(self) -> OperatorCommand | None:
        """A command that changes what the driver does; pause and resume republish the state at once."""
        if self.control is None:
            return None
        command = self.control.poll(self.percent)
        if command is not None:
            self.set(self.percent, self.epoch)  # state and ack published with a fresh lease
        return command

    def collect(self) -> Collected:
        """Observations of the current step once it has enough evidence (or its timeout passed, or an operator
        promoted or aborted). Renews the lease while it waits; while paused, the step is not judged and its clock
        stands still. A pause longer than canary.pause_timeout_s ends the step at once, `paused_out` set."""
        cfg = self.cfg
        start = time.monotonic()
        renew_at = start + cfg.lease_s / 3
        seen: dict[tuple[str, int], dict[str, Any]] = {}
        cursor, replica = 0, ""
        paused_at: float | None = None
        before_pause: list[dict[str, Any]] = []  # the step's evidence when the pause began
        while True:
            try:
                got = (
                    router_handle(self.app)
                    .get_observations.remote(self.canary_id, self.epoch, cursor)
                    .result(timeout_s=30)
                )
                replica, cursor = take_observations(got, replica, cursor, seen)
            except Exception as e:  # noqa: BLE001 - a router restarting mid-step; its user_config survives
                log.warning("reading the router's observations: %s: %s", type(e).__name__, e)
            paused_out = paused_at is not None and time.monotonic() - paused_at >= cfg.pause_timeout_s
            if paused_out and self.control is not None:
                self.control.next_poll = 0.0  # a resume written just before the deadline is read, not dropped
            command = self._poll()
            if command is not None and command.action in ("promote", "abort"):
                return Collected(list(seen.values()), time.monotonic() - start, "", command)
            if command is not None and command.action == "pause":
                paused_at, before_pause = time.monotonic(), list(seen.values())
            elif command is not None and command.action == "resume" and paused_at is not None:
                start += time.monotonic() - paused_at  # the pause does not count against the step
                paused_at = None
            if paused_at is not None and paused_out:
                return self._paused_out(before_pause, paused_at - start)
            lacking = missing_evidence(seen.values(), cfg)
            elapsed = time.monotonic() - start
            if paused_at is None and not lacking and elapsed >= cfg.bake_seconds:
                return Collected(list(seen.values()), elapsed, "", None)
            if paused_at is None and lacking and (failing := errors_already_fail(seen.values(), cfg)):
                log.info("step %d%% ends early: %s", self.percent, failing)
                return Collected(list(seen.values()), elapsed, "", None)
            if paused_at is None and lacking and elapsed >= cfg.step_timeout_s:
                return Collected(
                    list(seen.values()),
                    elapsed,
                    (
                        f"too little evidence: {lacking} in {elapsed:.0f} s "
                        f"(canary.step_timeout_s={cfg.step_timeout_s:g})"
                    ),
                    None,
                )
            if time.monotonic() >= renew_at:
                self.set(self.percent, self.epoch)
                renew_at = time.monotonic() + cfg.lease_s / 3
            time.sleep(0.25)

    def _paused_out(self, observations: list[dict[str, Any]], seconds: float) -> Collected:
        """End a step whose pause outlasted canary.pause_timeout_s: it reads as deciding at once (no command is taken
        any more), and the step, on the evidence it had when the pause began, is inconclusive."""
        if self.control is not None:
            self.control.state = "deciding"
            self.set(self.percent, self.epoch)
        why = f"paused for longer than canary.pause_timeout_s={self.cfg.pause_timeout_s:g} s: not judged"
        return Collected(observations, seconds, why, None, paused_out=True)

    def between_steps(self) -> tuple[OperatorCommand | None, bool]:
        """Commands given while a step was being judged, read before the weight moves on (or the verdict is made):
        the last poll of `collect` was up to canary.control_poll_s before its end, and summarising the step and
        reading PromQL gates takes seconds more. A promote or abort ends the ramp (the command); a pause holds the
        current weight until a resume, promote or abort, or until canary.pause_timeout_s (then `True`: roll back)."""
        if self.control is None:
            return None, False
        self.control.next_poll = 0.0
        command = self._poll()
        if command is None or command.action == "resume":
            return None, False
        if command.action in ("promote", "abort"):
            return command, False
        paused_at = time.monotonic()
        renew_at = paused_at + self.cfg.lease_s / 3
        while True:
            if paused_out := time.monotonic() - paused_at >= self.cfg.pause_timeout_s:
                self.control.next_poll = 0.0  # a command written just before the deadline is read, not dropped
            command = self._poll()
            if command is not None and command.action == "resume":
                return None, False
            if command is not None and command.action in ("promote", "abort"):
                return command, False
            if paused_out:
                self.control.state = "deciding"
                self.set(self.percent, self.epoch)
                return None, True
            if time.monotonic() >= renew_at:
                self.set(self.percent, self.epoch)
                renew_at = time.monotonic() + self.cfg.lease_s / 3
            time.sleep(0.25)

    def await_approval(self) -> OperatorCommand | None:
        """Hold the current weight in state awaiting-approval until an operator promotes or aborts (the command),
        or canary.approval_timeout_s passes (None). Renews the lease while it waits."""
        assert self.control is not None
        self.control.state = "awaiting-approval"
        self.control.approval_deadline = time.time() + self.cfg.approval_timeout_s
        deadline = time.monotonic() + self.cfg.approval_timeout_s
        self.set(self.percent, self.epoch)
        renew_at = time.monotonic() + self.cfg.lease_s / 3
        while time.monotonic() < deadline:
            command = self._poll()
            if command is not None and command.action in ("promote", "abort"):
                return command
            if time.monotonic() >= renew_at:
                self.set(self.percent, self.epoch)
                renew_at = time.monotonic() + self.cfg.lease_s / 3
            time.sleep(0.25)
        self.control.next_poll = 0.0  # a promote written in the last poll interval is read, not timed out
        command = self._poll()
        return command if command is not None and command.action in ("promote", "abort") else None
