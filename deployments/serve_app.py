"""The Ray Serve app of a canary: two model versions behind one weighted HTTP router that shadow-scores.

Each request body is held-out text (bytes); the answer is the text's bits per byte under the model that
served it, with that model's latency and version. Requests routed to the challenger are also scored by the
champion ("shadow"), so the canary compares the two on the same text; the client is served the challenger's.
The classes are plain; `build_app` wraps them with `serve.deployment` so importing this module needs no Ray.
"""
from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

APP_NAME = "shardline-canary"
ROUTE_PREFIX = "/canary"
REPLICA_CPUS = 0.2  # three replicas must fit next to Ray Train's leftovers on a 2-core machine


def score_bits(model: Any, text: bytes, seq_len: int) -> tuple[float, int]:
    """Total bits the model needs to predict each byte of `text` from its prefix, and how many it predicted.

    The text is cut into windows of `seq_len` inputs (each byte predicted once). Every forward pass has
    exactly `seq_len` positions, as a static-shape exported model needs: the tail reuses the last full window
    and counts only its new positions; a text shorter than a window is right-padded, which a causal model's
    earlier positions do not see.
    """
    import torch

    data = torch.tensor(list(text), dtype=torch.long)
    n_pred = len(text) - 1
    if n_pred < 1:
        return 0.0, 0
    xs, ys, counted = [], [], []
    if n_pred <= seq_len:
        x = torch.zeros(seq_len, dtype=torch.long)
        x[:n_pred] = data[:-1]
        y = torch.zeros(seq_len, dtype=torch.long)
        y[:n_pred] = data[1:]
        xs, ys, counted = [x], [y], [(0, n_pred)]
    else:
        start = 0
        while start + seq_len <= n_pred:
            xs.append(data[start:start + seq_len])
            ys.append(data[start + 1:start + seq_len + 1])
            counted.append((0, seq_len))
            start += seq_len
        if start < n_pred:  # tail: last full window, count only the positions not scored yet
            xs.append(data[n_pred - seq_len:n_pred])
            ys.append(data[n_pred - seq_len + 1:])
            counted.append((seq_len - (n_pred - start), seq_len))
    x, y = torch.stack(xs), torch.stack(ys)
    with torch.no_grad():
        logits = _forward(model, x)
        nll = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none"
        ).reshape(y.shape)
    mask = torch.zeros_like(nll, dtype=torch.bool)
    for row, (lo, hi) in enumerate(counted):
        mask[row, lo:hi] = True
    bits = float(nll[mask].sum()) / math.log(2)
    return bits, int(mask.sum())


def _forward(model: Any, x: Any) -> Any:
    """Logits [B, T, 256]; one row at a time when the model was exported with a static batch size."""
    import torch

    try:
        return model(x)
    except (RuntimeError, AssertionError, ValueError):
        if x.shape[0] == 1:
            raise
        return torch.cat([model(x[i:i + 1]) for i in range(x.shape[0])], dim=0)


class ModelServer:
    """One registered model version; `score(text)` -> bits per byte, latency and version."""

    def __init__(self, model_name: str, version: str, tracking_uri: str, threads: int = 1):
        from infra.paths import quiet_telemetry

        quiet_telemetry()
        import mlflow
        import torch

        torch.set_num_threads(threads)
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_registry_uri(tracking_uri)
        uri = f"models:/{model_name}/{version}"
        from deployments.registry import seq_len_of

        self.version = version
        self.seq_len = seq_len_of(uri)
        self.model = mlflow.pytorch.load_model(uri, map_location="cpu")
        try:
            self.model.eval()
        except (NotImplementedError, RuntimeError, AttributeError):
            pass  # torch.export modules refuse .eval(); their graph is already in inference form
        score_bits(self.model, bytes(range(self.seq_len + 2)), self.seq_len)  # first call is slow: not on a request

    def score(self, text: bytes) -> dict[str, Any]:
        t0 = time.perf_counter()
        bits, n = score_bits(self.model, text, self.seq_len)
        return {
            "version": self.version,
            "bits": bits,
            "bytes": n,
            "bpb": bits / n if n else None,
            "latency_ms": (time.perf_counter() - t0) * 1000.0,
        }


class Router:
    """HTTP ingress: routes each request to the challenger with probability percent/100 (seeded per step).

    POST <prefix> with text -> {"served": score, "shadow": champion's score or None, "percent": weight};
    GET <prefix>/metrics -> Prometheus text exposition of what the router has seen.
    """

    def __init__(self, champion: Any, challenger: Any, champion_version: str, challenger_version: str,
                 seed: int = 0, max_request_bytes: int = 2048):
        self.handles = {"champion": champion, "challenger": challenger}
        self.versions = {"champion": champion_version, "challenger": challenger_version}
        self.seed = seed
        self.max_request_bytes = max_request_bytes
        self.percent = 0
        self.rng = random.Random(f"{seed}:0")
        self.requests: Counter[str] = Counter()  # role -> requests routed to it
        self.calls: Counter[tuple[str, str, str]] = Counter()  # (version, served|shadow, ok|error) -> calls
        self.latency: dict[str, list[float]] = {}  # version -> [sum of model seconds, calls]
        self.scored: dict[str, list[float]] = {}  # version -> [bits, bytes]

    def set_challenger_percent(self, percent: int) -> int:
        """Send `percent` of the following requests to the challenger; routing restarts from the seed."""
        if not 0 <= int(percent) <= 100:
            raise ValueError(f"challenger percent must be in [0, 100], got {percent}")
        self.percent = int(percent)
        self.rng = random.Random(f"{self.seed}:{self.percent}")
        return self.percent

    def get_challenger_percent(self) -> int:
        return self.percent

    def get_counts(self) -> dict[str, int]:
        """Requests routed per role, shadow calls, and failed model calls."""
        return {**{r: self.requests[r] for r in ("champion", "challenger")},
                "shadow": sum(n for (_, kind, _), n in self.calls.items() if kind == "shadow"),
                "errors": sum(n for (_, _, outcome), n in self.calls.items() if outcome == "error")}

    def metrics_text(self) -> str:
        return prometheus_text(self.percent, self.versions, self.requests, self.calls, self.latency, self.scored)

    async def _score(self, role: str, text: bytes, kind: str) -> dict[str, Any]:
        version = self.versions[role]
        try:
            out = {**await self.handles[role].score.remote(text), "role": role, "ok": True}
        except Exception as e:  # noqa: BLE001 - a replica failure is an observation, not a router failure
            self.calls[(version, kind, "error")] += 1
            return {"version": version, "role": role, "ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        self.calls[(version, kind, "ok")] += 1
        lat = self.latency.setdefault(version, [0.0, 0])
        lat[0] += out["latency_ms"] / 1000.0
        lat[1] += 1
        sc = self.scored.setdefault(version, [0.0, 0])
        sc[0] += out["bits"]
        sc[1] += out["bytes"]
        return out

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, PlainTextResponse

        if request.method == "GET" and request.url.path.rstrip("/").endswith("/metrics"):
            return PlainTextResponse(self.metrics_text(), media_type="text/plain; version=0.0.4")
        body = (await request.body())[: self.max_request_bytes]
        if len(body) < 2:
            return JSONResponse({"error": "request body must hold at least 2 bytes of text"}, status_code=400)
        role = "challenger" if self.rng.random() * 100 < self.percent else "champion"
        self.requests[role] += 1
        if role == "challenger":
            # one after the other, not concurrently: on a small machine two models scoring at once slow each
            # other down, and the latency gate would compare contention instead of the models; and in
            # alternating order, so that neither always pays for a cold cache after an idle gap
            if self.requests["challenger"] % 2:
                served = await self._score("challenger", body, "served")
                shadow = await self._score("champion", body, "shadow")
            else:
                shadow = await self._score("champion", body, "shadow")
                served = await self._score("challenger", body, "served")
        else:
            served, shadow = await self._score("champion", body, "served"), None
        payload = {"served": served, "shadow": shadow, "percent": self.percent}
        return JSONResponse(payload, status_code=200 if served["ok"] else 500)


def prometheus_text(percent: int, versions: dict[str, str], requests: Counter[str],
                    calls: Counter[tuple[str, str, str]], latency: dict[str, list[float]],
                    scored: dict[str, list[float]]) -> str:
    """The router's counters in the Prometheus text exposition format (version 0.0.4)."""
    lines = [
        "# HELP shardline_canary_challenger_percent Percent of requests routed to the challenger.",
        "# TYPE shardline_canary_challenger_percent gauge",
        f"shardline_canary_challenger_percent {percent}",
        "# HELP shardline_canary_requests_total HTTP requests routed, by role and model version.",
        "# TYPE shardline_canary_requests_total counter",
    ]
    lines += [f'shardline_canary_requests_total{{role="{r}",version="{versions[r]}"}} {requests[r]}'
              for r in ("champion", "challenger")]
    lines += ["# HELP shardline_canary_model_calls_total Model calls, served or shadow, by outcome.",
              "# TYPE shardline_canary_model_calls_total counter"]
    lines += [f'shardline_canary_model_calls_total{{version="{v}",kind="{k}",outcome="{o}"}} {n}'
              for (v, k, o), n in sorted(calls.items())]
    lines += ["# HELP shardline_canary_model_latency_seconds Model time inside the replica per call.",
              "# TYPE shardline_canary_model_latency_seconds summary"]
    for v, (total, n) in sorted(latency.items()):
        lines += [f'shardline_canary_model_latency_seconds_sum{{version="{v}"}} {total:.6f}',
                  f'shardline_canary_model_latency_seconds_count{{version="{v}"}} {int(n)}']
    lines += ["# HELP shardline_canary_bits_total Bits the model needed for the bytes it scored (bpb = bits/bytes).",
              "# TYPE shardline_canary_bits_total counter"]
    lines += [f'shardline_canary_bits_total{{version="{v}"}} {b:.3f}' for v, (b, _) in sorted(scored.items())]
    lines += ["# HELP shardline_canary_bytes_total Bytes scored (predicted) per model version.",
              "# TYPE shardline_canary_bytes_total counter"]
    lines += [f'shardline_canary_bytes_total{{version="{v}"}} {int(n)}' for v, (_, n) in sorted(scored.items())]
    return "\n".join(lines) + "\n"


@dataclass
class CanaryApp:
    """A running canary app: its URL and its router's weight."""

    url: str
    router: Any  # DeploymentHandle of the Router

    def set_challenger_percent(self, percent: int) -> int:
        return int(self.router.set_challenger_percent.remote(percent).result())

    def challenger_percent(self) -> int:
        return int(self.router.get_challenger_percent.remote().result())

    def counts(self) -> dict[str, int]:
        return dict(self.router.get_counts.remote().result())

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"


def build_app(model_name: str, champion_version: str, challenger_version: str, tracking_uri: str,
              seed: int = 0, max_request_bytes: int = 2048, replica_cpus: float = REPLICA_CPUS) -> Any:
    """The Serve application: two ModelServer deployments bound to versions, behind one Router."""
    from ray import serve

    server = serve.deployment(ModelServer, ray_actor_options={"num_cpus": replica_cpus})
    champion = server.options(name="champion").bind(model_name, champion_version, tracking_uri)
    challenger = server.options(name="challenger").bind(model_name, challenger_version, tracking_uri)
    # one router replica: the weight and the seeded routing are its state
    router = serve.deployment(Router, name="router", num_replicas=1, ray_actor_options={"num_cpus": replica_cpus})
    return router.bind(champion, challenger, champion_version, challenger_version, seed, max_request_bytes)


def start_canary_app(model_name: str, champion_version: str, challenger_version: str, tracking_uri: str,
                     host: str = "127.0.0.1", port: int = 0, seed: int = 0, max_request_bytes: int = 2048,
                     replica_cpus: float = REPLICA_CPUS) -> CanaryApp:
    """Start Serve's HTTP proxy on host:port (a free port when 0) and deploy the app; Ray must be initialised."""
    from ray import serve

    quiet = {"log_level": "WARNING", "enable_access_log": False}  # one line per request would flood the flow log
    from infra.cluster import free_port

    port = port or free_port(host)
    serve.start(http_options={"host": host, "port": port}, logging_config=quiet)
    host, port = _serving_address(host, port)
    app = build_app(model_name, champion_version, challenger_version, tracking_uri, seed, max_request_bytes,
                    replica_cpus)
    handle = serve.run(app, name=APP_NAME, route_prefix=ROUTE_PREFIX, blocking=False, logging_config=quiet)
    return CanaryApp(url=f"http://{host}:{port}{ROUTE_PREFIX}", router=handle)


def _serving_address(host: str, port: int) -> tuple[str, int]:
    # Serve keeps the HTTP options of a proxy already running in this cluster; ask where it really listens.
    try:
        from ray.serve.context import _get_global_client

        cfg = _get_global_client().http_config
        return cfg.host, int(cfg.port)
    except Exception:  # noqa: BLE001 - private API; the requested address is the best guess
        return host, port


def stop_canary_app(shutdown: bool = True) -> None:
    """Delete the canary app; with `shutdown`, stop Serve's controller and proxies too (not Ray itself).

    Never raises: it runs after the decision, and the flow tears the cluster down anyway.
    """
    from ray import serve

    for action in (lambda: serve.delete(APP_NAME), serve.shutdown if shutdown else None):
        if action is None:
            continue
        try:
            action()
        except Exception as e:  # noqa: BLE001
            logging.getLogger(__name__).warning("stopping the canary app: %s: %s", type(e).__name__, e)
