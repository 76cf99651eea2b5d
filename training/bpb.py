"""Bits per byte: the one windowing rule that validation, the canary and the live endpoint all use.

A text is cut into consecutive windows of at most seq_len + 1 bytes that overlap by one byte: each window predicts
its bytes after the first from the ones before, inside the window. Every byte of the text but the first is thus
predicted exactly once, whatever the text's length, and the same text gives the same number wherever it is scored.
Windows of equal length are batched together (the exported serving model has dynamic batch and time dimensions).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

LN2 = math.log(2)


def windows(text: bytes, seq_len: int) -> list[torch.Tensor]:
    """The text's windows (int64, 2..seq_len + 1 bytes each); [] for a text of fewer than 2 bytes."""
    out = []
    for start in range(0, max(0, len(text) - 1), seq_len):
        window = text[start : start + seq_len + 1]
        if len(window) >= 2:
            out.append(torch.frombuffer(bytearray(window), dtype=torch.uint8).long())
    return out


def token_windows(ids: list[int], seq_len: int) -> list[torch.Tensor]:
    """`windows` for token ids: consecutive windows of at most seq_len + 1 tokens, overlapping by one."""
    out = []
    for start in range(0, max(0, len(ids) - 1), seq_len):
        window = ids[start : start + seq_len + 1]
        if len(window) >= 2:
            out.append(torch.tensor(window, dtype=torch.long))
    return out


@torch.no_grad()
def window_bits(
    model: Callable[[torch.Tensor], torch.Tensor], batch: list[torch.Tensor], device: torch.device | str = "cpu"
) -> float:
    """Total bits the model needs for the predicted bytes of equal-length windows, scored as one batch."""
    seqs = torch.stack(batch).to(device)
    logits = model(seqs[:, :-1]).float()
    nats = F.cross_entropy(logits.reshape(-1, logits.size(-1)), seqs[:, 1:].reshape(-1), reduction="sum")
    return float(nats) / LN2


class BitsCounter:
    """Accumulates bits and predicted bytes over windows, batching windows of equal length."""

    def __init__(
        self, model: Callable[[torch.Tensor], torch.Tensor], batch_size: int = 8, device: torch.device | str = "cpu"
    ) -> None:
        self.model, self.batch_size, self.device = model, batch_size, device
        self.bits, self.bytes = 0.0, 0
        self._pending: dict[int, list[torch.Tensor]] = defaultdict(list)

    def add(self, window: torch.Tensor) -> None:
        group = self._pending[len(window)]
        group.append(window)
        if len(group) == self.batch_size:
            self._run(len(window))

    def _run(self, length: int) -> None:
        group = self._pending.pop(length, [])
        if group:
            self.bits += window_bits(self.model, group, self.device)
            self.bytes += sum(len(w) - 1 for w in group)

    def flush(self) -> tuple[float, int]:
        for length in list(self._pending):
            self._run(length)
        return self.bits, self.bytes


def text_bits(
    model: Callable[[torch.Tensor], torch.Tensor],
    text: bytes,
    seq_len: int,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
) -> tuple[float, int]:
    """Bits the model needs for `text` (every byte but the first) and how many bytes it predicted."""
    counter = BitsCounter(model, batch_size, device)
    for window in windows(text, seq_len):
        counter.add(window)
    return counter.flush()


def token_bits(
    model: Callable[[torch.Tensor], torch.Tensor],
    ids: list[int],
    predicted_bytes: int,
    seq_len: int,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
) -> tuple[float, int]:
    """text_bits for a token model: the bits it needs for every token of a text but the first, and the UTF-8 bytes
    those tokens cover (training.tokenizer.predicted). bits / bytes is then bits per byte of the same text, the
    figure a byte model's text_bits gives, so a BPE model and a byte model are compared on one scale."""
    counter = BitsCounter(model, batch_size, device)
    for window in token_windows(ids, seq_len):
        counter.add(window)
    bits, _tokens = counter.flush()
    return bits, predicted_bytes


def corpus_bits(
    model: Callable[[torch.Tensor], torch.Tensor],
    texts: Iterable[bytes],
    seq_len: int,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
    encode: Callable[[bytes], tuple[list[int], int]] | None = None,
) -> tuple[float, int, int]:
    """(bits, predicted bytes, texts) over every text; the same windows as text_bits, batched across texts.

    `encode` (a token model's: training.tokenizer.predicted with its tokenizer) turns a text into its ids and the
    UTF-8 bytes its tokens after the first cover; the windows are then token_bits', and those bytes are counted (a
    byte model counts every byte but the first, so both figures are bits per byte of the same texts).
    """
    counter = BitsCounter(model, batch_size, device)
    n_texts, covered = 0, 0
    for text in texts:
        n_texts += 1
        if encode is None:
            for window in windows(text, seq_len):
                counter.add(window)
            continue
        ids, predicted_bytes = encode(text)
        covered += predicted_bytes
        for window in token_windows(ids, seq_len):
            counter.add(window)
    bits, nbytes = counter.flush()
    return bits, (nbytes if encode is None else covered), n_texts
