"""Generation for byte-level models: sampling rules, stop strings held back and cut, logprobs, determinism."""

from __future__ import annotations

import math

import torch

from deployments.codec import byte_label as token_text
from deployments.generation import Completion, generate, merge_logprobs, pick, prompt_logprobs
from deployments.http_io import peek
from deployments.router_metrics_share import merge_expositions
from deployments.serve_metrics import RouterMetrics

TEXT = b"abcabcabd"  # after 'c' always 'a'; after 'b', 'c' three times in four


def _bigram(text: bytes, smoothing: float = 0.01):
    counts = torch.full((256, 256), smoothing)
    for a, b in zip(text, text[1:], strict=False):
        counts[a, b] += 1
    table = torch.log(counts / counts.sum(1, keepdim=True))
    return lambda idx: table[idx]  # [B, T] -> [B, T, 256] logits, like the served programs


def _run(model, prompt: bytes, **kw) -> tuple[str, dict]:
    events = list(generate(model, prompt, 8, **kw))
    return "".join(e["text"] for e in events if "text" in e), events[-1]


def test_greedy_follows_the_likeliest_byte_and_stops_at_max_tokens():
    text, end = _run(_bigram(TEXT), b"a", max_tokens=5, temperature=0)
    assert text == "bcabc" and end == {"finish_reason": "length", "tokens": 5}


def test_a_stop_string_ends_generation_and_is_not_returned():
    model = _bigram(TEXT)
    text, end = _run(model, b"a", max_tokens=20, temperature=0, stop=["ca"])
    assert text == "b" and end["finish_reason"] == "stop" and end["tokens"] == 3
    # held-back text that turned out not to be a stop string is still returned
    pieces = [e["text"] for e in generate(model, b"a", 8, 4, temperature=0, stop=["cX"]) if "text" in e]
    assert "".join(pieces) == "bcab" and "c" not in pieces[:1]


def test_top_k_one_and_tiny_top_p_are_greedy_at_any_temperature():
    model = _bigram(TEXT)
    greedy, _ = _run(model, b"a", max_tokens=12, temperature=0)
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"top_p": 0.0}):
        for seed in range(3):
            assert _run(model, b"a", max_tokens=12, temperature=1.5, seed=seed, **kw)[0] == greedy


def test_a_seed_makes_sampling_repeatable():
    model = _bigram(TEXT, smoothing=0.5)
    runs = {_run(model, b"a", max_tokens=30, temperature=1.0, seed=7)[0] for _ in range(3)}
    assert len(runs) == 1
    assert _run(model, b"a", max_tokens=30, temperature=1.0, seed=8)[0] != runs.pop()


def test_pick_never_samples_outside_top_k():
    logits = torch.tensor([5.0, 4.0, 3.0, -1.0])
    gen = torch.Generator().manual_seed(0)
    assert {pick(logits, 2.0, 2, 1.0, gen) for _ in range(200)} == {0, 1}


def test_logprobs_are_the_models_and_offsets_count_characters():
    model = _bigram(TEXT)
    events = list(generate(model, b"a", 8, 3, temperature=0, logprobs=2))
    lp = merge_logprobs([e["logprobs"] for e in events if "text" in e])
    assert lp["tokens"] == ["b", "c", "a"] and lp["text_offset"] == [0, 1, 2]
    expected = float(torch.log_softmax(model(torch.tensor([[ord("a")]]))[0, -1], -1)[ord("b")])
    assert math.isclose(lp["token_logprobs"][0], expected, rel_tol=1e-6)
    assert list(lp["top_logprobs"][1]) == ["c", "d"]  # after 'b': 'c' (3 of 4), then 'd'
    scored = prompt_logprobs(model, b"abc", 8, 1)
    assert scored[0] == (None, None) and len(scored) == 3 and list(scored[2][1]) == ["c"]
    assert token_text(0xE9) == "bytes:\\xe9" and token_text(ord("x")) == "x"


def test_the_sampled_or_prompt_token_is_always_in_its_top_logprobs_as_openai_returns_it():
    """OpenAI: "the logprob of the sampled token is always returned, so there may be up to logprobs+1 elements";
    logprobs 0 returns that one alone. A sampled token outside the top k was missing from its own entry."""
    model = _bigram(b"ab" * 20 + b"ac", smoothing=0.5)  # after 'a', 'b' is likeliest by far
    for logprobs in (0, 1):
        events = list(generate(model, b"a", 8, 40, temperature=2.0, seed=3, logprobs=logprobs))
        lp = merge_logprobs([e["logprobs"] for e in events if "text" in e])
        for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
            assert top[token] == logprob and len(top) <= logprobs + 1
        outside = [(t, top) for t, top in zip(lp["tokens"], lp["top_logprobs"], strict=True) if len(top) > logprobs]
        assert outside  # at temperature 2 some sampled byte was outside the top k: it comes after them
        assert all(list(top)[-1] == token for token, top in outside)
    scored = prompt_logprobs(model, b"acb", 8, 1)  # the prompt's 'c' and 'b' are not the likeliest after 'a', 'c'
    assert [list(top) for _, top in scored[1:]] == [["b", "c"], [max(scored[2][1], key=scored[2][1].get), "b"]]
    assert [lp for lp, _ in scored[1:]] == [scored[1][1]["c"], scored[2][1]["b"]]


def test_a_cancelled_generation_stops_before_the_next_step():
    calls = []
    model = _bigram(TEXT)
    events = list(generate(model, b"a", 8, 50, temperature=0, should_stop=lambda: len(calls) >= 3 or calls.append(1)))
    assert events[-1] == {"finish_reason": "cancelled", "tokens": 3}


def test_a_completion_driven_step_by_step_is_generate_and_a_cancel_keeps_held_back_text():
    """The engine drives Completion with logits it computed itself: the same events as generate's loop."""
    model = _bigram(TEXT)
    completion, context, events = Completion(4, temperature=0, stop=["cX"]), list(b"a"), []
    while not completion.done:
        token, out = completion.step(model(torch.tensor([context]))[0, -1])
        events += out
        context.append(token)
    assert events + completion.close() == list(generate(model, b"a", 8, 4, temperature=0, stop=["cX"]))
    held = Completion(10, temperature=0, stop=["cX"])
    assert held.step(model(torch.tensor([[ord("a")]]))[0, -1])[1] == [{"text": "b", "logprobs": None}]
    assert held.step(model(torch.tensor([[ord("b")]]))[0, -1])[1] == []  # 'c' may begin "cX": held back
    held.cancel()
    assert held.close() == [{"text": "c", "logprobs": None}, {"finish_reason": "cancelled", "tokens": 2}]


def test_the_gateway_peeks_model_and_stream_and_merges_metrics():
    assert peek(b'{"model": "a", "stream": true, "prompt": "x"}') == ("a", True)
    assert peek(b'{"model": 3}') == (None, False) and peek(b"not json") == (None, False)
    one, two = RouterMetrics("m1"), RouterMetrics("m2")
    one.request("1", "score", "live", ok=True)
    two.request("4", "score", "live", ok=True)
    two.request("4", "score", "probe", ok=True)
    merged = merge_expositions([(one.exposition()[0].decode(), {}), (two.exposition()[0].decode(), {})]).decode()
    lines = [ln for ln in merged.splitlines() if ln.startswith("shardline_requests_total{")]
    assert len(lines) == 6 and sum('model="m2"' in ln for ln in lines) == 4  # ok and error series per label set
    assert merged.count("# TYPE shardline_requests_total counter") == 1


def test_two_replicas_of_one_router_merge_into_series_told_apart_by_their_replica():
    """Two router replicas of one model count the same label set: merged, each keeps its own series under its
    router_replica label (one sample each, not two samples of one series), histograms included."""
    from prometheus_client.parser import text_string_to_metric_families

    a, b = RouterMetrics("m"), RouterMetrics("m")
    for _ in range(3):
        a.request("1", "score", "live", ok=True)
    b.request("1", "score", "live", ok=True)
    b.model_call("1", "served", "score", {"ok": True, "latency_ms": 20.0, "bits": 8.0, "bytes": 4})
    parts = [(m.exposition()[0].decode(), {"router_replica": r}) for m, r in ((a, "ra"), (b, "rb"))]
    merged = merge_expositions(parts).decode()
    requests = {
        s.labels["router_replica"]: s.value
        for fam in text_string_to_metric_families(merged)
        for s in fam.samples
        if s.name == "shardline_requests_total" and s.labels["outcome"] == "ok"
    }
    assert requests == {"ra": 3.0, "rb": 1.0}
    assert 'shardline_model_latency_seconds_count{model="m",op="score",router_replica="rb",version="1"} 1.0' in merged


def test_a_version_without_errors_has_an_error_series_at_zero_so_an_error_rate_query_reads_zero():
    """An error-rate PromQL gate divides the error series by all: absent, it reads no data and the canary
    ends inconclusive; the first ok request or call makes the error series at 0 beside it."""
    from prometheus_client.parser import text_string_to_metric_families

    m = RouterMetrics("m")
    m.request("2", "completions", "live", ok=True)
    m.model_call("2", "served", "score", {"ok": True, "latency_ms": 5.0, "bits": 8.0, "bytes": 4})
    m.request("3", "completions", "live", ok=False)
    samples = {
        (s.name, s.labels["version"], s.labels["outcome"]): s.value
        for fam in text_string_to_metric_families(m.exposition()[0].decode())
        for s in fam.samples
        if s.name in ("shardline_requests_total", "shardline_model_calls_total")
    }
    assert samples == {
        ("shardline_requests_total", "2", "ok"): 1.0,
        ("shardline_requests_total", "2", "error"): 0.0,
        ("shardline_requests_total", "3", "ok"): 0.0,
        ("shardline_requests_total", "3", "error"): 1.0,
        ("shardline_model_calls_total", "2", "ok"): 1.0,
        ("shardline_model_calls_total", "2", "error"): 0.0,
    }


def _scripted(prompt: bytes, script: bytes):
    """A model that writes `script` after `prompt`, whatever it samples."""

    def run(idx: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*idx.shape, 256)
        for pos in range(idx.shape[1]):
            k = pos + 1 - len(prompt)
            logits[:, pos, script[k] if 0 <= k < len(script) else 0] = 20.0
        return logits

    return run


def _logprobs(prompt: bytes, script: bytes, stop: list[str], echo: bool = False) -> tuple[str, dict, dict]:
    """The text, its logprobs merged whole (as a completion answers) and merged piece by piece (as a stream)."""
    events = list(generate(_scripted(prompt, script), prompt, 64, len(script), temperature=0, stop=stop, logprobs=0))
    pieces = [e for e in events if "text" in e]
    start = len(prompt.decode()) if echo else 0
    whole = merge_logprobs([p["logprobs"] for p in pieces], start=start)
    streamed: dict = {"tokens": [], "text_offset": []}
    offset = start
    for p in pieces:
        part = merge_logprobs([p["logprobs"]], offset, start)
        streamed["tokens"] += part["tokens"]
        streamed["text_offset"] += part["text_offset"]
        offset += len(p["text"])
    return "".join(p["text"] for p in pieces), whole, streamed


def test_logprobs_are_those_of_the_returned_text_where_a_stop_string_was_held_back_or_cut():
    # "aa" was held back as a possible start of "aab", then returned: each token once, at its own offset
    text, whole, streamed = _logprobs(b">", b"xaaax", stop=["aab"])
    assert text == "xaaax" and whole["tokens"] == ["x", "a", "a", "a", "x"]
    assert whole["text_offset"] == streamed["text_offset"] == [0, 1, 2, 3, 4]
    # the stop string and the tokens that wrote it are not returned, nor their logprobs
    text, whole, streamed = _logprobs(b">", b"xaaab", stop=["aab"])
    assert text == "xa" and whole["tokens"] == streamed["tokens"] == ["x", "a"]
    text, whole, _ = _logprobs(b">", b"abdzz", stop=["abc", "bd"])
    assert text == "a" and whole["tokens"] == ["a"] and whole["text_offset"] == [0]
    # echoed: the completion's offsets follow the prompt's characters
    _, whole, streamed = _logprobs("é>".encode(), b"xy", stop=[], echo=True)
    assert whole["text_offset"] == streamed["text_offset"] == [2, 3]


def test_text_offsets_follow_the_decoded_text_through_bytes_that_are_not_utf8():
    # a lone continuation byte decodes to one U+FFFD: the bytes after it start one character later
    text, whole, _ = _logprobs(b">", b"a\x80bc", stop=[])
    assert text == "a\ufffdbc" and whole["text_offset"] == [0, 1, 2, 3]
    text, whole, _ = _logprobs(b">", "aé".encode() + b"z", stop=[])  # the two bytes of é share its start
    assert text == "aéz" and whole["text_offset"] == [0, 1, 1, 2]


def test_a_token_after_an_invalid_lead_byte_starts_after_its_ufffd_and_a_stop_string_drops_it():
    # a lead byte that the next byte does not go on with is flushed as one U+FFFD: the next token starts after it
    text, whole, streamed = _logprobs(b">", b"a\xc3bc", stop=[])
    assert text == "a\ufffdbc" and whole["text_offset"] == streamed["text_offset"] == [0, 1, 2, 3]
    text, whole, _ = _logprobs(b">", b"a\xe2\x82xy", stop=[])  # two bytes of one unfinished character share it
    assert text == "a\ufffdxy" and whole["text_offset"] == [0, 1, 1, 2, 3]
    text, whole, _ = _logprobs(b">", b"a\xe0\x80b", stop=[])  # \xe0 cannot go on with \x80: two U+FFFD
    assert text == "a\ufffd\ufffdb" and whole["text_offset"] == [0, 1, 2, 3]
    # the token that began the stop string is not returned, nor its logprobs
    text, whole, streamed = _logprobs(b">", b"a\xc3bcz", stop=["bc"])
    assert text == "a\ufffd" and whole["tokens"] == streamed["tokens"] == ["a", token_text(0xC3)]


class _Pieces:
    """A codec over a fixed list of byte pieces (a tokenizer whose tokens hold several bytes)."""

    ends: frozenset[int] = frozenset()

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def piece(self, token: int) -> bytes:
        return self.pieces[token]

    def label(self, token: int) -> str:
        return repr(self.pieces[token])


def test_a_multibyte_token_that_flushes_a_held_byte_and_holds_its_own_end_starts_after_the_ufffd():
    pieces = [b"a", b"\xe2", b"x\xc3", b"\xa9", "é".encode()]
    completion = Completion(5, temperature=0, logprobs=0, codec=_Pieces(pieces))  # type: ignore[arg-type]
    events = []
    for token in [0, 1, 2, 3, 4]:  # 'a', a held lead byte, 'x' + a held lead byte, the byte finishing 'é', 'é'
        logits = torch.full((len(pieces),), -10.0)
        logits[token] = 10.0
        events += completion.step(logits)[1]
    events += completion.close()
    lp = merge_logprobs([e["logprobs"] for e in events if "text" in e])
    assert "".join(e["text"] for e in events if "text" in e) == "a\ufffdxéé"
    assert lp["text_offset"] == [0, 1, 2, 3, 4]  # 'x\xc3' starts at 'x', after the U+FFFD its first byte flushed


def test_top_k_below_one_samples_from_every_token_as_vllms_minus_one():
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    for top_k in (0, -1):
        gen = torch.Generator().manual_seed(0)
        assert {pick(logits, 1.0, top_k, 1.0, gen) for _ in range(200)} == {0, 1, 2, 3}


def test_the_gateway_peeks_a_body_that_starts_with_a_utf8_bom_as_the_router_reads_it():
    from deployments.openai_api import parse_json

    body = b'\xef\xbb\xbf{"model": "a", "stream": true, "prompt": "x"}'
    assert parse_json(body)["stream"] is True  # the router takes the BOM (utf-8-sig) ...
    assert peek(body) == ("a", True)  # ... and the gateway then asks it for a stream
