"""A model over a tokenizer's ids on the endpoint's code path: text in (prompt ids, scored bytes), text out (each
id's bytes through the same UTF-8 and stop-string holdback as a byte model), the same numbers as training.bpb."""

from __future__ import annotations

import asyncio
import math
from contextlib import aclosing

import pytest
import torch

from deployments.codec import BYTES, TokenCodec, codec_for, label_bytes
from deployments.engine import Engine, Recompute
from deployments.generation import Completion, generate, merge_logprobs
from deployments.kv_cache import CachedGPT
from deployments.model_server import score_many
from training import tokenizer as tk
from training.bpb import token_bits
from training.model import GPT

SEQ = 32
TEXTS = [
    "def main():\n    return 0\n",
    "import os\nimport sys\n",
    "café, naïve, déjà vu — ½ ✓\n",
    "for i in range(10):\n    print(i)\n",
]


@pytest.fixture(scope="module")
def codec() -> TokenCodec:
    tok = tk.train_bpe([t.encode() * 30 for t in TEXTS], 300)
    return TokenCodec(tok)


def _gpt(vocab: int) -> GPT:
    torch.manual_seed(0)
    model = GPT(SEQ, n_layer=2, n_head=2, d_model=32, vocab=vocab).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # sharper logits: greedy choices are not near-ties
    return model


def test_every_id_decodes_to_its_bytes_and_the_pieces_rebuild_any_text(codec):
    assert codec_for(None) is BYTES and codec.vocab == 300
    for text in [*TEXTS, "ünïcødé ☃ outside the training texts 🙂\n"]:
        ids, predicted = codec.scored(text.encode())
        assert b"".join(codec.piece(i) for i in ids) == text.encode()
        assert predicted == len(text.encode()) - len(codec.piece(ids[0]))  # every id but the first
    # an id whose bytes end inside a character reads as raw bytes, as OpenAI's logprobs write them
    partial = next(i for i in range(codec.vocab) if codec.piece(i) == "é".encode()[:1])
    assert codec.label(partial) == "bytes:\\xc3"
    with pytest.raises(ValueError, match=r"^the text is not UTF-8 \(byte 1\)"):
        codec.scored(b"a\xff")


def test_scores_and_prompt_bits_are_training_bpbs_on_the_tokenizers_ids(codec):
    model = _gpt(codec.vocab)
    texts = [t.encode() * 3 for t in TEXTS]  # longer than the window: several windows each
    for (bits, n), text in zip(score_many(model, texts, SEQ, codec=codec), texts, strict=True):
        ids, predicted = codec.scored(text)
        want_bits, want_n = token_bits(model, ids, predicted, SEQ)
        assert n == want_n == predicted and math.isclose(bits, want_bits, rel_tol=1e-5)

    async def head(prompt: bytes) -> dict:
        engine = Engine(CachedGPT(model, slots=1), codec)
        async with aclosing(engine.stream(prompt, Completion(0))) as events:
            return [e async for e in events][0]

    for prompt in (TEXTS[2].encode(), TEXTS[0].encode() * 4):  # inside the window, and longer than it
        ids, predicted = codec.scored(prompt)
        got = asyncio.run(head(prompt))
        assert got["bytes"] == predicted and got["prompt_ids"] == len(ids)  # usage.prompt_tokens counts the ids
        assert math.isclose(got["bits"], token_bits(model, ids, predicted, SEQ)[0], rel_tol=1e-4)


@pytest.mark.parametrize("backend", ["cached", "recompute"])
def test_completions_decode_the_ids_to_text_as_recomputing_does(codec, backend):
    model = _gpt(codec.vocab)
    made = CachedGPT(model, slots=2) if backend == "cached" else Recompute(model, SEQ, slots=2)

    async def complete(prompt: bytes, n: int, stop: list[str] | None = None) -> tuple[str, list[str], str]:
        completion = Completion(n, temperature=0.0, stop=stop, logprobs=1, codec=codec)
        async with aclosing(Engine(made, codec).stream(prompt, completion)) as events:
            out = [e async for e in events]
        text = "".join(e["text"] for e in out if "text" in e)
        return text, merge_logprobs([e["logprobs"] for e in out if "text" in e])["tokens"], out[-1]["finish_reason"]

    prompt = "café = ".encode()
    text, tokens, finish = asyncio.run(complete(prompt, 12))
    events = list(generate(model, prompt, SEQ, 12, temperature=0.0, logprobs=1, codec=codec))
    assert text == "".join(e["text"] for e in events if "text" in e) and finish == "length"
    assert tokens == merge_logprobs([e["logprobs"] for e in events if "text" in e])["tokens"]
    # the text is exactly the 12 ids' bytes, decoded as one UTF-8 stream (a broken character reads U+FFFD)
    assert len(tokens) == 12 and text == b"".join(map(_label_bytes, tokens)).decode("utf-8", errors="replace")
    # a stop string is found in the decoded text and never returned, whatever ids it was split across
    if len(text) > 3:
        stopped, _, why = asyncio.run(complete(prompt, 12, stop=[text[2:4]]))
        assert why == "stop" and stopped == text[:2]


def _label_bytes(label: str) -> bytes:
    raw = label_bytes(label)
    return label.encode() if raw is None else raw


def test_text_offsets_count_the_characters_a_token_starts():
    pieces = [{"tokens": ["def", " main", "bytes:\\xc3", "bytes:\\xa9", "bytes:\\xe2\\x9c", "bytes:\\x93"]}]
    pieces[0] |= {"token_logprobs": [0.0] * 6, "top_logprobs": [{}] * 6}
    # a token that goes on with a character begun before it starts where that character does (as a completion's)
    assert merge_logprobs(pieces, offset=10)["text_offset"] == [10, 13, 18, 18, 19, 19]


@pytest.mark.parametrize("runner", ["engine", "generate"])
def test_a_special_token_ends_the_text_with_finish_reason_stop(codec, runner):
    """A model that emits `<|endoftext|>` (or an end of turn) has ended its text: no more is generated, the token
    adds no text, and the completion finishes with "stop", not "length" at max_tokens."""
    eot = codec.tokenizer.token_to_id(tk.END_OF_TEXT)
    assert codec.ends == {eot} and not BYTES.ends
    model = _gpt(codec.vocab)
    with torch.no_grad():
        model.lm_head.weight[eot] = 0.0  # left alone, greedy never picks it
    ids = codec.encode(b"def")
    texts = _greedy_ids(model, ids, 3)  # its first 3 greedy ids; the 4th becomes the end of text
    ended = _ends_after(model, len(ids) + 3, eot)
    if runner == "generate":
        events = list(generate(ended, b"def", SEQ, 12, temperature=0, codec=codec))
    else:
        engine = Engine(Recompute(ended, SEQ, slots=1), codec)
        events = _engine_events(engine, b"def", Completion(12, 0.0, codec=codec))
    text = "".join(e["text"] for e in events if "text" in e)
    assert events[-1] == {"finish_reason": "stop", "tokens": 4}
    assert text == b"".join(codec.piece(i) for i in texts).decode("utf-8", "replace")


def _ends_after(model, length: int, eot: int):
    """`model`, except that from a context of `length` ids on it predicts `eot` above all."""

    def run(idx: torch.Tensor) -> torch.Tensor:
        logits = model(idx)
        if idx.shape[1] >= length:
            logits[:, -1, eot] = logits[:, -1].max() + 10.0
        return logits

    return run


def _greedy_ids(model, ids: list[int], n: int) -> list[int]:
    context = list(ids)
    with torch.no_grad():
        for _ in range(n):
            context.append(int(model(torch.tensor([context[-SEQ:]]))[0, -1].argmax()))
    return context[len(ids) :]


def _engine_events(engine: Engine, prompt: bytes, completion: Completion) -> list[dict]:
    async def run() -> list[dict]:
        async with aclosing(engine.stream(prompt, completion)) as events:
            return [e async for e in events if "bits" not in e]

    return asyncio.run(run())


def _sentencepiece_style():
    """A Llama-style tokenizer.json: Metaspace words, byte fallback (`<0xE2>`), a decoder that strips the text's
    first space, `<unk>`/`<s>`/`</s>` special."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", "t", "h", "e", "c", "a", "▁t", "he", "▁the", "▁c", "▁ca", "▁cat"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "c"), ("▁c", "a"), ("▁ca", "t")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return tok


def test_a_byte_fallback_id_whose_byte_has_its_own_token_reads_by_its_name_in_top_logprobs():
    """`<0x61>` and `a` both stand for b"a": labelled alike, one overwrote the other in `top_logprobs` (a dict)."""
    from deployments.generation import top_entries

    tok = _sentencepiece_style()
    codec = TokenCodec(tok)
    fallback_a, a, fallback_e2 = (tok.token_to_id(t) for t in ("<0x61>", "a", "<0xE2>"))
    assert [codec.label(i) for i in (fallback_a, a, fallback_e2)] == ["<0x61>", "a", "bytes:\\xe2"]
    assert codec.piece(fallback_a) == codec.piece(a) == b"a"  # the text they stand for is unchanged
    logprobs = torch.full((codec.vocab,), -9.0)
    logprobs[[fallback_a, a]] = torch.tensor([-0.5, -0.75])
    assert top_entries(logprobs, 2, codec) == {"<0x61>": -0.5, "a": -0.75}


def test_a_sentencepiece_style_tokenizer_keeps_its_spaces_and_bytes_and_names_its_special_tokens():
    """Decoded one id at a time, every `▁word` lost its space (the decoder strips a text's first one) and every
    `<0xNN>` became U+FFFD: a completion read `thecat`, and a stop string ` cat` never matched."""
    from deployments.generation import top_entries

    tok = _sentencepiece_style()
    codec = TokenCodec(tok)
    ids = tok.encode("the ✓ cat", add_special_tokens=False).ids
    assert b"".join(codec.piece(i) for i in ids).decode() == " the ✓ cat"  # a continuation: its first space kept
    assert [codec.piece(i) for i in ids[2:5]] == [b"\xe2", b"\x9c", b"\x93"]
    assert codec.ends == {0, 1, 2} and [codec.label(i) for i in (0, 1, 2)] == ["<unk>", "<s>", "</s>"]
    logprobs = torch.full((codec.vocab,), -9.0)
    logprobs[[0, 1, 2, ids[-1]]] = torch.tensor([-1.0, -2.0, -3.0, -0.5])
    assert top_entries(logprobs, 4, codec) == {" cat": -0.5, "<unk>": -1.0, "<s>": -2.0, "</s>": -3.0}
    prompt = tok.encode("the", add_special_tokens=False).ids
    script = [tok.token_to_id(t) for t in ("▁the", "▁cat", "▁the")]  # what the model writes after the prompt

    def scripted(idx: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(idx.shape[0], idx.shape[1], codec.vocab)
        logits[:, -1, script[min(idx.shape[1] - len(prompt), len(script) - 1)]] = 10.0
        return logits

    events = list(generate(scripted, b"the", SEQ, 3, temperature=0, codec=codec))
    assert "".join(e.get("text", "") for e in events) == " the cat the"
    events = list(generate(scripted, b"the", SEQ, 3, temperature=0, codec=codec, stop=[" cat"]))
    assert "".join(e.get("text", "") for e in events) == " the" and events[-1]["finish_reason"] == "stop"


def test_an_echoed_prompt_s_offsets_are_where_its_tokens_start_not_a_count_of_their_labels():
    """Metaspace's first `▁the` is labelled ` the` but covers `the`: counted by labels, every later echoed token's
    text_offset ran a character ahead (` cat` at 4 in "the cat"). The tokenizer's own offsets place them, byte
    fallback ids of one character included, and the completion's offsets still follow the prompt."""
    from deployments.router_stream import prompt_piece

    codec = TokenCodec(_sentencepiece_style())
    prompt = "the ✓ cat".encode()
    labels, offsets = codec.spans(prompt)
    assert labels == [" the", " ", "bytes:\\xe2", "bytes:\\x9c", "bytes:\\x93", " cat"]
    assert offsets == [0, 3, 4, 4, 4, 5]
    scored = [(None, None)] + [(-1.0, {})] * (len(labels) - 1)
    head = prompt_piece({"prompt_logprobs": scored, "prompt_tokens": labels, "prompt_offsets": offsets})
    completion = {"tokens": [" the"], "token_logprobs": [-0.5], "top_logprobs": [{}], "text_offset": [0]}
    merged = merge_logprobs([head, completion], start=len("the ✓ cat"))
    assert merged["text_offset"] == [0, 3, 4, 4, 4, 5, 9] and merged["tokens"] == [*labels, " the"]
