"""Prometheus metrics of a model's router, per model and version, through prometheus_client.

Every series carries the `model` label: the gateway merges the routers' expositions into one /metrics.
"""

from __future__ import annotations

from typing import Any

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RouterMetrics:
    """One registry per router replica (merged into the gateway's GET /metrics)."""

    def __init__(self, model: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.model = model
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "shardline_requests",
            "HTTP requests answered, by the version that served them.",
            ["model", "version", "endpoint", "source", "outcome"],
            registry=self.registry,
        )
        self.rejects = Counter(
            "shardline_rejected_requests",
            "Requests refused before reaching a model.",
            ["model", "endpoint", "status"],
            registry=self.registry,
        )
        self.calls = Counter(
            "shardline_model_calls",
            "Model calls, served or shadow, by outcome.",
            ["model", "version", "kind", "op", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "shardline_model_latency_seconds",
            "Model time inside the replica per call (x-shardline-variant calls excepted).",
            ["model", "version", "op"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.bits = Counter(
            "shardline_bits",
            "Bits the model needed for the bytes it scored.",
            ["model", "version"],
            registry=self.registry,
        )
        self.bytes = Counter(
            "shardline_scored_bytes",
            "Bytes scored (predicted), per version.",
            ["model", "version"],
            registry=self.registry,
        )
        self.percent = Gauge(
            "shardline_challenger_percent",
            "Percent of requests routed to the challenger.",
            ["model"],
            registry=self.registry,
        )

    def set_percent(self, percent: int) -> None:
        self.percent.labels(self.model).set(percent)

    def rejected(self, endpoint: str, status: int) -> None:
        self.rejects.labels(self.model, endpoint, str(status)).inc()

    def request(self, version: str, endpoint: str, source: str, ok: bool) -> None:
        """source: live, probe (the canary's own traffic) or variant (a tester's x-shardline-variant request).

        Both outcome series exist from a label set's first request (the other at 0): prometheus_client makes a
        series on its first increment, and an error-rate query over a version with no error yet would otherwise
        read no data, which a canary gate takes for too little evidence.
        """
        outcome = "ok" if ok else "error"
        for each in ("ok", "error"):
            series = self.requests.labels(self.model, version, endpoint, source, each)
            if each == outcome:
                series.inc()

    def model_call(self, version: str, kind: str, op: str, out: dict[str, Any]) -> None:
        """kind: served, shadow (the champion's paired score), mirror (shadow mode's copy) or variant (a tester's or
        the canary warm-up's x-shardline-variant call: counted here, kept out of the latency and bits a
        dashboard or a PromQL gate reads as the version's)."""
        outcome = "ok" if out.get("ok") else "error"
        for each in ("ok", "error"):  # both series from the first call, as in request()
            series = self.calls.labels(self.model, version, kind, op, each)
            if each == outcome:
                series.inc()
        if out.get("ok") and kind != "variant":
            self.latency.labels(self.model, version, op).observe(out["latency_ms"] / 1000.0)
            self.bits.labels(self.model, version).inc(out["bits"])
            self.bytes.labels(self.model, version).inc(out["bytes"])

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
