"""Bits per byte on known inputs: uniform guessing is 8, a perfect predictor ~0, p=1/2 on the truth is 1."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from training.evaluate import bits_per_byte


class Uniform(nn.Module):
    def forward(self, idx):
        return torch.zeros(*idx.shape, 256)


class NextIsPlusOne(nn.Module):
    """Puts probability p on (byte + 1) % 256 and spreads the rest evenly."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, idx):
        probs = torch.full((*idx.shape, 256), (1 - self.p) / 255)
        probs.scatter_(-1, ((idx + 1) % 256).unsqueeze(-1), self.p)
        return probs.log()


COUNTING = bytes(range(200))  # every next byte is the previous + 1


def test_uniform_model_is_8_bits_per_byte():
    assert bits_per_byte(Uniform(), [b"hello world", COUNTING], seq_len=16) == pytest.approx(8.0)


def test_half_probability_on_the_truth_is_one_bit():
    assert bits_per_byte(NextIsPlusOne(0.5), [COUNTING], seq_len=32, batch_size=3) == pytest.approx(1.0)


def test_near_perfect_predictor_is_near_zero():
    p = 1 - 1e-6
    assert bits_per_byte(NextIsPlusOne(p), [COUNTING], seq_len=32) == pytest.approx(-math.log2(p), abs=1e-4)


def test_every_byte_after_the_first_of_a_text_is_counted_once():
    seen = []

    class Spy(Uniform):
        def forward(self, idx):
            seen.append(idx.shape)
            return super().forward(idx)

    bits_per_byte(Spy(), [bytes(100), bytes(5)], seq_len=32, batch_size=2)
    # 100 bytes -> windows starting at 0, 32, 64, 96 of 33, 33, 33, 4 bytes; 5 bytes -> one window of 5
    assert sum(b * t for b, t in seen) == 99 + 4


def test_max_batches_limits_the_work():
    calls = []

    class Spy(Uniform):
        def forward(self, idx):
            calls.append(idx.shape[0])
            return super().forward(idx)

    bits_per_byte(Spy(), [bytes(1000)], seq_len=16, batch_size=4, max_batches=2)
    assert calls == [4, 4]


def test_nothing_to_predict_is_an_error():
    with pytest.raises(ValueError, match="no held-out text"):
        bits_per_byte(Uniform(), [b"x", b""], seq_len=8)
