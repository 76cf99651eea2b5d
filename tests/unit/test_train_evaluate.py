"""Bits per byte on known inputs: uniform guessing is 8, a perfect predictor ~0, p=1/2 on the truth is 1."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from training.evaluate import bits_per_byte, sample_texts


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


def test_training_mode_is_restored_after_evaluation():
    model = NextIsPlusOne(0.5).train()
    bits_per_byte(model, [COUNTING], seq_len=32)
    assert model.training
    model.eval()
    bits_per_byte(model, [COUNTING], seq_len=32)
    assert not model.training


def test_max_texts_zero_or_covering_everything_keeps_every_text():
    texts = [bytes([i]) * 3 for i in range(10)]
    assert list(sample_texts(texts, 10, 0)) == texts
    assert list(sample_texts(texts, 10, 10)) == texts
    assert list(sample_texts(iter(texts), 10, 50)) == texts


def test_a_sample_is_spread_over_all_texts():
    texts = [bytes([i]) * 3 for i in range(10)]
    assert list(sample_texts(iter(texts), 10, 3)) == [texts[0], texts[4], texts[7]]
    assert list(sample_texts(iter(texts), 10, 4)) == [texts[0], texts[3], texts[5], texts[8]]
    for total in (1, 7, 100, 1000, 1001):
        for max_texts in (1, 2, 3, 9, 50, 600, 999):
            picked = list(sample_texts(range(total), total, max_texts))
            gap = math.ceil(total / max_texts)
            assert len(picked) == min(max_texts, total), (total, max_texts)  # as many as asked: what is logged
            assert picked[0] == 0 and picked[-1] >= total - gap  # reaches the last shard, not just the first


def test_a_sampled_evaluation_scores_only_the_sample():
    zeros = bytes(200)  # 0 after 0 gets (1 - 0.5) / 255: 1 + log2(255) bits
    zero_bits = 1 + math.log2(255)
    texts = [COUNTING, zeros, zeros, zeros]
    assert bits_per_byte(NextIsPlusOne(0.5), texts, seq_len=32) == pytest.approx((1.0 + 3 * zero_bits) / 4)
    sampled = bits_per_byte(NextIsPlusOne(0.5), sample_texts(texts, 4, 2), seq_len=32)  # texts 0 and 2
    assert sampled == pytest.approx((1.0 + zero_bits) / 2)


def test_nothing_to_predict_is_an_error():
    with pytest.raises(ValueError, match="no held-out text"):
        bits_per_byte(Uniform(), [b"x", b""], seq_len=8)
