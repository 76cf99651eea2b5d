"""Text generation for a byte-level model: sampling (temperature, top-k, top-p, seed), stop strings, logprobs.

`Completion` is one completion's state (sampling, stop strings, logprobs): fed each position's logits, it yields
{"text": piece, "logprobs": ...} as text becomes safe to emit, then one final {"finish_reason", "tokens"}. Whatever
runs the model drives it: `generate` (a plain generator that recomputes the window for every byte) or
deployments.engine (KV cache, batched decode steps), so a whole completion and a stream share one code path.
Text that could still turn out to be the start of a stop string is held back until it cannot; the stop string
itself is never returned (OpenAI's behaviour). The model takes [B, T] ids and returns [B, T, vocab] logits: bytes,
or a tokenizer's ids through the version's codec (deployments.codec: each id decodes to its bytes, so the UTF-8
and stop-string holdback is the same); the context is the last `seq_len` ids (a longer prompt is truncated on the
left, as the README documents).
"""

from __future__ import annotations

import codecs
import random
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from deployments.codec import BYTES, ByteCodec, TokenCodec, label_bytes

Codec = ByteCodec | TokenCodec


# a temperature this close to 0 samples the likeliest token anyway; dividing by it would overflow (1e-40: inf
# logits, a NaN softmax, and the request failing as the model version's fault)
GREEDY_BELOW = 1e-5


def pick(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> int:
    """The next token from one position's logits: greedy at temperature 0 (below GREEDY_BELOW), else sampled from
    the softmax at `temperature` restricted to the `top_k` likeliest tokens (0 or less = all, as vLLM's -1) and the
    smallest set whose mass reaches `top_p`."""
    if temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        order = torch.argsort(scaled, descending=True)
        probs = torch.softmax(scaled[order], -1)
        keep = torch.cumsum(probs, -1) - probs < top_p  # the token that crosses top_p is kept
        keep[0] = True  # and the likeliest always (top_p 0 is greedy)
        scaled[order[~keep]] = float("-inf")
    return int(torch.multinomial(torch.softmax(scaled, -1), 1, generator=gen))


def top_entries(logprobs: torch.Tensor, k: int, codec: Codec = BYTES, chosen: int | None = None) -> dict[str, float]:
    """The k likeliest tokens' labels and logprobs, likeliest first, and the chosen token's (the sampled one, or the
    prompt's own) after them when it is not among them: OpenAI's "the logprob of the sampled token is always
    returned, so there may be up to logprobs+1 elements" (logprobs 0 gives that one alone)."""
    out: dict[str, float] = {}
    if k > 0:
        values, ids = torch.topk(logprobs, min(k, logprobs.numel()))
        out = {codec.label(int(i)): float(v) for v, i in zip(values, ids, strict=True)}
    if chosen is not None:
        out.setdefault(codec.label(chosen), float(logprobs[chosen]))
    return out


def prompt_logprobs(
    model: Callable[[torch.Tensor], torch.Tensor], prompt: bytes, seq_len: int, k: int, codec: Codec = BYTES
) -> list[tuple[float | None, dict[str, float] | None]]:
    """(logprob, top-k) of each prompt token (byte, or tokenizer id) under the model, None for the first (never
    predicted); the same windows as bits per byte, so a token's logprob here is the one it is scored with."""
    out: list[tuple[float | None, dict[str, float] | None]] = [(None, None)]
    ids = codec.encode(prompt)
    with torch.no_grad():
        for start in range(0, max(0, len(ids) - 1), seq_len):
            window = torch.tensor(ids[start : start + seq_len + 1], dtype=torch.long)
            if len(window) < 2:
                break
            lp = torch.log_softmax(model(window[None, :-1])[0].float(), -1)
            for t, target in enumerate(window[1:].tolist()):
                out.append((float(lp[t, target]), top_entries(lp[t], k, codec, target)))
    return out


class _StopScanner:
    """Finds stop strings in the decoded text and says how much of it is safe to emit."""

    def __init__(self, stops: list[str]):
        self.stops = stops

    def find(self, text: str) -> int:
        """Index of the earliest stop string in `text`, or -1."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else -1

    def safe(self, text: str) -> int:
        """Length of the prefix of `text` that no stop string can still begin in."""
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return len(text) - hold


class Completion:
    """One completion's decoding state: picks each next token from the model's logits and turns the tokens into
    events. The model is driven from outside (the recompute loop below, or deployments.engine's batched KV-cache
    steps), so sampling, stop strings and logprobs have one implementation whatever runs the model.
    """

    def __init__(
        self,
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[str] | None = None,
        logprobs: int | None = None,
        codec: Codec = BYTES,
    ) -> None:
        self.codec = codec  # what each id stands for: a byte, or a tokenizer's piece of text
        self.max_tokens, self.temperature, self.top_k, self.top_p = max_tokens, temperature, top_k, top_p
        self.logprobs = logprobs
        self.gen = torch.Generator().manual_seed(seed if seed is not None else random.getrandbits(63))
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.scanner = _StopScanner(stop or [])
        self.text, self.emitted = "", 0  # decoded completion so far; how much of it has been yielded
        # tokens not yet emitted (logprobs): label, logprob, top alternatives, and where the token starts in the text
        # (the character its first byte falls in: a token ending inside a character and the one completing it
        # share that character's start)
        self.pending: list[_Token] = []
        self.cut = False  # a stop string ended the text (what was held back after it is dropped)
        self.tokens = 0
        self.finish: str | None = None if max_tokens > 0 else "length"

    @property
    def done(self) -> bool:
        """True once no further token is wanted (max_tokens reached, a stop string, or cancelled)."""
        return self.finish is not None

    def step(self, logits: torch.Tensor) -> tuple[int, list[dict[str, Any]]]:
        """The next token picked from `logits` (one position's [vocab]) and the pieces now safe to emit."""
        logits = logits.float()
        token = pick(logits, self.temperature, self.top_k, self.top_p, self.gen)
        self.tokens += 1
        if token in self.codec.ends:  # a special token: the model ended its text (codec.TokenCodec)
            self.finish = "stop"
            return token, []
        piece, before = self.codec.piece(token), len(self.text)
        new = self.decoder.decode(piece)
        self.text += new
        if self.logprobs is not None:
            lp = torch.log_softmax(logits, -1)
            label = self.codec.label(token)
            top = top_entries(lp, self.logprobs, self.codec, token)
            self.pending.append(_Token(label, float(lp[token]), top, before + _flushed(new, piece)))
        out: list[dict[str, Any]] = []
        cut = self.scanner.find(self.text)
        if cut >= 0:  # the stop string and the tokens that wrote it are not returned
            self.text, self.finish, self.cut = self.text[:cut], "stop", True
            self.pending = [t for t in self.pending if t.start < cut]
            return token, out
        safe = self.scanner.safe(self.text)
        if safe > self.emitted:
            out.append(self._emit(safe))
        if self.tokens >= self.max_tokens:
            self.finish = "length"
        return token, out

    def cancel(self) -> None:
        """End the completion before its next token (the client went away): finish_reason "cancelled"."""
        self.finish = self.finish or "cancelled"

    def close(self) -> list[dict[str, Any]]:
        """The last events: the held-back text, then {"finish_reason", "tokens"}. A character left unfinished
        reads as U+FFFD, unless a stop string cut the text before it."""
        self.finish = self.finish or "length"
        if not self.cut:
            self.text += self.decoder.decode(b"", final=True)
        out = [self._emit(len(self.text))] if len(self.text) > self.emitted else []
        return out + [{"finish_reason": self.finish, "tokens": self.tokens}]

    def _emit(self, end: int) -> dict[str, Any]:
        """The piece of text up to `end`, with the logprobs of the tokens that start in it."""
        taken = [t for t in self.pending if t.start < end]
        self.pending = self.pending[len(taken) :]
        piece = _piece(self.text[self.emitted : end], taken, self.logprobs)
        self.emitted = end
        return piece


def generate(
    model: Callable[[torch.Tensor], torch.Tensor],
    prompt: bytes,
    seq_len: int,
    max_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: list[str] | None = None,
    logprobs: int | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    codec: Codec = BYTES,
) -> Iterator[dict[str, Any]]:
    """Events of one completion: {"text", "logprobs"} pieces, then {"finish_reason", "tokens"}.

    Recomputes the whole context window for every new byte (any [B, T] model; deployments.engine decodes the
    built-in GPT incrementally instead). `logprobs` (0..5 or None) adds each emitted token's logprob and its top
    alternatives to the pieces. `should_stop` is asked before every decode step (a client that went away ends the
    generation at once).
    """
    completion = Completion(max_tokens, temperature, top_k, top_p, seed, stop, logprobs, codec)
    context = torch.tensor(codec.encode(prompt)[-seq_len:], dtype=torch.long)
    with torch.no_grad():
        while not completion.done:
            if should_stop():
                completion.cancel()
                break
            token, events = completion.step(model(context[None, -seq_len:])[0, -1])
            yield from events
            context = torch.cat([context, torch.tensor([token])])
    yield from completion.close()


def _flushed(new: str, piece: bytes) -> int:
    """How many characters of `new` (what the incremental decoder gave for a token's bytes `piece`) came before the
    token's first byte: 1 when the bytes held from earlier tokens (an unfinished UTF-8 sequence) were flushed as a
    U+FFFD because `piece` does not go on with them, else 0 (nothing held, or the piece's first byte continues the
    held character, so the token starts where that character does).

    `piece` decoded alone, holding back an unfinished end as the incremental decoder does, gives the same characters
    when nothing was flushed, except that each byte continuing a held character reads alone as a U+FFFD of its own.
    """
    alone = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(piece)
    return max(0, len(new) - len(alone))


class _Token(NamedTuple):
    label: str
    logprob: float
    top: dict[str, float]
    start: int  # where it starts in the completion's text


def _piece(text: str, tokens: list[_Token], logprobs: int | None) -> dict[str, Any]:
    if logprobs is None:
        return {"text": text, "logprobs": None}
    return {
        "text": text,
        "logprobs": {
            "tokens": [t.label for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [t.top for t in tokens],
            "text_offset": [t.start for t in tokens],  # in the completion's text (merge_logprobs places them)
        },
    }


def merge_logprobs(pieces: list[dict[str, Any] | None], offset: int = 0, start: int | None = None) -> dict[str, Any]:
    """One OpenAI `logprobs` object from the pieces' parts. A completion's piece says where each of its tokens
    starts in the completion's text: counted from `start`, where the completion begins in the answer (after an
    echoed prompt; `offset` unless given); an echoed prompt's part (`echo`) says where in the prompt, counted from
    `offset`. A part without them (an echoed prompt of bytes, or a piece from a replica of older code) is counted
    by its labels, from `offset` on."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    position, start = offset, offset if start is None else start
    for part in pieces:
        if not part:
            continue
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            out[key] += part[key]
        if "text_offset" in part:
            base = offset if part.get("echo") else start
            out["text_offset"] += [base + at for at in part["text_offset"]]
            continue
        for token in part["tokens"]:
            raw = label_bytes(token)
            continues = raw is not None and raw[:1] != b"" and 0x80 <= raw[0] < 0xC0
            # a token that goes on with a character begun before it starts where that character does, as a
            # completion's own tokens do (Completion: `start`)
            out["text_offset"].append(position - 1 if continues and position > offset else position)
            position += _characters_started(token)
    return out


def _characters_started(label: str) -> int:
    """Characters a token's label starts in the text: its length, or for raw bytes (`bytes:\\xNN...`) the ASCII
    and UTF-8 lead bytes among them (continuation bytes start none)."""
    raw = label_bytes(label)
    if raw is None:
        return len(label)
    return sum(1 for b in raw if b < 0x80 or b >= 0xC0)
