"""The stack's one HTTP ingress: every served model behind one route prefix, picked by the request's `model`.

The way OpenAI-compatible servers do it: `GET /v1/models` lists every served model with its champion version (`GET
/v1/models/NAME` is one model's card), `POST /v1/completions`, `/v1/chat/completions` and `/v1/score` go to the
router of the model the body names (or to `serve.default_model`, or to the only model there is). Each model keeps
its own application, router, canary, lock, lease and evidence; the gateway only forwards the request (headers and
body) to that router's handle and relays its reply, streamed or whole. Which models exist is observed, not
configured: the gateway lists the applications in Serve's status whose shardline router names this gateway (a run
chooses it by serve.route_prefix), every REFRESH_S and at once when a request names a model it does not know, so a
model deployed or removed by any run shows up without touching the gateway. The class is plain;
gateway_control.ensure_gateway wraps it with `serve.deployment`, so importing this needs no Ray.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict

from deployments import openai_api as oai
from deployments.http_io import (
    READS,
    check_token,
    endpoint_of,
    error_reply,
    failure_line,
    peek,
    read_body,
    reply,
    to_response,
    to_streaming_response,
)
from deployments.openai_api import ApiError
from deployments.router_config import REQUEST_ID_HEADER, ROUTER
from deployments.router_metrics_share import labelled, merge_expositions
from deployments.serve_metrics import RouterMetrics
from infra.redact import clip, first_line

log = logging.getLogger(__name__)
REFRESH_S = 2.0
# model requests a gateway replica forwards at once; serve.max_queued_requests more wait, and the rest get a 503
FORWARDING = 256
GATEWAY_HEADER = "x-shardline-gateway"  # the flow-start check tells shardline's gateway from other servers by it


GATEWAY_REPLICA_LABEL = "gateway_replica"


class GatewayConfig(BaseModel):
    """The gateway's user_config (a lightweight update changes it)."""

    model_config = ConfigDict(extra="forbid")

    default_model: str = ""
    max_request_bytes: int = 65536
    max_queued_requests: int = 512
    body_timeout_s: float = 10.0
    token_sha256: str = ""
    settings: str = ""  # gateway_control.gateway_settings: the deploy-time options it was deployed with


class Gateway:
    """HTTP ingress of every served model: routes by `model`, lists models, merges metrics."""

    def __init__(self, app_name: str):
        self.app_name = app_name
        self.cfg = GatewayConfig()
        self.models: dict[str, dict[str, Any]] = {}  # model name -> {"app", "champion", "created"}
        self.refreshed_at = 0.0
        # when the read that gave the list (or a failed re-read that kept it) began: a request naming a model the
        # gateway does not know forces a re-read, and those queued behind one that began after they asked take its
        # answer rather than re-read one after another (concurrent requests for a mistyped model name were each a
        # Serve status read and an RPC to every router, serialised on the lock)
        self.read_at = float("-inf")
        self._lock = asyncio.Lock()
        self._reloading: asyncio.Future[None] | None = None  # the background refresh in flight, if any
        self.metrics = RouterMetrics("")  # requests the gateway refuses itself (model "" = none chosen yet)
        # a scrape reaches one gateway replica: its own refusals carry this label, so two replicas' counters are two
        # series (which come and go with the replica scraped), not one that a rate() reads as reset at every switch
        self.replica = uuid.uuid4().hex[:12]
        self.waiting = 0  # model requests in this replica until their router answers (whole, or a stream's head)

    def reconfigure(self, config: dict[str, Any]) -> None:
        self.cfg = GatewayConfig.model_validate(config)

    def get_config(self) -> dict[str, Any]:
        return self.cfg.model_dump()

    async def _refresh(self, force: bool = False, wait: bool = True) -> None:
        """Re-read the served models when the list is older than REFRESH_S (or now, with `force`). With `wait=False`
        (a request on its way to a model) a stale list that has models is used as it is while one refresh runs in
        the background: Serve's status and every router's state are RPCs, and a request that waited for them (with
        every request behind it on the lock) was the endpoint's p99 (bench/bench_serve.py)."""
        if not wait and not force and self.models:
            if time.monotonic() - self.refreshed_at >= REFRESH_S and (
                self._reloading is None or self._reloading.done()
            ):
                self._reloading = asyncio.ensure_future(self._reload(False))
                self._reloading.add_done_callback(_log_failure)
            return
        await self._reload(force)

    async def _reload(self, force: bool) -> None:
        asked = time.monotonic()
        async with self._lock:
            if not force and time.monotonic() - self.refreshed_at < REFRESH_S:
                return
            if force and self.read_at >= asked:  # a read that began after this was asked for ended while it waited
                return
            began = time.monotonic()
            try:
                apps = await asyncio.to_thread(_router_apps, self.app_name)
            except Exception as e:  # noqa: BLE001 - Serve's controller restarting: answer from the last list
                if not self.models:
                    raise ApiError(
                        503,
                        f"the served models could not be read from Ray Serve: {failure_line(e)}",
                        kind="server_error",
                        code="serve_unavailable",
                        retry_after=1,
                    ) from None
                log.warning("the served models were not re-read (the last list is kept): %s", failure_line(e))
                self.refreshed_at, self.read_at = time.monotonic(), began  # tried again after REFRESH_S
                return
            found: dict[str, dict[str, Any]] = {}
            for app in apps:
                try:
                    cfg = (await _router(app).get_state.remote()).get("config")
                except Exception:  # noqa: BLE001 - a router restarting: keep what it served until it answers
                    found |= {m: d for m, d in self.models.items() if d["app"] == app}
                    continue
                if cfg and cfg.get("gateway") == self.app_name:  # models of other route prefixes are not ours
                    known = self.models.get(cfg["model_name"], {})
                    found[cfg["model_name"]] = {
                        "app": app,
                        "champion": cfg["champion"],
                        "created": known.get("created", time.time()),
                    }
            self.models, self.refreshed_at, self.read_at = found, time.monotonic(), began

    async def get_models(self) -> dict[str, dict[str, Any]]:
        """The served models as the gateway sees them now (`shardline status` reads this)."""
        await self._refresh(force=True)
        return self.models

    async def __call__(self, request: Any) -> Any:
        path = request.url.path.rstrip("/")
        headers = {GATEWAY_HEADER: "1"}
        try:
            if request.method in READS and path.endswith("/healthz"):
                return await self._healthz(request.query_params.get("model"), headers)
            if request.method in READS and path.endswith("/metrics"):
                return await self._metrics()
            check_token(dict(request.headers), self.cfg.token_sha256)
            endpoint = endpoint_of(path)
            if endpoint == "models":
                if request.method != "GET":
                    raise ApiError(405, f"{clip(path, 100)} takes GET", allow="GET")
                return to_response(reply(200, await self._model_cards(path.partition("/v1/models/")[2]), headers))
            if not endpoint:
                where = f"{clip(request.method, 16)} {clip(path, 100) or '/'}"
                raise ApiError(404, f"no such endpoint: {where}", code="not_found")
            if request.method != "POST":
                raise ApiError(405, f"{clip(path, 100)} takes POST", allow="POST")
            self._admit()
        except ApiError as e:
            self.metrics.rejected(endpoint_of(path) or "none", e.status)
            return to_response(error_reply(e, headers))
        try:
            return await self._model_request(request, path, headers)
        finally:
            self.waiting -= 1

    def _admit(self) -> None:
        """Count a model request in, or refuse it with OpenAI's error object (a 503 with Retry-After) when this
        replica already has FORWARDING + serve.max_queued_requests waiting on their routers' first answer. The
        gateway queues, not Ray's proxy: the proxy's own backpressure answer is a line of plain text."""
        limit = FORWARDING + self.cfg.max_queued_requests
        if self.waiting >= limit:
            raise ApiError(
                503,
                f"overloaded: {self.waiting} requests wait on this gateway replica, at most {FORWARDING} + "
                f"serve.max_queued_requests={self.cfg.max_queued_requests}; retry",
                kind="server_error",
                code="overloaded",
                retry_after=1,
            )
        self.waiting += 1

    async def _model_request(self, request: Any, path: str, headers: dict[str, str]) -> Any:
        """A counted-in model request: its body read, its model's router found, the request forwarded to it."""
        try:
            body = await read_body(request, self.cfg.max_request_bytes, self.cfg.body_timeout_s)
            model, stream = peek(body)
            app = await self._app_for(model)
        except ApiError as e:
            self.metrics.rejected(endpoint_of(path) or "none", e.status)
            return to_response(error_reply(e, headers))
        # one id per request, the same on a resend: the canary's evidence counts a resent request once
        forwarded = {**dict(request.headers), REQUEST_ID_HEADER: uuid.uuid4().hex}
        args = (request.method, request.url.path, forwarded, body)
        for _attempt in range(2):
            try:
                return await _forward(app, args, stream)
            except Exception as e:
                if not _replica_gone(e):
                    raise
                # its router replica died before answering (a redeploy replacing it, a crash): nothing was sent to
                # the client yet, so the request goes once more, to the replica Serve has (or starts) in its place
                log.warning("%s: the router replica died before answering (%s)", app, type(e).__name__)
        self.metrics.rejected(endpoint_of(path), 503)
        gone = ApiError(
            503,
            f"{app}: its router replica died twice before answering: retry",
            kind="server_error",
            code="router_unavailable",
            retry_after=1,
        )
        return to_response(error_reply(gone, headers))

    async def _model_cards(self, model: str) -> dict[str, Any]:
        """GET /v1/models: every served model's card; GET /v1/models/NAME (the official client's
        `models.retrieve`): that model's card, or OpenAI's model_not_found."""
        await self._refresh()
        if not model:
            return oai.model_list([oai.model_card(m, d["champion"], d["created"]) for m, d in self.models.items()])
        if model not in self.models:
            raise oai.model_not_found(model, sorted(self.models))
        return oai.model_card(model, self.models[model]["champion"], self.models[model]["created"])

    async def _app_for(self, model: str | None) -> str:
        """The application serving `model` (or the default one), or ApiError naming what is served."""
        await self._refresh(wait=False)
        if model is not None and model not in self.models:
            await self._refresh(force=True)  # deployed a moment ago?
        served = sorted(self.models)
        if model is None:
            model = self.cfg.default_model or (served[0] if len(served) == 1 else None)
        if model is None and not served:
            raise ApiError(503, "no model is served yet", kind="server_error", code="no_model", retry_after=5)
        if model is None:
            raise ApiError(
                400,
                f"model: required when several models are served ({', '.join(served)}); "
                "serve.default_model names the one to use without it",
                param="model",
            )
        if model not in self.models:
            raise oai.model_not_found(model, served)
        return str(self.models[model]["app"])

    async def _healthz(self, model: str | None, headers: dict[str, str]) -> Any:
        """Every served model's champion; with `?model=NAME`, or when a default (or the only) model exists, also
        that model's router health (champion, challenger, challenger_percent) at the top level."""
        await self._refresh()
        summary = {"models": {m: d["champion"] for m, d in self.models.items()}}
        try:
            app = await self._app_for(model)
        except ApiError as e:
            if model is not None:
                return to_response(error_reply(e, headers))
            status = "ok" if self.models else "waiting for a first model"
            return to_response(reply(200, {"status": status, **summary}, headers))
        try:
            out = await _router(app).respond.remote("GET", "/healthz", {}, b"")
        except Exception as e:  # noqa: BLE001 - a router restarting: its health is that, in one line
            gone = ApiError(503, f"{app}: its router did not answer: {type(e).__name__}", kind="server_error")
            return to_response(error_reply(gone, headers))
        if out["status"] == 200:
            out = reply(200, {**json.loads(out["body"]), **summary}, {**out["headers"], **headers})
        return to_response(out)

    async def _metrics(self) -> Any:
        from prometheus_client import CONTENT_TYPE_LATEST

        await self._refresh()
        replies = await asyncio.gather(
            *(_router(d["app"]).metrics_texts.remote() for d in self.models.values()), return_exceptions=True
        )
        own = (self.metrics.exposition()[0].decode(), {GATEWAY_REPLICA_LABEL: self.replica})
        parts: list[tuple[str, dict[str, str]]] = [own]
        for texts in replies:  # a model whose router did not answer is missing from this scrape only
            if isinstance(texts, dict):
                parts += labelled(texts)
        merged = merge_expositions(parts)
        return to_response(reply(200, merged, media_type=CONTENT_TYPE_LATEST))


async def _forward(app: str, args: tuple[Any, ...], stream: bool) -> Any:
    """The reply of `app`'s router to a request (method, path, headers, body): whole, or streamed once its router
    has answered the head (the status, or a refusal)."""
    router = _router(app)
    if not stream:
        return to_response(await router.respond.remote(*args))
    out = router.options(stream=True).respond_stream.remote(*args)
    head = await out.__anext__()
    if "body" in head:
        return to_response(head)
    return await to_streaming_response(head, _relay(out))


def _log_failure(task: asyncio.Future[None]) -> None:
    """A background refresh that failed: one line; the list it would have replaced stays until the next one."""
    error = None if task.cancelled() else task.exception()
    if error is not None:
        log.warning("the served models were not re-read: %s", first_line(error))


def _replica_gone(e: BaseException) -> bool:
    """True when a handle call failed because the replica's actor died (ActorDiedError). Serve itself resends a
    request a dying replica never accepted; this is one it accepted and never answered. Not an
    ActorUnavailableError (the replica may still answer it: resending would run it twice), nor a RayTaskError
    (the router raised, wrapping whatever it called)."""
    from ray.exceptions import ActorDiedError, RayTaskError

    return isinstance(e, ActorDiedError) and not isinstance(e, RayTaskError)


async def _relay(stream: Any) -> Any:
    """The router's events to the client; a client that goes away cancels the router's stream at once. A router
    that dies mid-stream ends it with OpenAI's error event (the client has part of the answer: it is not resent)."""
    done = False
    try:
        async for item in stream:
            yield item
        done = True
    except Exception as e:  # noqa: BLE001 - the router replica died mid-stream: the client gets an error event
        done = True
        cause = failure_line(e)
        yield oai.sse(
            oai.error_body(f"the model's router failed mid-stream: {cause}", "server_error", code="router_failed")
        )
    finally:
        if not done:
            stream.cancel()


def _router(app: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle(ROUTER, app)


def _router_apps(own: str) -> list[str]:
    """Applications other than this gateway that have a running shardline router."""
    from ray import serve

    apps = serve.status().applications
    # DEPLOYING and UNHEALTHY applications still serve on their running replicas (a canary step redeploys)
    return sorted(
        name
        for name, app in apps.items()
        if name != own and ROUTER in app.deployments and app.status not in ("DELETING", "NOT_STARTED")
    )
