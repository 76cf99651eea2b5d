"""Reuse without reading: a published shard set found by the listing of the corpus it was built from.

A shard set is named by the digest of its contents, so the only way to learn that a corpus would give an already
published set is to read and shard all of it: for a nightly run over a terabyte corpus that did not change, a night
of reading to reach a cache hit. The listing index records, beside the published sets,
`{output}/_index/{fingerprint}.json` -> the dataset digest, where the fingerprint covers

- every listed input's key, size and change stamp: for local files the modification and inode-change times in
  nanoseconds (the change time cannot be set back by `touch -d` or `os.utime`, so any write is seen), for S3 and
  Azure objects the ETag (new on every overwrite);
- every setting that shapes the shards (the data config without workers, engine, output, retries and verification
  options) and the shard format.

A run whose fingerprint is indexed opens that set, verifies it against its manifest (data.verify_existing), and
returns it as a cache hit without reading the corpus; a set that fails verification is ignored and the corpus is
read and built as usual. Plug-in readers (data.reader) list nothing and are never looked up.
`data.reuse_unchanged = false` turns the index off (the content digest then decides, after a full read).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from json.encoder import encode_basestring_ascii  # the C encoder json.dumps uses, called per string
from pathlib import Path
from typing import IO, Any

from infra import storage
from training.data.config import DataConfig
from training.data.readers import Source, list_sources
from training.data.records import Problem
from training.data.shards import SHARD_FORMAT

INDEX = "_index"
# Settings that decide where and how fast shards are written, never what they contain.
NOT_SHAPING = {
    "workers",
    "engine",
    "output",
    "storage_retries",
    "verify_existing",
    "gate_batch_records",
    "reuse_unchanged",
}


def fingerprint(
    cfg: DataConfig,
    spool: Path | None = None,
    on_listed: Callable[[int], None] | None = None,
    tokens: dict[str, Any] | None = None,
) -> str | None:
    """sha256 over the corpus listing and the shaping settings; None when it cannot stand for the corpus (a
    plug-in reader, or a listing that found problems such as unreadable directories, which a build reports).

    `spool`: a file that receives the listing as it is read (one JSON line per input), so that a build after a
    miss plans its chunks from exactly the listing that was fingerprinted, without listing the corpus again
    (`spooled_listing`). It is complete only when a fingerprint is returned. `on_listed` is called with the size
    of every input listed into the spool.
    """
    if cfg.reader:
        return None
    if spool is None:
        return _digest(cfg, list_sources(cfg), None, None, tokens)
    with open(spool, "w", encoding="utf-8") as fh:
        return _digest(cfg, list_sources(cfg), fh, on_listed, tokens)


def spooled_listing(spool: Path) -> Iterator[Source]:
    """The inputs `fingerprint` wrote to `spool`, in listing order."""
    with open(spool, encoding="utf-8") as fh:
        for line in fh:
            key, size, stamp, where = json.loads(line)
            yield Source(where, key, size, stamp)


def _digest(
    cfg: DataConfig,
    listing: Iterable[Source | Problem],
    spool: IO[str] | None,
    on_listed: Callable[[int], None] | None,
    tokens: dict[str, Any] | None,
) -> str | None:
    h = hashlib.sha256()
    settings = {k: v for k, v in cfg.model_dump().items() if k not in NOT_SHAPING} | (tokens or {})
    h.update(json.dumps([SHARD_FORMAT, settings], sort_keys=True).encode())
    for item in listing:  # streamed: memory does not grow with the listing
        if isinstance(item, Problem) or not item.stamp:
            return None
        line = json.dumps([item.key, item.size, item.stamp])
        h.update(line.encode() + b"\n")
        if spool is not None:  # the same line plus where to read it: [key, size, stamp, where]
            spool.write(f"{line[:-1]}, {encode_basestring_ascii(item.where)}]\n")
            if on_listed is not None:
                on_listed(item.size)
    return h.hexdigest()[:32]


def entry_uri(output: str, key: str) -> str:
    return storage.join(output, INDEX, f"{key}.json")


def lookup(output: str, key: str, retries: int) -> dict | None:
    """The index entry of `key` under `output` ({"dataset_digest", "skipped"}), or None when there is none or it
    does not parse (an entry is a hint: the set it names is verified before use)."""
    uri = entry_uri(output, key)
    if not storage.exists(uri, retries):
        return None
    try:
        entry = json.loads(storage.read_bytes(uri, retries))
    except ValueError:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("dataset_digest"), str):
        return None
    return entry


def record(output: str, key: str, dataset_digest: str, skipped: dict[str, int], retries: int) -> None:
    """Index the published set `dataset_digest` under the listing fingerprint `key` (after its manifest landed)."""
    body = json.dumps(
        {"dataset_digest": dataset_digest, "skipped": skipped, "format": SHARD_FORMAT}, sort_keys=True
    ).encode()
    storage.write_bytes(entry_uri(output, key), body, retries)
