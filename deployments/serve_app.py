"""The live endpoint's Ray Serve application: one ModelServer deployment per served version behind one Router.

The Router is the HTTP ingress (`/v1/completions`, `/v1/score`, `/healthz`, `/metrics`). Which versions serve, and
how much traffic the challenger gets, is the router's `user_config` (RouterConfig): changed by lightweight
`reconfigure()` updates, read back by a restarted replica. A challenger's weight holds only while the canary's
lease is fresh: past `lease_expires_at` the router sends everything to the champion by itself.
The classes are plain; endpoint.build_app wraps them with `serve.deployment`, so importing this needs no Ray.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import random
import time
import uuid
from collections import Counter, deque
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments.serve_metrics import RouterMetrics

VERSION_HEADER = "x-shardline-model-version"
PROBE_HEADER = "x-shardline-probe"


class RouterConfig(BaseModel):
    """The router's user_config: the served versions, the challenger's weight and lease, the request limits."""

    model_config = ConfigDict(extra="forbid")

    model_name: str
    champion: str
    challenger: str | None = None
    challenger_percent: int = Field(0, ge=0, le=100)
    shadow_share: float = Field(1.0, ge=0, le=1)
    lease_expires_at: float | None = None  # epoch seconds; None with no challenger
    canary_id: str = ""  # one per canary; observations are tagged with it and the step
    epoch: int = 0  # the canary step
    seed: int = 0
    max_request_bytes: int = 65536
    max_prompt_bytes: int = 4096
    max_tokens_cap: int = 256
    token_sha256: str = ""  # sha256 of the bearer token; "" = no auth

    def effective_percent(self, now: float) -> int:
        """The challenger's weight now: 0 without a challenger or once its lease ran out (dead man's switch)."""
        if self.challenger is None or self.lease_expires_at is None or now >= self.lease_expires_at:
            return 0
        return self.challenger_percent


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=5.0)
    seed: int | None = Field(None, ge=0, lt=2**63)


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str = Field(min_length=1)


class ModelServer:
    """One registered model version: `score(text)` and `complete(prompt, ...)`, with the model's own latency."""

    def __init__(self, model_name: str, version: str, tracking_uri: str, threads: int = 1):
        from infra.credentials import adopt_worker_secrets
        from infra.paths import quiet_telemetry

        quiet_telemetry()
        adopt_worker_secrets(required=False)  # MLflow credentials from this application's 0600 file, if any
        import mlflow
        import torch

        from deployments.registry import seq_len_of

        torch.set_num_threads(threads)
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_registry_uri(tracking_uri)
        uri = f"models:/{model_name}/{version}"
        self.version = version
        self.seq_len = seq_len_of(uri)
        self.model = mlflow.pytorch.load_model(uri, map_location="cpu")
        self.score(bytes(i % 256 for i in range(2 * self.seq_len + 3)))  # the first calls are slow: not on a request
        self.complete(b"warm", 2, 0.0, 0)

    def describe(self) -> dict[str, Any]:
        """The replica's version and process id (tests check that a weight change restarts no replica)."""
        import os

        return {"version": self.version, "pid": os.getpid()}

    def check_health(self) -> None:
        """Serve's health check: a replica whose model cannot run one token is restarted."""
        import torch

        with torch.no_grad():
            self.model(torch.zeros(1, 1, dtype=torch.long))

    def score(self, text: bytes) -> dict[str, Any]:
        from training.bpb import text_bits

        t0 = time.perf_counter()
        bits, n = _finite(text_bits(self.model, text, self.seq_len), self.version)
        return {"version": self.version, "bits": bits, "bytes": n, "bpb": bits / n if n else None,
                "latency_ms": (time.perf_counter() - t0) * 1000.0}

    def complete(self, prompt: bytes, max_tokens: int, temperature: float, seed: int | None) -> dict[str, Any]:
        """Continue `prompt` by `max_tokens` bytes; also score the prompt (the request's own labels)."""
        import torch

        from training.bpb import text_bits

        t0 = time.perf_counter()
        bits, n = _finite(text_bits(self.model, prompt, self.seq_len), self.version)
        gen = torch.Generator().manual_seed(seed if seed is not None else random.getrandbits(63))
        context = torch.tensor(list(prompt[-self.seq_len:]), dtype=torch.long)
        out = bytearray()
        with torch.no_grad():
            for _ in range(max_tokens):
                logits = self.model(context[None, -self.seq_len:])[0, -1].float()
                if temperature == 0:
                    nxt = int(torch.argmax(logits))
                else:
                    nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
                out.append(nxt)
                context = torch.cat([context, torch.tensor([nxt])])
        return {"version": self.version, "text": out.decode("utf-8", errors="replace"), "bits": bits, "bytes": n,
                "bpb": bits / n if n else None, "latency_ms": (time.perf_counter() - t0) * 1000.0}


def _finite(scored: tuple[float, int], version: str) -> tuple[float, int]:
    """A score, or ValueError when the model produced non-finite logits (a broken model is an erroring one)."""
    if not math.isfinite(scored[0]):
        raise ValueError(f"model version {version} produced non-finite logits")
    return scored


def _error(status: int, message: str) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=status)


class Router:
    """HTTP ingress: validates, routes each request to champion or challenger, shadow-scores, records."""

    def __init__(self, app_name: str, models: dict[str, Any]):
        self.app_name = app_name
        self.handles: dict[str, Any] = dict(models)  # bound at deploy time; later versions resolved by name
        self.cfg: RouterConfig | None = None
        self.replica_id = uuid.uuid4().hex
        self.metrics = RouterMetrics()
        self.observations: deque[dict[str, Any]] = deque(maxlen=20000)
        self.seq = 0
        self.inflight: Counter[str] = Counter()
        self.rng = random.Random(0)
        self.shadow_rng = random.Random(1)

    # ----- configuration (Serve calls reconfigure with user_config at start and on every lightweight update)
    def reconfigure(self, config: dict[str, Any]) -> None:
        new = RouterConfig.model_validate(config)
        old = self.cfg
        if old is not None and old.canary_id != new.canary_id:
            self.observations.clear()  # another canary: what the last one saw is not evidence for this one
        if old is None or (old.epoch, old.challenger_percent, old.challenger) != (
                new.epoch, new.challenger_percent, new.challenger):
            self.rng = random.Random(f"{new.seed}:{new.epoch}:{new.challenger_percent}")
            self.shadow_rng = random.Random(f"{new.seed}:{new.epoch}:shadow")
        self.cfg = new
        self.metrics.set_percent(new.challenger_percent if new.challenger else 0)

    def get_state(self) -> dict[str, Any]:
        cfg = self.cfg.model_dump() if self.cfg else None
        now = time.time()
        return {"config": cfg, "replica_id": self.replica_id, "inflight": dict(self.inflight),
                "effective_percent": self.cfg.effective_percent(now) if self.cfg else 0, "now": now}

    def get_observations(self, canary_id: str, epoch: int, since: int = 0) -> dict[str, Any]:
        """Requests recorded at step `epoch` of canary `canary_id` with sequence number >= since."""
        items = [o for o in self.observations
                 if o["canary_id"] == canary_id and o["epoch"] == epoch and o["seq"] >= since]
        return {"replica_id": self.replica_id, "next": self.seq, "items": items}

    def _handle(self, version: str) -> Any:
        if version not in self.handles:
            from ray import serve

            self.handles[version] = serve.get_deployment_handle(f"v{version}", self.app_name)
        return self.handles[version]

    async def _call(self, version: str, op: str, kind: str, *args: Any) -> dict[str, Any]:
        self.inflight[version] += 1
        try:
            out = {**await getattr(self._handle(version), op).remote(*args), "ok": True}
        except Exception as e:  # noqa: BLE001 - a replica failure is an observation, not a router failure
            out = {"version": version, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
        finally:
            self.inflight[version] -= 1
        self.metrics.model_call(version, kind, op, out)
        return out

    # ----- HTTP
    async def __call__(self, request: Any) -> Any:
        path = request.url.path.rstrip("/")
        if request.method == "GET" and path.endswith("/healthz"):
            return self._healthz()
        if request.method == "GET" and path.endswith("/metrics"):
            from starlette.responses import Response

            body, content_type = self.metrics.exposition()
            return Response(body, media_type=content_type)
        endpoint = "completions" if path.endswith("/v1/completions") else "score" if path.endswith("/v1/score") else ""
        if not endpoint:
            return self._reject(404, "", f"no such endpoint: {request.method} {request.url.path}")
        if request.method != "POST":
            return self._reject(405, endpoint, f"{request.url.path} takes POST")
        if self.cfg is None:
            return self._reject(503, endpoint, "the router has no configuration yet")
        cfg = self.cfg
        if cfg.token_sha256:
            given = request.headers.get("authorization", "")
            digest = hashlib.sha256(given.removeprefix("Bearer ").encode()).hexdigest()
            if not given.startswith("Bearer ") or not hmac.compare_digest(digest, cfg.token_sha256):
                return self._reject(401, endpoint, "missing or wrong bearer token")
        body = await self._read_body(request, cfg.max_request_bytes)
        if isinstance(body, int):
            return self._reject(413, endpoint, f"request body over serve.max_request_bytes={cfg.max_request_bytes}")
        parsed = self._parse(endpoint, body, cfg)
        if isinstance(parsed, tuple):
            return self._reject(*parsed[:1], endpoint, parsed[1])
        return await self._serve(endpoint, parsed, cfg, request.headers.get(PROBE_HEADER) == "1")

    def _healthz(self) -> Any:
        from starlette.responses import JSONResponse

        if self.cfg is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.cfg.model_name, "champion": self.cfg.champion,
                             "challenger": self.cfg.challenger,
                             "challenger_percent": self.cfg.effective_percent(time.time())},
                            headers={VERSION_HEADER: self.cfg.champion})

    def _reject(self, status: int, endpoint: str, message: str) -> Any:
        self.metrics.rejected(endpoint or "none", status)
        return _error(status, message)

    @staticmethod
    async def _read_body(request: Any, limit: int) -> bytes | int:
        """The body, or the status 413 when it is over `limit`: from Content-Length before reading, else while
        streaming (a chunked body is never held past the limit)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return 413
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return 413
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    def _parse(endpoint: str, body: bytes, cfg: RouterConfig) -> CompletionRequest | ScoreRequest | tuple[int, str]:
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return 400, f"body is not JSON: {e.msg if hasattr(e, 'msg') else e} at position {getattr(e, 'pos', 0)}"
        except RecursionError:
            return 400, "body is not JSON this endpoint accepts: nested too deeply"
        model = CompletionRequest if endpoint == "completions" else ScoreRequest
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            return 422, f"{where}: {first['msg']}"
        text = req.prompt if isinstance(req, CompletionRequest) else req.text
        size = len(text.encode("utf-8"))
        if size > cfg.max_prompt_bytes:
            return 422, f"{'prompt' if endpoint == 'completions' else 'text'}: {size} bytes > serve.max_prompt_bytes={cfg.max_prompt_bytes}"
        if isinstance(req, ScoreRequest) and size < 2:
            return 422, "text: needs at least 2 bytes (the first byte is never predicted)"
        if isinstance(req, CompletionRequest) and req.max_tokens > cfg.max_tokens_cap:
            return 422, f"max_tokens: {req.max_tokens} > serve.max_tokens_cap={cfg.max_tokens_cap}"
        return req

    async def _serve(self, endpoint: str, req: CompletionRequest | ScoreRequest, cfg: RouterConfig,
                     probe: bool) -> Any:
        from starlette.responses import JSONResponse

        text = (req.prompt if isinstance(req, CompletionRequest) else req.text).encode("utf-8")
        op, args = ("complete", (text, req.max_tokens, req.temperature, req.seed)) \
            if isinstance(req, CompletionRequest) else ("score", (text,))
        t0 = time.perf_counter()
        percent = cfg.effective_percent(time.time())
        to_challenger = cfg.challenger is not None and self.rng.random() * 100 < percent
        shadow = failed = None
        if to_challenger:
            paired = self.shadow_rng.random() < cfg.shadow_share
            # sequential, alternating order: concurrent scoring on a small machine would compare contention
            if paired and self.seq % 2:
                shadow = await self._call(cfg.champion, "score", "shadow", text)
            served = await self._call(cfg.challenger, op, "served", *args)
            if paired and shadow is None:
                shadow = await self._call(cfg.champion, "score", "shadow", text)
            if not served["ok"]:  # the client is answered by the champion; the failure counts against the challenger
                failed = served
                served = await self._call(cfg.champion, op, "served", *args) if op != "score" or not (
                    shadow and shadow["ok"]) else shadow
        else:
            served = await self._call(cfg.champion, op, "served", *args)
        self._record(cfg, endpoint, probe, to_challenger, served, shadow, failed, (time.perf_counter() - t0) * 1000.0)
        version = served["version"]
        if not served["ok"]:
            self.metrics.request(version, endpoint, probe, ok=False)
            return JSONResponse({"error": f"model version {version} failed: {served['error']}",
                                 "model_version": version}, status_code=503, headers={VERSION_HEADER: version})
        self.metrics.request(version, endpoint, probe, ok=True)
        payload: dict[str, Any] = {"model": cfg.model_name, "model_version": version}
        if endpoint == "completions":
            payload |= {"text": served["text"], "prompt_bits_per_byte": served["bpb"]}
        else:
            payload |= {"bits_per_byte": served["bpb"], "bytes": served["bytes"], "bits": served["bits"]}
        return JSONResponse(payload, headers={VERSION_HEADER: version})

    def _record(self, cfg: RouterConfig, endpoint: str, probe: bool, to_challenger: bool, served: dict,
                shadow: dict | None, failed: dict | None, total_ms: float) -> None:
        """One observation per request: the challenger's call (also when it failed and the champion answered),
        the champion's served call, and the champion's shadow score of the same text."""
        fallback = failed is not None
        challenger_call = failed if fallback else (served if to_challenger else None)
        champion_call = served if (not to_challenger or fallback) and served is not shadow else None

        def slim(call: dict | None) -> dict | None:
            if call is None:
                return None
            return {k: call.get(k) for k in ("version", "ok", "bits", "bytes", "latency_ms", "error")}

        self.observations.append({
            "seq": self.seq, "canary_id": cfg.canary_id, "epoch": cfg.epoch, "t": time.time(), "endpoint": endpoint, "probe": probe,
            "op": "complete" if endpoint == "completions" else "score",
            "role": "challenger" if to_challenger else "champion",
            "challenger": slim(challenger_call), "champion": slim(champion_call),
            "shadow": slim(shadow), "fallback": fallback, "client_ok": bool(served.get("ok")), "total_ms": total_ms,
        })
        self.seq += 1
