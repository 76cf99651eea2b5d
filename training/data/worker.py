"""The work on one chunk, wherever it runs (this process, a worker process, a Ray task): read, check, split,
write its shards, count them back, and hand shards and per-record rows to where the coordinator reads them.

Imports stay light (no webdataset, torch, pandas or Great Expectations): every worker process pays for them.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from infra import storage
from training.data.config import DataConfig
from training.data.corpus import checked
from training.data.plan import Chunk
from training.data.readers import plugin_records, read_sources
from training.data.records import Tally
from training.data.shards import SPLITS, ShardEntry, count_samples, write_shards
from training.data.shardset import DataError


@dataclass(frozen=True)
class ChunkJob:
    """What every chunk of one build shares: the config and where shards and rows go. Each of `shards` and `rows`
    is a local directory the coordinator can read (this machine, or a shared filesystem) or an s3:// / az://
    staging prefix the worker uploads to. `durable`: fsync every shard as it is closed (the set is published from
    `shards` as it is; not when the shards are uploaded to an object store and deleted). `tokenizer`: a
    tokenizer.json's text, whose ids every record also gets as `.ids` ('' writes text only)."""

    cfg: DataConfig
    shards: str
    rows: str
    durable: bool = False
    tokenizer: str = ""


@dataclass
class ChunkResult:
    """One chunk's product: its shards per split, what the tar files hold when read back, what was skipped."""

    index: int
    splits: dict[str, list[ShardEntry]]
    samples: dict[str, int]
    tar_counts: dict[str, int]  # shard name -> samples read back from the written tar
    skipped: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)
    rows_uri: str = ""  # JSON lines [key, is_val, n_bytes, utf8_valid, shard] for the quality gate
    pid: int = 0

    @property
    def records(self) -> int:
        return sum(self.samples.values())


def rows_name(index: int) -> str:
    return f"rows-{index:06d}.jsonl"


def warm_up() -> int:
    """Nothing: submitted to a new worker process so that it starts (and imports this module) ahead of work."""
    return os.getpid()


def shard_chunk(chunk: Chunk, job: ChunkJob) -> ChunkResult:
    """Write chunk `chunk.index` of the corpus.

    Raises:
        DataError: a bad record under a `fail` policy (the first one of the chunk), or a local output that this
            process cannot see (a Ray node without the coordinator's filesystem).
        storage.StorageError: the corpus or the staging store failed for good.
    """
    from infra.credentials import adopt_worker_secrets

    adopt_worker_secrets()  # a Ray task of a run on the long-lived local head: the driver's store credentials
    cfg, tally = job.cfg, Tally()
    upload = storage.is_remote(job.shards)
    if not upload and not Path(job.shards).is_dir():
        raise DataError(
            f"data.output: {job.shards} does not exist on {socket.gethostname()}, where chunk {chunk.index} runs; "
            "with data.engine='ray' on a remote cluster use an s3:// or az:// output"
        )
    local = Path(tempfile.mkdtemp(prefix=f"shardline-chunk-{chunk.index:06d}-")) if upload else Path(job.shards)
    counts: dict[str, int] = {}

    def closed(path: Path) -> None:
        counts[path.name] = count_samples(path)  # headers only: tarfile seeks over the data
        if upload:  # bounded local disk: one shard per split at a time
            storage.upload_file(path, storage.join(job.shards, path.name), cfg.storage_retries)
            path.unlink()

    rows_path = (local if upload else Path(job.rows)) / rows_name(chunk.index)
    encode = None
    if job.tokenizer:
        from training.tokenizer import batch_encoder  # tokenizers and numpy: only in a tokenizing worker

        encode = batch_encoder(job.tokenizer)
    try:
        records = plugin_records(cfg) if chunk.plugin else read_sources(chunk.items, cfg)
        with open(rows_path, "w", encoding="utf-8") as rows:
            written = write_shards(
                checked(records, cfg, tally),
                local,
                cfg,
                chunk.index,
                rows,
                closed,
                durable=job.durable and not upload,
                encode=encode,
            )
        rows_uri = str(rows_path)
        if upload:
            rows_uri = storage.join(job.rows, rows_name(chunk.index))
            storage.upload_file(rows_path, rows_uri, cfg.storage_retries)
    finally:
        if upload:
            shutil.rmtree(local, ignore_errors=True)
    return ChunkResult(
        index=chunk.index,
        splits={s: written.splits[s].shards for s in SPLITS},
        samples={s: written.splits[s].num_samples for s in SPLITS},
        tar_counts=counts,
        skipped=dict(tally.skipped),
        examples=tally.examples,
        rows_uri=rows_uri,
        pid=os.getpid(),
    )
