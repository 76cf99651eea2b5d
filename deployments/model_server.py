"""One served model version as a Ray Serve deployment: scores texts and generates completions.

A plain class (serve_build.build_app wraps it with `serve.deployment`), loaded from the MLflow registry. `score` is
bits per byte of a text, concurrent calls batched into one forward (`serve.batch`); `complete_stream` yields one
completion's events after a first event with the prompt's own bits, which the canary uses as evidence; `complete`
gathers them into one answer. Completions run on deployments.engine (continuous batching): the built-in GPT and a
transformers model with a KV cache (validation logs the GPT's eager weights beside its program, a transformers model
as MLflow's transformers flavor), any other model by recomputing its window (load_backend).
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

from deployments.codec import BYTES, ByteCodec, TokenCodec, codec_for

SCORE_BATCH = 16  # texts scored in one batched forward at most
SCORE_WAIT_S = 0.002  # how long the first text of a batch waits for others
SLOTS = 8  # completions decoded together (serve_build.build_app admits 8 requests at a time per replica)


def _finite(scored: tuple[float, int], version: str) -> tuple[float, int]:
    """A score, or ValueError when the model produced non-finite logits (a broken model is an erroring one)."""
    if not math.isfinite(scored[0]):
        raise ValueError(f"model version {version} produced non-finite logits")
    return scored


def load_backend(model_uri: str, slots: int = SLOTS) -> Any:
    """The engine backend of a logged model: a KV-cached GPT when its metadata names its eager weights, a KV-cached
    transformers model from its flavor's safetensors (or, logged before the flavor, its state dict), else the served
    model (the pt2 program, or a model export could not capture, rebuilt by its factory), recomputed."""
    import mlflow

    from deployments.engine import Recompute
    from deployments.registry import seq_len_of
    from training.hf_model import EAGER_HF
    from training.model import EAGER_METADATA
    from training.servable import load_served_model, model_file

    seq_len = seq_len_of(model_uri)
    metadata = mlflow.models.get_model_info(model_uri).metadata or {}
    eager = metadata.get(EAGER_METADATA)
    if metadata.get(EAGER_HF):  # a transformers model: its own KV cache
        from deployments.kv_cache_hf import CachedCausalLM
        from training.hf_model import load_causal_lm

        spec = metadata[EAGER_HF]
        if "weights_dir" in spec:  # the transformers flavor's save_pretrained files
            return CachedCausalLM(load_served_model(model_uri), slots)
        weights = model_file(model_uri, spec["weights"])  # a version logged with a pt2 program and a state dict
        return CachedCausalLM(load_causal_lm(spec["config"], seq_len, weights, spec.get("vocab", 256)), slots)
    if not eager:
        return Recompute(load_served_model(model_uri), seq_len, slots)
    from deployments.kv_cache import CachedGPT
    from training.model import load_gpt

    model = load_gpt(eager["config"], model_file(model_uri, eager["weights"]))
    if model.seq_len != seq_len:
        raise ValueError(f"{model_uri}: eager GPT seq_len {model.seq_len} != logged seq_len {seq_len}")
    return CachedGPT(model, slots)


def check_backend(model_uri: str, model: Any, seq_len: int, steps: int = 6) -> None:
    """Before any traffic: the backend a replica builds for `model_uri` gives `model`'s logits. A KV-cached backend
    (the GPT's, a transformers model's) prefills a prompt and decodes `steps` tokens, each compared with a whole
    forward over the same context; a recomputing backend runs the program validation already proved.

    Raises:
        NotServable: the cached decoding differs from the model (naming the step), or the backend does not build.
    """
    import torch

    from deployments.kv_cache import CachedGPT
    from infra.redact import first_line
    from training.evaluate import NotServable
    from training.servable import vocab_of

    try:
        backend = load_backend(model_uri, slots=1)
    except Exception as e:  # noqa: BLE001 - a backend that does not build cannot serve
        raise NotServable(f"the serving backend does not build: {first_line(e)}") from None
    if not (isinstance(backend, CachedGPT) or getattr(backend, "kv_cache", False)):
        return
    n = max(1, min(seq_len - steps, seq_len // 2))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_of(model, seq_len), (n + steps,), generator=gen).tolist()
    with torch.no_grad():
        got = [backend.prefill(0, tokens[:n])[-1]]
        got += [backend.decode([0], [t])[0] for t in tokens[n : n + steps - 1]]
        for i, logits in enumerate(got):
            want = model(torch.tensor([tokens[: n + i]]))[0, -1].float()
            if not torch.allclose(logits, want, atol=1e-3, rtol=1e-3):
                raise NotServable(
                    f"{type(backend).__name__}: KV-cached decoding differs from the model's forward at step {i} "
                    f"(context {n + i} tokens)"
                )


def score_many(
    model: Callable[[Any], Any],
    texts: list[bytes],
    seq_len: int,
    batch_size: int = SCORE_BATCH,
    codec: ByteCodec | TokenCodec = BYTES,
) -> list[tuple[float, int]]:
    """(bits, predicted bytes) of each text over training.bpb's windows of its ids (bytes, or the codec's
    tokenizer ids, whose predicted bytes are those every id but the first covers); windows of equal length, from
    any of the texts, run as one batch (per-row sums, so each text gets its own bits)."""
    import torch
    import torch.nn.functional as F

    from training.bpb import LN2, token_windows

    groups: dict[int, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    counts = []
    for i, text in enumerate(texts):
        ids, predicted = codec.scored(text)
        counts.append(predicted)
        for window in token_windows(ids, seq_len):
            groups[len(window)].append((i, window))
    bits = [0.0] * len(texts)
    with torch.no_grad():
        for items in groups.values():
            for start in range(0, len(items), batch_size):
                chunk = items[start : start + batch_size]
                seqs = torch.stack([w for _, w in chunk])
                logits = model(seqs[:, :-1]).float()
                nats = F.cross_entropy(logits.transpose(1, 2), seqs[:, 1:], reduction="none").sum(1)
                for (i, _), n in zip(chunk, nats.tolist(), strict=True):
                    bits[i] += n / LN2
    return list(zip(bits, counts, strict=True))


class ModelServer:
    """One registered model version: `score(text)`, `complete(prompt, params)` and `complete_stream`."""

    def __init__(
        self,
        model_name: str,
        version: str,
        tracking_uri: str,
        threads: int = 1,
        slots: int = SLOTS,
        score_batch: int = SCORE_BATCH,
    ):
        from infra.credentials import adopt_worker_secrets
        from infra.paths import quiet_telemetry

        quiet_telemetry()
        adopt_worker_secrets(required=False)  # MLflow credentials from this application's 0600 file, if any
        import mlflow
        import torch

        from deployments.engine import Engine
        from deployments.kv_cache import CachedGPT

        torch.set_num_threads(threads)
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_registry_uri(tracking_uri)
        self.version = version
        from training.servable import served_chat_format, served_tokenizer

        uri = f"models:/{model_name}/{version}"
        self.backend = load_backend(uri, slots)
        self.codec = codec_for(served_tokenizer(uri))  # text <-> ids: bytes, or the version's own tokenizer
        self.chat = served_chat_format(uri)  # its tokenizer's chat template and special tokens (false: none)
        self.model, self.seq_len = self.backend.model, self.backend.seq_len
        # False: a program or eager model, recomputed each step
        self.kv_cache = isinstance(self.backend, CachedGPT) or getattr(self.backend, "kv_cache", False)
        self.engine = Engine(self.backend, self.codec)
        self.score_batch = score_batch
        if score_batch > 1:
            from ray import serve

            self._score = serve.batch(max_batch_size=score_batch, batch_wait_timeout_s=SCORE_WAIT_S)(self._score_texts)
        else:
            self._score = self._score_one
        # the first calls are slow: not on a request
        warm = b"def warm(up):\n    return up\n" * max(1, self.seq_len // 8)  # UTF-8: any codec reads it
        score_many(self.model, [warm], self.seq_len, codec=self.codec)
        self.backend.prefill(0, self.codec.encode(b"warm up"))
        self.backend.decode([0], self.codec.encode(b" ")[:1])

    def describe(self) -> dict[str, Any]:
        """The replica's version and process id (tests check that a weight change restarts no replica)."""
        return {"version": self.version, "pid": os.getpid()}

    def chat_template(self) -> dict[str, str]:
        """The chat format this version's tokenizer carries: {"template" ('' for none), and the special tokens it
        sees, "bos_token" and "eos_token" where named}. The router renders chat requests to this version with it;
        serve.chat_template, when set, overrides the template and keeps these tokens."""
        return {"template": self.chat.template, **self.chat.tokens()}

    def check_health(self) -> None:
        """Serve's health check: a replica whose model cannot run one token is restarted."""
        import torch

        with torch.no_grad():
            self.model(torch.zeros(1, 1, dtype=torch.long))

    async def _score_texts(self, texts: list[bytes]) -> list[tuple[float, int]]:
        return await self.engine.run(score_many, self.model, texts, self.seq_len, self.score_batch, self.codec)

    async def _score_one(self, text: bytes) -> tuple[float, int]:
        return (await self._score_texts([text]))[0]

    async def score(self, text: bytes) -> dict[str, Any]:
        t0 = time.perf_counter()
        bits, n = _finite(await self._score(text), self.version)
        return {
            "version": self.version,
            "bits": bits,
            "bytes": n,
            "bpb": bits / n if n else None,
            "latency_ms": (time.perf_counter() - t0) * 1000.0,
        }

    async def complete_stream(self, prompt: bytes, params: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """Events of one completion: {"version", "bits", "bytes", "bpb", "prompt_ids", "prompt_logprobs"} first (the
        prompt scored with its own bytes as labels; prompt_ids counts its ids), then generation's pieces {"text",
        "logprobs"}, then {"finish_reason", "tokens", "latency_ms"}. Closing the stream (a client went away) frees
        its slot at once.

        params: max_tokens, temperature, top_p, top_k, seed, stop, logprobs, echo (OpenAI's meanings).
        """
        from deployments.generation import Completion, prompt_logprobs

        t0 = time.perf_counter()
        k = params.get("logprobs")
        completion = Completion(
            int(params.get("max_tokens", 16)),
            float(params.get("temperature", 1.0)),
            int(params.get("top_k", 0)),
            float(params.get("top_p", 1.0)),
            params.get("seed"),
            params.get("stop") or [],
            k,
            self.codec,
        )
        async with aclosing(self.engine.stream(prompt, completion)) as events:
            async for event in events:
                if "bits" in event:
                    bits, n = _finite((event["bits"], event["bytes"]), self.version)
                    head: dict[str, Any] = {
                        "version": self.version,
                        "bits": bits,
                        "bytes": n,
                        "bpb": bits / n if n else None,
                        "prompt_ids": int(event["prompt_ids"]),  # the prompt's length in the model's ids
                    }
                    if params.get("echo") and k is not None:
                        head["prompt_logprobs"] = await self.engine.run(
                            prompt_logprobs, self.model, prompt, self.seq_len, k, self.codec
                        )
                        if not isinstance(self.codec, ByteCodec):  # the router labels bytes itself
                            head["prompt_tokens"], head["prompt_offsets"] = self.codec.spans(prompt)
                    yield head
                    continue
                if "finish_reason" in event:
                    event = {**event, "latency_ms": (time.perf_counter() - t0) * 1000.0}
                yield event

    async def complete(self, prompt: bytes, params: dict[str, Any]) -> dict[str, Any]:
        """The whole completion in one answer: the first event's fields, "text", "pieces" (their logprobs),
        "finish_reason", "tokens" and "latency_ms"."""
        out: dict[str, Any] = {}
        texts, pieces = [], []
        async with aclosing(self.complete_stream(prompt, params)) as events:
            async for event in events:
                if "text" in event:
                    texts.append(event["text"])
                    pieces.append(event["logprobs"])
                else:
                    out |= event
        return out | {"text": "".join(texts), "pieces": pieces}
