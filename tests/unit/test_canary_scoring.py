"""score_bits: every byte after the first predicted exactly once, whatever the text length vs the window."""
from __future__ import annotations

import math

import pytest
import torch

from deployments.serve_app import score_bits


class Bigram(torch.nn.Module):
    """Next-byte logits from the current byte only, so windowing cannot change the score."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(256, 256, generator=g))

    def forward(self, x):
        assert x.shape[-1] == 16, "the scorer must always feed full windows"
        return self.table[x]


def _reference_bits(model, text: bytes) -> float:
    x = torch.tensor(list(text[:-1]))
    y = torch.tensor(list(text[1:]))
    logp = torch.log_softmax(model.table.detach()[x], dim=-1)
    return float(-logp[torch.arange(len(y)), y].sum()) / math.log(2)


@pytest.mark.parametrize("length", [2, 10, 17, 32, 33, 50, 161])
def test_windowed_bits_equal_the_whole_text_bits(length):
    model = Bigram()
    text = bytes((i * 37 + 11) % 256 for i in range(length))
    bits, n = score_bits(model, text, seq_len=16)
    assert n == length - 1
    assert bits == pytest.approx(_reference_bits(model, text), rel=1e-5)


def test_a_one_byte_text_predicts_nothing():
    assert score_bits(Bigram(), b"a", seq_len=16) == (0.0, 0)


def test_a_uniform_model_costs_eight_bits_per_byte():
    model = Bigram()
    with torch.no_grad():
        model.table.zero_()
    bits, n = score_bits(model, b"hello, world! " * 5, seq_len=16)
    assert bits / n == pytest.approx(8.0)
