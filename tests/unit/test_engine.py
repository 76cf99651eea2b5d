"""The generation engine: KV-cached GPT decoding equals recompute, requests batch and leave, windows slide."""

from __future__ import annotations

import asyncio
import math
from contextlib import aclosing

import pytest
import torch

from deployments.codec import byte_label as token_text
from deployments.engine import Engine, Recompute
from deployments.generation import Completion, generate, merge_logprobs
from deployments.kv_cache import CachedGPT
from deployments.model_server import score_many
from training.bpb import text_bits
from training.model import GPT

SEQ = 32


def _gpt(seq_len: int = SEQ) -> GPT:
    torch.manual_seed(0)
    model = GPT(seq_len, n_layer=2, n_head=2, d_model=32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # sharper logits: greedy choices are not near-ties
    return model


def _greedy(max_tokens: int) -> Completion:
    return Completion(max_tokens, temperature=0.0, logprobs=0)


async def _collect(engine: Engine, prompt: bytes, max_tokens: int) -> tuple[dict, list[str], dict]:
    """(head, tokens, finish event) of one greedy completion."""
    async with aclosing(engine.stream(prompt, _greedy(max_tokens))) as events:
        out = [event async for event in events]
    tokens = merge_logprobs([e["logprobs"] for e in out if "text" in e])["tokens"]
    return out[0], tokens, out[-1]


def _recompute_tokens(model, prompt: bytes, max_tokens: int, seq_len: int = SEQ) -> list[str]:
    events = list(generate(model, prompt, seq_len, max_tokens, temperature=0.0, logprobs=0))
    return merge_logprobs([e["logprobs"] for e in events if "text" in e])["tokens"]


def test_cached_greedy_equals_recompute_greedy_within_the_window():
    model = _gpt()
    prompt = b"def main():"
    head, tokens, end = asyncio.run(_collect(Engine(CachedGPT(model, 2)), prompt, SEQ - len(prompt) + 1))
    assert tokens == _recompute_tokens(model, prompt, SEQ - len(prompt) + 1)
    assert end == {"finish_reason": "length", "tokens": SEQ - len(prompt) + 1}
    bits, n = text_bits(model, prompt, SEQ)  # the head's bits come from the prefill, same windows as bpb
    assert head["bytes"] == n == len(prompt) - 1 and math.isclose(head["bits"], bits, rel_tol=1e-5)
    assert head["prompt_ids"] == len(prompt)  # a byte model's ids are the prompt's bytes


@pytest.mark.parametrize("backend", ["cached", "recompute"])
def test_three_concurrent_requests_share_decode_steps_and_match_each_alone(backend):
    model = _gpt()
    make = (lambda: CachedGPT(model, 4)) if backend == "cached" else (lambda: Recompute(model, SEQ, 4))
    # the middle slot finishes first: then slots 0 and 2 decode together (gathered, not a contiguous view)
    jobs = [(b"import os", 12), (b"class Foo(object):", 5), (b"x", 20)]
    alone = [asyncio.run(_collect(Engine(make()), p, n))[1] for p, n in jobs]

    async def together():
        engine = Engine(make())
        got = await asyncio.gather(*(_collect(engine, p, n) for p, n in jobs))
        return engine.steps, [tokens for _, tokens, _ in got]

    steps, tokens = asyncio.run(together())
    assert tokens == alone and [len(t) for t in tokens] == [12, 5, 20]
    # decoded together: alone they would take 11 + 4 + 19 steps (each first token comes from its prefill); a
    # request admitted while others decode joins at the next step, so a few more than the longest one's 19
    assert 19 <= steps <= 25


def test_a_closed_stream_frees_its_slot_at_once_and_a_waiting_request_takes_it():
    model = _gpt()

    async def scenario():
        engine = Engine(CachedGPT(model, 1))
        first = engine.stream(b"hello", Completion(10_000, temperature=1.0, seed=0, logprobs=0))
        await first.__anext__()  # the head: the request holds the only slot
        await first.__anext__()  # decoding
        second = asyncio.ensure_future(_collect(engine, b"world", 3))
        await asyncio.sleep(0.05)
        assert not second.done() and len(engine.waiting) == 1  # no slot for it yet
        await first.aclose()
        assert engine.free == [0] and not engine.running  # freed by the close itself, before any step
        _, tokens, end = await asyncio.wait_for(second, 10)
        return tokens, end

    tokens, end = asyncio.run(scenario())
    assert len(tokens) == 3 and end["finish_reason"] == "length"


def test_decoding_past_seq_len_slides_to_the_last_half_window():
    seq_len = 16
    model = _gpt(seq_len)
    prompt, max_tokens = b"0123456789", 40
    _, tokens, end = asyncio.run(_collect(Engine(CachedGPT(model, 1)), prompt, max_tokens))
    assert end == {"finish_reason": "length", "tokens": max_tokens}
    # the documented rule, with plain forwards: a full window restarts from its last seq_len // 2 bytes
    window, expected = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(model(torch.tensor([window]))[0, -1].argmax())
            expected.append(token)
            window = (window + [token])[-(seq_len // 2) :] if len(window) == seq_len else window + [token]
    assert tokens == [token_text(t) for t in expected]
    # and it agrees with recompute while prompt + completion fit the window
    fit = seq_len - len(prompt) + 1
    assert tokens[:fit] == _recompute_tokens(model, prompt, max_tokens, seq_len)[:fit]

    async def beside_another():  # one slot slides while the other decodes in the same step
        engine = Engine(CachedGPT(model, 2))
        return await asyncio.gather(_collect(engine, prompt, max_tokens), _collect(engine, b"abc", 30))

    (_, together, _), (_, other, _) = asyncio.run(beside_another())
    assert together == tokens and other == asyncio.run(_collect(Engine(CachedGPT(model, 1)), b"abc", 30))[1]


def test_a_failing_step_fails_its_request_not_the_engine():
    class Broken(Recompute):
        def decode(self, slots, tokens):
            raise RuntimeError("device lost")

    model = _gpt()

    async def scenario():
        engine = Engine(Broken(model, SEQ, 2))
        with pytest.raises(RuntimeError, match="device lost"):
            await _collect(engine, b"abc", 5)
        assert engine.free and not engine.running
        return await _collect(engine, b"abc", 1)  # answered from the prefill alone

    _, tokens, end = asyncio.run(scenario())
    assert len(tokens) == 1 and end["tokens"] == 1


def test_batched_scoring_gives_each_text_its_own_bits():
    model = _gpt()
    texts = [b"short text", b"x" * (3 * SEQ + 5), b"another short", b"", bytes(range(200))]
    got = score_many(model, texts, SEQ, batch_size=4)
    for text, (bits, n) in zip(texts, got, strict=True):
        want_bits, want_n = text_bits(model, text, SEQ)
        assert n == want_n and math.isclose(bits, want_bits, rel_tol=1e-5, abs_tol=1e-6)


def _register(uri: str, exp: str, model: torch.nn.Module, name: str) -> str:
    import mlflow

    from deployments.registry import client_for, register_version
    from training.servable import log_servable_model

    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(experiment_id=exp) as run:
        model_uri = log_servable_model(model, SEQ)
    return register_version(client_for(uri), name, model_uri, run.info.run_id)


def test_a_gpt_logged_by_validation_serves_with_the_kv_cache_and_batched_scores(mlflow_store, monkeypatch):
    from ray.serve import batching

    from deployments.model_server import ModelServer

    # serve.batch reads the replica's max_ongoing_requests only to warn; there is no replica in a unit test
    monkeypatch.setattr(batching._BatchQueue, "_warn_if_max_batch_size_exceeds_max_ongoing_requests", lambda self: None)
    uri, exp = mlflow_store
    model = _gpt()
    server = ModelServer("gpt-kv", _register(uri, exp, model, "gpt-kv"), uri)
    assert server.kv_cache and isinstance(server.model, GPT)
    prompt = b"def main():"
    params = {"max_tokens": 8, "temperature": 0.0, "logprobs": 0}

    async def scenario():
        answer = await server.complete(prompt, params)
        texts = [b"short text", b"another one!", b"x" * 100]
        calls = []
        monkeypatch.setattr(server.engine, "run", _counting(server.engine.run, calls))
        scores = await asyncio.gather(*(server.score(t) for t in texts))
        return answer, scores, texts, len(calls)

    answer, scores, texts, forwards = asyncio.run(scenario())
    assert merge_logprobs(answer["pieces"])["tokens"] == _recompute_tokens(model, prompt, 8)
    assert answer["finish_reason"] == "length" and answer["tokens"] == 8 and answer["bytes"] == len(prompt) - 1
    assert forwards == 1  # three concurrent score calls, one batch
    for text, scored in zip(texts, scores, strict=True):
        bits, n = text_bits(model, text, SEQ)
        assert scored["bytes"] == n and math.isclose(scored["bits"], bits, rel_tol=1e-4)


def test_a_gpt_over_a_tokenizers_ids_serves_all_its_logits_also_past_its_window(mlflow_store):
    """A GPT of 300 token ids (train.vocab_size from a tokenizer): validation records the vocabulary and proves the
    cache at ids past the bytes; a full slot slides and still answers 300 logits, as a whole forward does."""
    import mlflow

    from deployments.model_server import check_backend, load_backend

    uri, exp = mlflow_store
    torch.manual_seed(0)
    model = GPT(SEQ, n_layer=2, n_head=2, d_model=32, vocab=300).eval()
    model_uri = f"models:/gpt-300/{_register(uri, exp, model, 'gpt-300')}"
    assert mlflow.models.get_model_info(model_uri).metadata["vocab_size"] == 300
    check_backend(model_uri, model, SEQ)
    backend = load_backend(model_uri, slots=2)
    ids = [int(i) for i in torch.randint(0, 300, (SEQ,))]
    assert isinstance(backend, CachedGPT) and backend.prefill(0, ids).shape == (SEQ, 300)
    backend.prefill(1, ids[:3])
    both = backend.decode([0, 1], [299, 298])  # slot 0 is full: it slides to the last half window
    assert both.shape == (2, 300)
    want = model(torch.tensor([[*ids[-(SEQ // 2 - 1) :], 299]]))[0, -1]  # the half window ends with the new id
    assert torch.allclose(both[0], want, atol=1e-4)
    assert torch.allclose(both[1], model(torch.tensor([[*ids[:3], 298]]))[0, -1], atol=1e-4)


def test_a_plugged_in_model_serves_its_exported_program_by_recompute(mlflow_store):
    from deployments.model_server import ModelServer

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(256, 256)

        def forward(self, x):
            return self.emb(x)

    uri, exp = mlflow_store
    torch.manual_seed(0)
    model = Bigram().eval()
    server = ModelServer("bigram", _register(uri, exp, model, "bigram"), uri, score_batch=1)
    assert not server.kv_cache
    answer = asyncio.run(server.complete(b"ab", {"max_tokens": 6, "temperature": 0.0, "logprobs": 0}))
    assert merge_logprobs(answer["pieces"])["tokens"] == _recompute_tokens(model, b"ab", 6)


def _counting(run, calls):
    async def counted(fn, *args):
        calls.append(fn)
        return await run(fn, *args)

    return counted
