"""training.bpb: every byte after the first predicted exactly once, whatever the text length vs the window."""

from __future__ import annotations

import math

import pytest
import torch

from training.bpb import corpus_bits, text_bits, windows

SEQ = 16
LENGTHS = [0, 1, 2, 3, SEQ - 1, SEQ, SEQ + 1, SEQ + 2, 2 * SEQ, 2 * SEQ + 1, 2 * SEQ + 2, 50, 161]


class Bigram(torch.nn.Module):
    """Next-byte logits from the current byte only, so windowing cannot change the score."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(256, 256, generator=g))
        self.shapes: list[tuple[int, int]] = []

    def forward(self, x):
        self.shapes.append(tuple(x.shape))
        return self.table[x]


def _reference_bits(model: Bigram, text: bytes) -> float:
    x = torch.tensor(list(text[:-1]))
    y = torch.tensor(list(text[1:]))
    logp = torch.log_softmax(model.table.detach()[x], dim=-1)
    return float(-logp[torch.arange(len(y)), y].sum()) / math.log(2)


def _text(length: int, salt: int = 0) -> bytes:
    return bytes((i * 37 + 11 + salt) % 256 for i in range(length))


@pytest.mark.parametrize("length", LENGTHS)
def test_each_byte_after_the_first_is_predicted_exactly_once(length):
    text = bytes(range(length)) if length <= 256 else _text(length)  # byte value = its position
    ws = windows(text, SEQ)
    predicted = [int(b) for w in ws for b in w[1:]]
    assert predicted == list(range(1, length))
    assert all(2 <= len(w) <= SEQ + 1 and w.dtype == torch.int64 for w in ws)
    # consecutive windows overlap by exactly one byte: the next window's context starts where this one ended
    assert all(int(a[-1]) == int(b[0]) for a, b in zip(ws, ws[1:], strict=False))


@pytest.mark.parametrize("length", [n for n in LENGTHS if n >= 2])
def test_windowed_bits_equal_the_whole_text_bits(length):
    model = Bigram()
    text = _text(length)
    bits, n = text_bits(model, text, seq_len=SEQ)
    assert n == length - 1
    assert bits == pytest.approx(_reference_bits(model, text), rel=1e-5)
    assert all(t <= SEQ for _, t in model.shapes)  # the model never sees more than its context


def test_texts_of_fewer_than_two_bytes_predict_nothing():
    assert windows(b"", SEQ) == [] and windows(b"a", SEQ) == []
    model = Bigram()
    assert text_bits(model, b"a", seq_len=SEQ) == (0.0, 0)
    assert model.shapes == []  # not even called


def test_a_uniform_model_costs_eight_bits_per_byte():
    model = Bigram()
    with torch.no_grad():
        model.table.zero_()
    bits, n = text_bits(model, b"hello, world! " * 5, seq_len=SEQ)
    assert n == 14 * 5 - 1 and bits / n == pytest.approx(8.0)


def test_batch_size_does_not_change_the_score():
    model = Bigram()
    text = _text(200)
    one, n1 = text_bits(model, text, seq_len=SEQ, batch_size=1)
    many, n8 = text_bits(model, text, seq_len=SEQ, batch_size=8)
    assert n1 == n8 == 199 and many == pytest.approx(one, rel=1e-5)


def test_corpus_bits_is_the_sum_of_text_bits():
    model = Bigram()
    texts = [_text(n, salt=n) for n in (0, 1, 2, SEQ + 1, 40, 40, 161, 33)]
    per_text = [text_bits(model, t, seq_len=SEQ) for t in texts]
    model.shapes.clear()
    bits, nbytes, n_texts = corpus_bits(model, iter(texts), seq_len=SEQ, batch_size=3)
    assert n_texts == len(texts)
    assert nbytes == sum(n for _, n in per_text) == sum(max(0, len(t) - 1) for t in texts)
    assert bits == pytest.approx(sum(b for b, _ in per_text), rel=1e-5)
    assert max(b for b, _ in model.shapes) > 1  # windows of different texts were batched together
