"""A model's Ray Serve application: one ModelServer deployment per served version behind one Router.

The Router takes a model's requests (from the gateway over a deployment handle, or over HTTP where the application
has a route of its own, as in a KubeRay RayService), validates them against the OpenAI protocol, routes each to the
champion or the challenger, shadow-scores, and records the canary's evidence. Which versions serve, and how much
traffic the challenger gets, is the router's `user_config` (RouterConfig): changed by lightweight `reconfigure()`
updates, read back by a restarted replica. A challenger's weight holds only while the canary's lease is fresh: past
`lease_expires_at`, or `lease_s` after the replica got the lease by its own clock, the router sends everything to the
champion by itself.
The classes are plain; serve_build.build_app wraps them with `serve.deployment`, so importing this needs no Ray.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator
from typing import Any

from deployments import openai_api as oai
from deployments.http_io import (
    READS,
    check_token,
    endpoint_of,
    error_reply,
    failure_line,
    read_body,
    reply,
    to_response,
    to_streaming_response,
)
from deployments.openai_api import ApiError, CompletionRequest, EmptyEncoding, ScoreRequest, empty_encoding
from deployments.openai_chat import chat_completion, chat_id, parse_chat
from deployments.router_chat import RouterChat
from deployments.router_config import (
    PROBE_HEADER,
    REQUEST_ID_HEADER,
    VARIANT_HEADER,
    VERSION_HEADER,
    Job,
    RouterConfig,
)
from deployments.router_evidence import EvidenceRecorder
from deployments.router_metrics_share import MetricsSharing
from deployments.router_stream import RouterStreams, prompt_piece
from deployments.serve_metrics import RouterMetrics
from infra.redact import clip
from training.chat_template import ChatFormat

log = logging.getLogger(__name__)
BODY_TIMEOUT_S = 10.0  # a body sent to the router's own route before its first configuration arrives


class Router(EvidenceRecorder, MetricsSharing, RouterStreams, RouterChat):
    """A model's requests: validates, routes each to champion or challenger, shadow-scores, records."""

    def __init__(self, app_name: str, models: dict[str, Any], model_name: str = "", evidence: Any = None):
        self.app_name = app_name
        self.handles: dict[str, Any] = dict(models)  # bound at deploy time; later versions resolved by name
        self.evidence = evidence  # the application's Evidence deployment (every router replica adds to it)
        self.cfg: RouterConfig | None = None
        self.replica_id = uuid.uuid4().hex
        self.metrics = RouterMetrics(model_name or app_name)
        self.observations: deque[dict[str, Any]] = deque(maxlen=20000)  # without an Evidence deployment only
        self._pushes: set[Any] = set()  # evidence sends in flight (a task nobody holds may be collected)
        self._metrics_task: asyncio.Task[None] | None = None  # this replica's metrics sends, once it served
        self._metrics_seq = 0  # numbers this replica's metrics sends, so the Evidence deployment keeps the latest
        self.seq = 0
        self.inflight: Counter[str] = Counter()
        self.rng = random.Random(0)
        self.shadow_rng = random.Random(1)
        self._mirrors: set[Any] = set()  # shadow-mode copies in flight (a task nobody holds may be collected)
        # each version's own chat format (false: no template), as its replica said once: versions never change
        self.templates: dict[str, ChatFormat] = {}
        self.lease_at = time.monotonic()  # when this replica got the current lease (RouterConfig.lease_s)

    # ----- configuration (Serve calls reconfigure with user_config at start and on every lightweight update)
    def reconfigure(self, config: dict[str, Any]) -> None:
        new = RouterConfig.model_validate(config)
        old = self.cfg
        if old is not None and old.canary_id != new.canary_id:
            self.observations.clear()  # another canary: what the last one saw is not evidence for this one
        if old is None or (old.epoch, old.challenger_percent, old.challenger) != (
            new.epoch,
            new.challenger_percent,
            new.challenger,
        ):
            self.rng = random.Random(f"{new.seed}:{new.epoch}:{new.challenger_percent}")
            self.shadow_rng = random.Random(f"{new.seed}:{new.epoch}:shadow")
        if old is None or old.lease_expires_at != new.lease_expires_at:
            self.lease_at = time.monotonic()  # a renewal; a restarted replica's lease still ends by the epoch deadline
        self.cfg = new
        self.metrics.set_percent(new.challenger_percent if new.challenger else 0)

    def percent_now(self, cfg: RouterConfig) -> int:
        """The challenger's weight now, by the lease's epoch deadline and by this replica's own clock."""
        return cfg.effective_percent(time.time(), time.monotonic() - self.lease_at)

    def get_state(self) -> dict[str, Any]:
        cfg = self.cfg.model_dump() if self.cfg else None
        now = time.time()
        return {
            "config": cfg,
            "replica_id": self.replica_id,
            "inflight": dict(self.inflight),
            "effective_percent": self.percent_now(self.cfg) if self.cfg else 0,
            "now": now,
        }

    def _handle(self, version: str) -> Any:
        if version not in self.handles:
            from ray import serve

            self.handles[version] = serve.get_deployment_handle(f"v{version}", self.app_name)
        return self.handles[version]

    async def _call(self, version: str, op: str, kind: str, *args: Any) -> dict[str, Any]:
        """The replica's answer with "ok": True, or {"version", "ok": False, "error"}; with "refused": True too
        when the version refused the prompt as the client's fault (EmptyEncoding), which is no model call's
        failure (the metrics do not count it)."""
        self.inflight[version] += 1
        try:
            out = {**await getattr(self._handle(version), op).remote(*args), "ok": True}
        except EmptyEncoding as e:  # through Ray, a RayTaskError that is also an instance of its cause
            out = {"version": version, "ok": False, "refused": True, "error": failure_line(e)}
        except Exception as e:  # noqa: BLE001 - a replica failure is an observation, not a router failure
            out = {"version": version, "ok": False, "error": failure_line(e)}
        finally:
            self.inflight[version] -= 1
        if not out.get("refused"):
            self.metrics.model_call(version, kind, op, out)
        return out

    async def _route(self, job: Job) -> tuple[Job, bool, bool] | dict[str, Any]:
        """`_choose`, then for a chat request `_render`: (the job, to the challenger, paired), or the reply that
        refuses it."""
        to_challenger, paired = self._choose(job)
        if job.messages is None:
            return job, to_challenger, paired
        try:
            return await self._render(job, to_challenger, paired)
        except ApiError as e:
            self.metrics.rejected(job.endpoint, e.status)
            return error_reply(e)

    # ----- requests: over HTTP (an application with a route of its own) or from the gateway's handle
    async def __call__(self, request: Any) -> Any:
        if request.method in READS and request.url.path.rstrip("/").endswith("/metrics"):
            from prometheus_client import CONTENT_TYPE_LATEST

            return to_response(reply(200, await self.metrics_exposition(), media_type=CONTENT_TYPE_LATEST))
        limit = self.cfg.max_request_bytes if self.cfg else 65536
        timeout_s = self.cfg.body_timeout_s if self.cfg else BODY_TIMEOUT_S
        try:
            body = await read_body(request, limit, timeout_s) if request.method == "POST" else b""
        except ApiError as e:
            self.metrics.rejected("none", e.status)
            return to_response(error_reply(e))
        # this router is the ingress: a client's own request id is not trusted (one id sent again and again would
        # keep its requests out of the canary's evidence, which counts an id once); the gateway sets its own
        headers = {**dict(request.headers), REQUEST_ID_HEADER: uuid.uuid4().hex}
        out = self.respond_stream(request.method, request.url.path, headers, body)
        head = await out.__anext__()
        if "body" in head:
            return to_response(head)
        return await to_streaming_response(head, out)

    async def respond(self, method: str, path: str, headers: dict[str, str], body: bytes) -> dict[str, Any]:
        """The whole reply to one request that is not a stream."""
        self._share_metrics()
        prepared = self._prepare(method, path, headers, body)
        return prepared if isinstance(prepared, dict) else await self._serve(prepared)

    async def respond_stream(self, method: str, path: str, headers: dict[str, str], body: bytes) -> AsyncIterator[Any]:
        """A reply as a head ({"status", "headers", "media_type"}, with "body" when it is whole) and, for a
        stream, its server-sent events as bytes."""
        self._share_metrics()
        prepared = self._prepare(method, path, headers, body)
        if isinstance(prepared, dict):
            yield prepared
        elif isinstance(prepared.req, CompletionRequest) and prepared.req.stream:
            async for item in self._serve_stream(prepared):
                yield item
        else:
            yield await self._serve(prepared)

    def _prepare(self, method: str, path: str, headers: dict[str, str], body: bytes) -> dict[str, Any] | Job:
        path = path.rstrip("/")
        endpoint = ""
        try:
            if method in READS and path.endswith("/healthz"):
                return self._healthz()
            endpoint = endpoint_of(path)
            if not endpoint:
                raise ApiError(404, f"no such endpoint: {clip(method, 16)} {clip(path, 100) or '/'}", code="not_found")
            if self.cfg is None:
                raise ApiError(503, "the router has no configuration yet", kind="server_error", retry_after=1)
            cfg = self.cfg
            check_token(headers, cfg.token_sha256)
            if endpoint == "models":
                if method != "GET":
                    raise ApiError(405, f"{clip(path, 100)} takes GET", allow="GET")
                card = oai.model_card(cfg.model_name, cfg.champion)
                named = path.partition("/v1/models/")[2]  # GET /v1/models/NAME: one model's card
                if named and named != cfg.model_name:
                    raise oai.model_not_found(named, [cfg.model_name])
                return reply(200, card if named else oai.model_list([card]))
            if method != "POST":
                raise ApiError(405, f"{clip(path, 100)} takes POST", allow="POST")
            messages = None
            req: CompletionRequest | ScoreRequest
            if endpoint == "chat":  # rendered once the version that answers is chosen (_render)
                req, messages = parse_chat(oai.parse_json(body), cfg.max_tokens_cap)
            else:
                req = oai.validate(
                    "completions" if endpoint == "completions" else "score",
                    oai.parse_json(body),
                    cfg.max_prompt_bytes,
                    cfg.max_tokens_cap,
                )
            if req.model is not None and req.model != cfg.model_name:
                raise ApiError(
                    404,
                    f"model: {oai.shown(req.model)} is not served here (this is {cfg.model_name!r})",
                    param="model",
                    code="model_not_found",
                )
            variant = headers.get(VARIANT_HEADER, "")
            if variant not in ("", "champion", "challenger"):
                raise ApiError(400, f"{VARIANT_HEADER}: {oai.shown(variant)} is not champion or challenger")
            if variant == "challenger" and cfg.challenger is None:
                raise ApiError(
                    404, f"{VARIANT_HEADER}: {cfg.model_name} has no challenger deployed", code="no_challenger"
                )
        except ApiError as e:
            self.metrics.rejected(endpoint or "none", e.status)
            return error_reply(e)
        probe = headers.get(PROBE_HEADER) == "1"
        return Job(endpoint, req, cfg, probe, variant, messages, request_id=headers.get(REQUEST_ID_HEADER, "")[:64])

    def _healthz(self) -> dict[str, Any]:
        if self.cfg is None:
            return reply(503, {"status": "starting"})
        return reply(
            200,
            {
                "status": "ok",
                "model": self.cfg.model_name,
                "champion": self.cfg.champion,
                "challenger": self.cfg.challenger,
                "challenger_percent": self.percent_now(self.cfg),
            },
            {VERSION_HEADER: self.cfg.champion},
        )

    def _choose(self, job: Job) -> tuple[bool, bool]:
        """(to the challenger, paired with a champion shadow score)."""
        cfg = job.cfg
        if job.variant:
            return job.variant == "challenger", False
        if cfg.mode == "shadow" and isinstance(job.req, CompletionRequest) and job.req.stream:
            return False, False  # a stream is not mirrored in shadow mode: the champion answers it, as every request
        percent = self.percent_now(cfg)
        to_challenger = cfg.challenger is not None and self.rng.random() * 100 < percent
        return to_challenger, to_challenger and self.shadow_rng.random() < cfg.shadow_share

    async def _serve(self, job: Job) -> dict[str, Any]:
        cfg, challenger = job.cfg, str(job.cfg.challenger)
        t0 = time.perf_counter()
        routed = await self._route(job)
        if isinstance(routed, dict):
            return routed
        job, to_challenger, paired = routed
        shadow = failed = None
        if to_challenger and cfg.mode == "shadow" and not job.variant:
            # shadow mode: the champion answers the client; a copy goes to the challenger afterwards, its answer
            # recorded as evidence (paired with the champion's own call on the same text) and never returned
            op, args = job.at(cfg.champion).op_args()
            served = await self._call(cfg.champion, op, "served", *args)
            if (job.messages is None or challenger in job.rendered) and not served.get("refused"):
                task = asyncio.ensure_future(self._mirror(job, served, paired, t0))
                self._mirrors.add(task)
                task.add_done_callback(self._mirrors.discard)
        elif to_challenger:
            mine = job.at(challenger)
            op, args = mine.op_args()
            # sequential, alternating order: concurrent scoring on a small machine would compare contention
            if paired and self.seq % 2:
                shadow = await self._call(cfg.champion, "score", "shadow", mine.text)
            served = await self._call(challenger, op, self._kind(job), *args)
            if paired and shadow is None:
                shadow = await self._call(cfg.champion, "score", "shadow", mine.text)
            if served.get("refused") and not job.variant:
                # the prompt encodes to no tokens for the challenger (the client's input, not its failure): the
                # champion answers, as when the challenger's chat template cannot take the messages (_render), and
                # the request is the champion's
                if job.messages is None or cfg.champion in job.rendered:
                    to_challenger = paired = False
                    shadow = None
                    op, args = job.at(cfg.champion).op_args()
                    served = await self._call(cfg.champion, op, self._kind(job), *args)
            elif not served["ok"] and not job.variant:
                # the client is answered by the champion; the failure counts against the challenger
                if op == "score" and shadow and shadow["ok"]:
                    failed, served = served, shadow
                elif job.messages is None or cfg.champion in job.rendered:  # in the champion's own chat format
                    op, args = job.at(cfg.champion).op_args()
                    failed, served = served, await self._call(cfg.champion, op, "served", *args)
                # else: no champion can answer this chat request; the failure is the challenger's alone
        else:
            op, args = job.at(cfg.champion).op_args()
            served = await self._call(cfg.champion, op, self._kind(job), *args)
        if served.get("refused"):  # the client's 400: neither the version's failure nor evidence
            self.metrics.rejected(job.endpoint, 400)
            return error_reply(empty_encoding(job.endpoint == "chat"), {VERSION_HEADER: served["version"]})
        if not job.variant and not (to_challenger and cfg.mode == "shadow"):
            self._record(job, to_challenger, served, shadow, failed, (time.perf_counter() - t0) * 1000.0)
        version = served["version"]
        self.metrics.request(version, job.endpoint, self._source(job), ok=served["ok"])
        if not served["ok"]:
            e = ApiError(
                503,
                f"model version {version} failed: {served['error']}",
                kind="server_error",
                code="model_failed",
                retry_after=1,
            )
            return error_reply(e, {VERSION_HEADER: version})
        if isinstance(job.req, ScoreRequest):
            payload: dict[str, Any] = {
                "model": cfg.model_name,
                "model_version": version,
                "bits_per_byte": served["bpb"],
                "bytes": served["bytes"],
                "bits": served["bits"],
            }
        else:
            payload = self._completion(job.at(version), served)
        return reply(200, payload, {VERSION_HEADER: version})

    async def _mirror(self, job: Job, served: dict[str, Any], paired: bool, t0: float) -> None:
        """Shadow mode: the challenger's answer to a copy of a request the champion already answered, paired (as in
        canary mode) with a champion score of the same text taken right beside it, so that both latencies of a pair
        are measured under the same load (the client's call ran earlier, under another)."""
        cfg, shadow = job.cfg, None
        mine = job.at(str(cfg.challenger))
        op, args = mine.op_args()
        if paired and self.seq % 2:  # sequential, alternating order, as _serve pairs
            shadow = await self._call(cfg.champion, "score", "shadow", mine.text)
        mirrored = await self._call(str(cfg.challenger), op, "mirror", *args)
        if mirrored.get("refused"):  # the prompt encodes to no tokens for the challenger: no evidence either way
            return
        if paired and shadow is None:
            shadow = await self._call(cfg.champion, "score", "shadow", mine.text)
        self._record(
            job,
            True,
            served,
            shadow,
            None,
            (time.perf_counter() - t0) * 1000.0,
            mirror=mirrored,
        )

    @staticmethod
    def _source(job: Job) -> str:
        return "variant" if job.variant else "probe" if job.probe else "live"

    @staticmethod
    def _kind(job: Job) -> str:
        """The model-call kind of the call that answers `job` (serve_metrics.RouterMetrics.model_call)."""
        return "variant" if job.variant else "served"

    def _completion(self, job: Job, served: dict[str, Any]) -> dict[str, Any]:
        from deployments.generation import merge_logprobs

        req = job.req
        assert isinstance(req, CompletionRequest)
        if job.endpoint == "chat":
            return chat_completion(
                chat_id(),
                job.cfg.model_name,
                served["version"],
                served["text"],
                served["finish_reason"],
                int(served.get("prompt_ids", len(job.text))),
                int(served["tokens"]),
                served["bpb"],
            )
        prompt = req.prompt if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            head = prompt_piece({**served, "prompt": job.text}) if req.echo else None
            logprobs = merge_logprobs([head, *served["pieces"]], start=len(prompt))
        return oai.completion(
            oai.completion_id(),
            job.cfg.model_name,
            served["version"],
            prompt + served["text"],
            served["finish_reason"],
            int(served.get("prompt_ids", len(job.text))),  # a replica of older code counted no ids
            int(served["tokens"]),
            logprobs,
            served["bpb"],
        )
