"""Seeded split, byte-reproducible WebDataset shard writing, and the manifest with the dataset digest."""
from __future__ import annotations

import hashlib
import json
import re
import tarfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from training.data.config import DataConfig
from training.data.corpus import Record
from training.data.tarwriter import TAR_BLOCK, TAR_RECORD, HashingFile, shard_writer_class

SHARD_FORMAT = "shardline.shards/1"
MANIFEST_NAME = "manifest.json"
VALIDATION_NAME = "validation.json"
SPLITS = ("train", "val")
SAMPLE_FIELDS = ("txt", "json")  # the only extensions written, and the only ones the loader decodes


def assign_split(key: str, seed: int, val_fraction: float) -> str:
    """'val' or 'train' from a seeded hash of the key alone: independent of order and of the other records."""
    h = int.from_bytes(hashlib.sha256(f"{seed}\x00{key}".encode()).digest()[:8], "big")
    return "val" if h / 2**64 < val_fraction else "train"


def tar_key(ordinal: int, key: str) -> str:
    """A WebDataset sample key: unique (ordinal), readable, no '.' (it separates key and extension), short."""
    tail = re.sub(r"[^A-Za-z0-9_-]+", "_", key).strip("_")[-60:]
    return f"{ordinal:07d}_{tail}" if tail else f"{ordinal:07d}"


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


def dataset_digest(splits: dict[str, SplitEntry]) -> str:
    """32 hex chars over every shard's name, count, size and sha256: the content and its layout."""
    canon = [SHARD_FORMAT] + [[split, s.name, s.samples, s.bytes, s.sha256] for split in SPLITS
                              for s in splits[split].shards]
    return hashlib.sha256(json.dumps(canon, separators=(",", ":")).encode()).hexdigest()[:32]


def layout_of(cfg: DataConfig) -> dict[str, Any]:
    return {"seed": cfg.seed, "val_fraction": cfg.val_fraction, "max_samples_per_shard": cfg.max_samples_per_shard,
            "max_shard_bytes": cfg.max_shard_bytes}


@dataclass
class Written:
    """What write_shards produced in a local directory."""

    splits: dict[str, SplitEntry]
    rows: list[dict[str, Any]] = field(default_factory=list)  # per-record statistics for the quality gate

    def manifest(self, cfg: DataConfig) -> Manifest:
        total = sum(s.bytes for split in SPLITS for s in self.splits[split].shards)
        return Manifest(dataset_digest=dataset_digest(self.splits), splits=self.splits, total_bytes=total,
                        layout=layout_of(cfg))


class _SplitWriter:
    """A webdataset.ShardWriter for one split, opened on the first record, rolled over before a shard would pass
    max_shard_bytes (ShardWriter itself only checks the size after the fact)."""

    def __init__(self, directory: Path, split: str, cfg: DataConfig, pool: Any) -> None:
        self.directory, self.split, self.cfg, self.pool = directory, split, cfg, pool
        self.writer: Any = None
        self.files: dict[str, HashingFile] = {}
        self.counts: dict[str, int] = {}
        self.current = ""
        self.size = 0

    def write(self, sample: dict[str, Any]) -> str:
        need = _tar_size(sample)
        if self.writer is None:
            self.writer = shard_writer_class()(
                str(self.directory / f"{self.split}-%06d.tar"), maxcount=self.cfg.max_samples_per_shard,
                maxsize=float("inf"), verbose=0, opener=self._open, post=self._closed,
            )
        elif self.writer.count >= self.cfg.max_samples_per_shard or (
            self.writer.count > 0 and _padded(self.size + need) > self.cfg.max_shard_bytes
        ):
            self.writer.next_stream()
        if self.writer.count == 0:
            self.size = 0
        self.writer.write(sample)
        self.size += need
        self.current = self.writer.fname.rsplit("/", 1)[-1]
        self.counts[self.current] = self.counts.get(self.current, 0) + 1
        return self.current

    def _open(self, fname: str) -> HashingFile:
        self.files[Path(fname).name] = handle = HashingFile(fname, self.pool)
        return handle

    def _closed(self, fname: str) -> None:
        self.files[Path(fname).name].close()

    def close(self) -> list[ShardEntry]:
        if self.writer is not None:
            self.writer.close()
        out = []
        for name, count in sorted(self.counts.items()):
            size, digest = self.files[name].result()
            out.append(ShardEntry(name=name, samples=count, bytes=size, sha256=digest))
        return out


def write_shards(records: Iterable[Record], directory: Path, cfg: DataConfig) -> Written:
    """Split and write records as `{split}-NNNNNN.tar` shards (fields .txt and .json) into a local directory."""
    directory.mkdir(parents=True, exist_ok=True)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-sha256")
    writers = {split: _SplitWriter(directory, split, cfg, pool) for split in SPLITS}
    ordinals = dict.fromkeys(SPLITS, 0)
    rows = []
    try:
        for rec in records:
            split = assign_split(rec.key, cfg.seed, cfg.val_fraction)
            meta = {"key": rec.key, "split": split, "bytes": len(rec.data)}
            sample = {"__key__": tar_key(ordinals[split], rec.key), "txt": rec.data,
                      "json": json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()}
            ordinals[split] += 1
            shard = writers[split].write(sample)
            rows.append({"key": rec.key, "split": split, "is_val": int(split == "val"), "n_bytes": len(rec.data),
                         "utf8_valid": _utf8(rec.data), "shard": f"{split}/{shard}"})
    finally:
        try:
            entries = {split: w.close() for split, w in writers.items()}
        finally:
            pool.shutdown(wait=True)
    splits = {split: SplitEntry(num_samples=ordinals[split], shards=entries[split]) for split in SPLITS}
    return Written(splits=splits, rows=rows)


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
    keys = set()
    with tarfile.open(path, "r:") as tar:
        for member in tar:
            if member.isfile():
                keys.add(member.name.split(".", 1)[0])
    return len(keys)


def quality_rows(written: Written, directory: Path) -> list[dict[str, Any]]:
    """Per-record rows for the suite, with the manifest's and the tar's count of the record's shard."""
    listed = {f"{split}/{s.name}": s.samples for split in SPLITS for s in written.splits[split].shards}
    actual = {name: count_samples(directory / name.split("/", 1)[1]) for name in listed}
    return [{**row, "shard_manifest_count": listed[row["shard"]], "shard_tar_count": actual[row["shard"]]}
            for row in written.rows]

