"""Seeded split, byte-reproducible WebDataset shard writing (per chunk), and the manifest with the dataset digest.

Which shard a record lands in is a function of the corpus alone: its chunk (a run of the sorted listing, see
plan.py), its split (a seeded hash of its key) and its position among the chunk's records of that split. Shards are
named `{split}-{chunk:06d}-{n:06d}.tar`, so chunks can be written by any number of processes and the set comes out
byte-identical.
"""

from __future__ import annotations

import hashlib
import json
import re
import tarfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel

from training.data.config import DataConfig
from training.data.corpus import Record
from training.data.tarwriter import TAR_BLOCK, TAR_RECORD, HashingFile, UstarWriter, regular_member_names

SHARD_FORMAT = "shardline.shards/2"  # 2: chunked layout
MANIFEST_NAME = "manifest.json"
VALIDATION_NAME = "validation.json"
TOKENIZER_NAME = "tokenizer.json"  # a tokenized set carries the tokenizer its .ids were made with
SPLITS = ("train", "val")
SAMPLE_FIELDS = ("txt", "ids", "json")  # the only extensions written (.ids only with a tokenizer)


def assign_split(key: str, seed: int, val_fraction: float) -> str:
    """'val' or 'train' from a seeded hash of the key alone: independent of order and of the other records."""
    h = int.from_bytes(hashlib.sha256(f"{seed}\x00{key}".encode()).digest()[:8], "big")
    return "val" if h / 2**64 < val_fraction else "train"


def tar_key(chunk: int, ordinal: int, key: str) -> str:
    """A WebDataset sample key: unique (chunk, ordinal), readable, no '.' (it separates key and extension), short."""
    tail = re.sub(r"[^A-Za-z0-9_-]+", "_", key).strip("_")[-60:]
    head = f"{chunk:06d}-{ordinal:07d}"
    return f"{head}_{tail}" if tail else head


def _tar_size(sample: dict[str, bytes]) -> int:
    return sum(TAR_BLOCK + -(-len(v) // TAR_BLOCK) * TAR_BLOCK for k, v in sample.items() if k != "__key__")


def _padded(entries: int) -> int:
    """File size of a tar with `entries` bytes of members: two end blocks, padded to whole records."""
    return -(-(entries + 2 * TAR_BLOCK) // TAR_RECORD) * TAR_RECORD


class ShardEntry(BaseModel):
    name: str
    samples: int
    bytes: int
    sha256: str


class SplitEntry(BaseModel):
    num_samples: int
    shards: list[ShardEntry]


class Manifest(BaseModel):
    """Written last into a shard set; its presence (and verification) is what makes a set readable."""

    format: str = SHARD_FORMAT
    dataset_digest: str
    splits: dict[str, SplitEntry]
    total_bytes: int
    layout: dict[str, Any]

    def shard_names(self) -> list[str]:
        return [s.name for split in SPLITS for s in self.splits[split].shards]

    def to_bytes(self) -> bytes:
        return (json.dumps(self.model_dump(), indent=1, sort_keys=True) + "\n").encode()


def dataset_digest(splits: dict[str, SplitEntry], tokenizer_sha256: str = "") -> str:
    """32 hex chars over every shard's name, count, size and sha256: the content and its layout; for a tokenized
    set also over its tokenizer's sha256. Two tokenizers can give the same ids on a corpus (one a superset of the
    other), and a set's ids are read back with the tokenizer it carries: without it, a build with the second
    published over the first's set under the same name. A text-only set's digest is unchanged."""
    canon: list[Any] = [SHARD_FORMAT]
    if tokenizer_sha256:
        canon.append(["tokenizer_sha256", tokenizer_sha256])
    canon += [[split, s.name, s.samples, s.bytes, s.sha256] for split in SPLITS for s in splits[split].shards]
    return hashlib.sha256(json.dumps(canon, separators=(",", ":")).encode()).hexdigest()[:32]


def digest_of(splits: dict[str, SplitEntry], layout: dict[str, Any]) -> str:
    """The dataset digest of a set with this manifest layout (its tokenizer, if any)."""
    return dataset_digest(splits, str(layout.get("tokenizer_sha256", "")))


def layout_of(cfg: DataConfig, tokens: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings that placed every record, and for a tokenized set what reads its ids back
    (training.tokenizer.shard_layout); a set without a tokenizer has no such keys, so its digest is unchanged."""
    from training.data.plan import CHUNK_MAX_ITEMS

    return (tokens or {}) | {
        "seed": cfg.seed,
        "val_fraction": cfg.val_fraction,
        "max_samples_per_shard": cfg.max_samples_per_shard,
        "max_shard_bytes": cfg.max_shard_bytes,
        "chunk_bytes": cfg.chunk_bytes,
        "chunk_max_items": CHUNK_MAX_ITEMS,
    }


@dataclass
class Written:
    """What write_shards produced in a local directory."""

    splits: dict[str, SplitEntry]

    def manifest(self, cfg: DataConfig, tokens: dict[str, Any] | None = None) -> Manifest:
        return manifest_of(self.splits, cfg, tokens)


def manifest_of(splits: dict[str, SplitEntry], cfg: DataConfig, tokens: dict[str, Any] | None = None) -> Manifest:
    total = sum(s.bytes for split in SPLITS for s in splits[split].shards)
    layout = layout_of(cfg, tokens)
    return Manifest(dataset_digest=digest_of(splits, layout), splits=splits, total_bytes=total, layout=layout)


class _SplitWriter:
    """The shards of one split of one chunk: a new shard before one would pass max_samples_per_shard or
    max_shard_bytes (a record never spans shards). Rollover is written here rather than with webdataset.ShardWriter
    because importing webdataset imports torch: +245 MB resident and ~1 s in every worker process (measured)."""

    def __init__(
        self,
        directory: Path,
        split: str,
        chunk: int,
        cfg: DataConfig,
        pool: Any,
        on_closed: Callable[[Path], None] | None,
        durable: bool,
    ) -> None:
        self.directory, self.split, self.chunk, self.cfg, self.pool = directory, split, chunk, cfg, pool
        self.on_closed, self.durable = on_closed, durable
        self.tar: UstarWriter | None = None
        self.closed: list[tuple[str, int, HashingFile]] = []
        self.name, self.count, self.size = "", 0, 0
        self.file: HashingFile | None = None

    def write(self, sample: dict[str, Any]) -> str:
        need = _tar_size(sample)
        if (
            self.tar is None
            or self.count >= self.cfg.max_samples_per_shard
            or (self.count > 0 and _padded(self.size + need) > self.cfg.max_shard_bytes)
        ):
            self._next()
        assert self.tar is not None  # _next() opened one
        self.tar.write(sample)
        self.size += need
        self.count += 1
        return self.name

    def _next(self) -> None:
        self._finish()
        if len(self.closed) >= 2:  # the shard before the one just closed is hashed and synced: while this one
            self.closed[-2][2].result()  # syncs the next is written, and memory stays bounded when the disk lags
        self.name = f"{self.split}-{self.chunk:06d}-{len(self.closed):06d}.tar"
        self.file = HashingFile(str(self.directory / self.name), self.pool, self.durable)
        self.tar, self.count, self.size = UstarWriter(self.file), 0, 0

    def _finish(self) -> None:
        if self.tar is None:
            return
        self.tar.close()
        assert self.file is not None  # an open tar has its file
        self.closed.append((self.name, self.count, self.file))
        self.tar = None
        if self.on_closed is not None:
            self.on_closed(self.directory / self.name)

    def abort(self) -> None:
        """Close the open shard file after a failure (its directory is thrown away)."""
        if self.tar is not None and self.file is not None:
            self.file.close()

    def close(self) -> list[ShardEntry]:
        self._finish()
        out = []
        for name, count, handle in self.closed:
            size, digest = handle.result()
            out.append(ShardEntry(name=name, samples=count, bytes=size, sha256=digest))
        return out


def write_shards(
    records: Iterable[Record],
    directory: Path,
    cfg: DataConfig,
    chunk: int = 0,
    rows: IO[str] | None = None,
    on_closed: Callable[[Path], None] | None = None,
    durable: bool = False,
    encode: Callable[[list[bytes]], list[bytes]] | None = None,
) -> Written:
    """Split and write one chunk's records as `{split}-{chunk}-NNNNNN.tar` shards (fields .txt and .json, and .ids,
    the record's token ids, when `encode` is given: training.tokenizer.batch_encoder) into a local directory.
    `rows` gets one JSON line per record for the quality gate: [key, is_val, n_bytes, utf8_valid, shard];
    `on_closed` is called with each shard's path once it is complete. `durable`: every shard is fsynced once
    closed, in the background while the next one is written."""
    directory.mkdir(parents=True, exist_ok=True)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-sha256")
    writers = {split: _SplitWriter(directory, split, chunk, cfg, pool, on_closed, durable) for split in SPLITS}
    ordinals = dict.fromkeys(SPLITS, 0)
    try:
        for rec, ids in with_ids(records, encode):
            split = assign_split(rec.key, cfg.seed, cfg.val_fraction)
            meta = {"key": rec.key, "split": split, "bytes": len(rec.data)}
            sample = {"__key__": tar_key(chunk, ordinals[split], rec.key), "txt": rec.data}
            if ids is not None:
                sample["ids"] = ids
            sample["json"] = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
            ordinals[split] += 1
            shard = writers[split].write(sample)
            if rows is not None:
                rows.write(json.dumps([rec.key, int(split == "val"), len(rec.data), _utf8(rec.data), shard]) + "\n")
        entries = {split: w.close() for split, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        pool.shutdown(wait=True)
    splits = {split: SplitEntry(num_samples=ordinals[split], shards=entries[split]) for split in SPLITS}
    return Written(splits=splits)


ENCODE_BATCH_RECORDS, ENCODE_BATCH_BYTES = 256, 8 << 20


def with_ids(
    records: Iterable[Record],
    encode: Callable[[list[bytes]], list[bytes]] | None,
    max_records: int = ENCODE_BATCH_RECORDS,
    max_bytes: int = ENCODE_BATCH_BYTES,
) -> Iterator[tuple[Record, bytes | None]]:
    """Each record with its stored token ids (None without `encode`). Records are encoded a batch at a time (up to
    `max_records` or `max_bytes`): the tokenizers library then spreads a batch over its threads, 2.5x
    one record at a time on one thread (bench/bench_tokenize.py); memory stays one batch of records."""
    if encode is None:
        yield from ((rec, None) for rec in records)
        return
    batch: list[Record] = []
    size = 0
    for rec in records:
        batch.append(rec)
        size += len(rec.data)
        if len(batch) >= max_records or size >= max_bytes:
            yield from zip(batch, encode([r.data for r in batch]), strict=True)
            batch, size = [], 0
    if batch:
        yield from zip(batch, encode([r.data for r in batch]), strict=True)


def _utf8(data: bytes) -> bool:
    if data.isascii():  # most text is; ~50x faster than a decode
        return True
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def count_samples(path: Path) -> int:
    """Distinct sample keys in a tar shard, read back from disk (what a reader will actually see)."""
    names = regular_member_names(str(path))
    if names is None:
        with tarfile.open(path, "r:") as tar:
            names = [member.name for member in tar if member.isfile()]
    return len({name.split(".", 1)[0] for name in names})
