"""Streaming WebDataset reader for training (per rank and DataLoader worker, resampled) and for evaluation.

Only the extensions in ALLOWED are taken out of a shard, as raw bytes; nothing is decoded by webdataset's
auto-decoders and nothing is unpickled. A tokenized set (ShardSet.token_dtype) is read from its .ids, token ids
stored as little-endian integers, so training never tokenizes.
"""

from __future__ import annotations

import functools
import gc
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from training.config import TrainConfig

ALLOWED = frozenset({"txt", "ids"})


def _select(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return "." in base and base.split(".", 1)[1] in ALLOWED


def iter_samples(shard_uri: str) -> Iterator[dict[str, Any]]:
    """Samples of one shard ({'__key__', 'txt'}), streamed from a local path, s3:// or az://."""
    from webdataset.tariterators import group_by_keys, tar_file_expander, url_opener

    from infra import storage

    storage.register_gopen()
    yield from group_by_keys(tar_file_expander(url_opener([{"url": shard_uri}]), select_files=_select))


def iter_texts(shard_uris: Iterable[str], field: str = "txt") -> Iterator[tuple[str, bytes]]:
    """(sample key, text bytes) of every record, shards in the given order, records in shard order; with
    field='ids', the record's stored token ids instead."""
    for uri in shard_uris:
        for sample in iter_samples(uri):
            if field in sample:
                yield sample["__key__"], bytes(sample[field])


def byte_blocks(records: Iterable[bytes], seq_len: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Concatenate records into one byte stream and cut it into [batch_size, seq_len] input/target pairs.

    Yields:
        (x, y): int64 tensors of byte values 0..255, y[:, t] = x[:, t + 1] within the same block of seq_len + 1.
    """
    need = batch_size * (seq_len + 1)
    buf = bytearray()
    for rec in records:
        buf += rec
        while len(buf) >= need:
            block = torch.frombuffer(bytearray(buf[:need]), dtype=torch.uint8).view(batch_size, seq_len + 1).long()
            del buf[:need]
            yield block[:, :-1].contiguous(), block[:, 1:].contiguous()


def token_blocks(
    records: Iterable[bytes], seq_len: int, batch_size: int, dtype: str = "<u2"
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """byte_blocks for stored token ids (`dtype`, ShardSet.token_dtype): records are concatenated into one id
    stream and cut into [batch_size, seq_len] input/target pairs of int64 ids."""
    width = np.dtype(dtype).itemsize
    need = batch_size * (seq_len + 1) * width
    buf = bytearray()
    for rec in records:
        buf += rec
        while len(buf) >= need:
            ids = np.frombuffer(bytes(buf[:need]), dtype=dtype).astype(np.int64)
            del buf[:need]
            block = torch.from_numpy(ids).view(batch_size, seq_len + 1)
            yield block[:, :-1].contiguous(), block[:, 1:].contiguous()


def shards_for(shard_uris: list[str], consumer: int, consumers: int) -> list[str]:
    """This consumer's shards: a disjoint round-robin slice when there are enough, else all (seeds differ)."""
    shards = sorted(shard_uris)
    return shards[consumer::consumers] if len(shards) >= consumers else shards


class RankStream(torch.utils.data.IterableDataset):
    """A fixed number of batches for one rank, split over the DataLoader workers, from resampled shards."""

    def __init__(
        self,
        shard_uris: list[str],
        rank: int,
        world_size: int,
        cfg: TrainConfig,
        start_step: int,
        batches: int,
        token_dtype: str = "",
    ) -> None:
        super().__init__()
        if not shard_uris:
            raise ValueError("train_batches: no shards to read")
        if not 0 <= rank < world_size:
            raise ValueError(f"train_batches: rank {rank} outside world size {world_size}")
        self.shard_uris, self.rank, self.world_size = list(shard_uris), rank, world_size
        self.cfg, self.start_step, self.batches, self.token_dtype = cfg, start_step, batches, token_dtype

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        from training.data.corpus import load_callable

        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        mine = self.batches // workers + (1 if worker < self.batches % workers else 0)
        shards = shards_for(self.shard_uris, self.rank * workers + worker, self.world_size * workers)
        rng = random.Random(f"{self.cfg.seed}:{self.rank}:{self.start_step}:{worker}")
        make_batches: Callable[..., Iterator[tuple[torch.Tensor, torch.Tensor]]]
        make_batches = load_callable(self.cfg.batch_format, "train.batch_format")
        if self.token_dtype and make_batches is byte_blocks:
            make_batches = functools.partial(token_blocks, dtype=self.token_dtype)
        field = "ids" if self.token_dtype else "txt"  # a plug-in batch_format gets the stored ids of a tokenized set
        stream = make_batches(_resampled(shards, rng, field), self.cfg.seq_len, self.cfg.micro_batch)
        for _ in range(mine):
            yield next(stream)


def _resampled(shards: list[str], rng: random.Random, field: str = "txt") -> Iterator[bytes]:
    """Endless records: pick a shard at random (with replacement), yield its records in a shuffled order."""
    while True:
        shard = rng.choice(shards)
        texts = [text for _, text in iter_texts([shard], field)]
        if not texts:
            raise ValueError(f"train_batches: shard {shard} holds no .{field} records")
        rng.shuffle(texts)
        yield from texts


def train_batches(
    shard_uris: list[str],
    rank: int,
    world_size: int,
    cfg: TrainConfig,
    start_step: int = 0,
    *,
    batches: int | None = None,
    num_workers: int = 1,
    token_dtype: str = "",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The (x, y) micro batches of one rank: its own shards, resampled, seeded by (seed, rank, start_step, worker).

    Every rank gets exactly `batches` micro batches (default: the micro batches left to train,
    (cfg.steps - start_step) * cfg.grad_accum), so no rank waits on another at the end. `num_workers`
    DataLoader processes read in the background (0 reads in this process); shards are split by rank and worker.
    `token_dtype` (ShardSet.token_dtype): read a tokenized set's .ids, cut by token_blocks.
    """
    if batches is None:
        batches = max(0, cfg.steps - start_step) * cfg.grad_accum
    dataset = RankStream(shard_uris, rank, world_size, cfg, start_step, batches, token_dtype)
    if num_workers == 0:
        yield from dataset
        return
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=num_workers, prefetch_factor=4)
    # The workers are forked here. Garbage of this process must not be finalised in them: a process group left
    # for the GC (e.g. one destroyed earlier in this process) would run its destructor in a child where its gloo
    # threads do not exist, and hang there. Frozen objects are never collected by the children (CPython's advice
    # for fork); this process unfreezes and collects them as usual.
    gc.freeze()
    try:
        batches_of_workers = iter(loader)
    finally:
        gc.unfreeze()
    yield from batches_of_workers
