"""One served model version as a Ray Serve deployment: scores texts and generates completions.

A plain class (endpoint.build_app wraps it with `serve.deployment`), loaded from the MLflow registry. `score` is
bits per byte of a text; `complete_stream` yields one completion's events (generation.generate) after a first
event with the prompt's own bits, which the canary uses as evidence; `complete` gathers them into one answer.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from typing import Any


def _finite(scored: tuple[float, int], version: str) -> tuple[float, int]:
    """A score, or ValueError when the model produced non-finite logits (a broken model is an erroring one)."""
    if not math.isfinite(scored[0]):
        raise ValueError(f"model version {version} produced non-finite logits")
    return scored


class ModelServer:
    """One registered model version: `score(text)`, `complete(prompt, params)` and `complete_stream`."""

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
        self.complete(b"warm", {"max_tokens": 2, "temperature": 0.0})

    def describe(self) -> dict[str, Any]:
        """The replica's version and process id (tests check that a weight change restarts no replica)."""
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

    def complete_stream(self, prompt: bytes, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Events of one completion: {"version", "bits", "bytes", "bpb", "prompt_logprobs"} first (the prompt
        scored with its own bytes as labels), then generation.generate's pieces, then {"finish_reason", "tokens",
        "latency_ms"}.

        params: max_tokens, temperature, top_p, top_k, seed, stop, logprobs, echo (OpenAI's meanings).
        """
        from deployments.generation import generate, prompt_logprobs
        from training.bpb import text_bits

        t0 = time.perf_counter()
        bits, n = _finite(text_bits(self.model, prompt, self.seq_len), self.version)
        k = params.get("logprobs")
        head: dict[str, Any] = {"version": self.version, "bits": bits, "bytes": n, "bpb": bits / n if n else None}
        if params.get("echo") and k is not None:
            head["prompt_logprobs"] = prompt_logprobs(self.model, prompt, self.seq_len, k)
        yield head
        for event in generate(self.model, prompt, self.seq_len, int(params.get("max_tokens", 16)),
                              float(params.get("temperature", 1.0)), int(params.get("top_k", 0)),
                              float(params.get("top_p", 1.0)), params.get("seed"), params.get("stop") or [], k):
            if "finish_reason" in event:
                event["latency_ms"] = (time.perf_counter() - t0) * 1000.0
            yield event

    def complete(self, prompt: bytes, params: dict[str, Any]) -> dict[str, Any]:
        """The whole completion in one answer: the first event's fields, "text", "pieces" (their logprobs),
        "finish_reason", "tokens" and "latency_ms"."""
        out: dict[str, Any] = {}
        texts, pieces = [], []
        for event in self.complete_stream(prompt, params):
            if "text" in event:
                texts.append(event["text"])
                pieces.append(event["logprobs"])
            else:
                out |= event
        return out | {"text": "".join(texts), "pieces": pieces}
