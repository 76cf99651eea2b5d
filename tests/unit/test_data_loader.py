"""The streaming reader: equal batch counts per rank, worker/rank shard split, allow-list, byte blocks."""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path

import pytest
import torch
from support.data_helpers import config, make_corpus

from training.config import TrainConfig
from training.data import build_shards
from training.data.loader import byte_blocks, iter_texts, shards_for, train_batches


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    return build_shards(config(make_corpus(root / "c", n=80), root / "out", max_samples_per_shard=10))


def test_byte_blocks_are_shifted_pairs():
    records = [bytes(range(i, i + 50)) for i in range(0, 200, 50)]
    batches = list(byte_blocks(records, seq_len=9, batch_size=4))
    assert len(batches) == 200 // 40
    x, y = batches[0]
    assert x.shape == y.shape == (4, 9) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and x[0, 0].item() == 0 and y[0, -1].item() == 9


def test_iter_texts_returns_every_record_once(shard_set):
    texts = list(iter_texts(shard_set.train_shards + shard_set.val_shards))
    assert len(texts) == shard_set.num_train + shard_set.num_val
    assert len({k for k, _ in texts}) == len(texts)
    assert all(isinstance(t, bytes) and b"quick brown fox" in t for _, t in texts)


@pytest.mark.parametrize("workers", [0, 2])
def test_every_rank_gets_the_same_number_of_batches(shard_set, workers):
    cfg = TrainConfig(steps=7, grad_accum=2, micro_batch=4, seq_len=32)
    counts = []
    for rank in range(3):
        batches = list(train_batches(shard_set.train_shards, rank, 3, cfg, start_step=2, num_workers=workers))
        counts.append(len(batches))
        assert all(x.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1]) for x, y in batches)
    assert counts == [(7 - 2) * 2] * 3


def test_streams_are_seeded_by_rank_and_start_step(shard_set):
    cfg = TrainConfig(steps=4, micro_batch=2, seq_len=16)

    def first(rank, start):
        return next(iter(train_batches(shard_set.train_shards, rank, 2, cfg, start, num_workers=0)))[0]

    assert torch.equal(first(0, 0), first(0, 0))
    assert not torch.equal(first(0, 0), first(1, 0))
    assert not torch.equal(first(0, 0), first(0, 1))


def test_shards_are_split_disjointly_when_there_are_enough():
    shards = [f"s{i}" for i in range(7)]
    parts = [shards_for(shards, c, 3) for c in range(3)]
    assert sorted(sum(parts, [])) == shards and all(parts)
    assert shards_for(shards[:2], 2, 3) == shards[:2]  # fewer shards than consumers: all, resampled


class _Boom:
    def __reduce__(self):
        return (Path("/tmp/shardline-unpickled").write_text, ("pwned",))


def test_only_allow_listed_extensions_are_read_and_nothing_is_unpickled(tmp_path):
    shard = tmp_path / "evil.tar"
    with tarfile.open(shard, "w") as tar:
        for name, data in [("s1.txt", b"hello world, twelve"), ("s1.pyd", pickle.dumps(_Boom())), ("s2.pickle", b"x")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    Path("/tmp/shardline-unpickled").unlink(missing_ok=True)
    assert list(iter_texts([str(shard)])) == [("s1", b"hello world, twelve")]
    cfg = TrainConfig(steps=1, micro_batch=1, seq_len=8)
    assert len(list(train_batches([str(shard)], 0, 1, cfg, 0, num_workers=0))) == 1
    assert not Path("/tmp/shardline-unpickled").exists()


def test_a_shard_without_records_is_named_when_training_draws_it(shard_set, tmp_path):
    empty = tmp_path / "zz-empty.tar"
    tarfile.open(empty, "w").close()
    cfg = TrainConfig(workers=1, steps=2000, micro_batch=2, seq_len=16, seed=3)
    with pytest.raises(ValueError) as err:  # drawn at random, with replacement: within 2000 steps
        for _ in train_batches([*shard_set.train_shards, str(empty)], 0, 1, cfg, 0, num_workers=0):
            pass
    assert str(err.value) == f"train_batches: shard {empty} holds no .txt records"
