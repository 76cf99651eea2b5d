"""build_shards: plan chunks -> write them in parallel (checked, split, sharded, counted back) -> stream the rows
through the quality gate -> digest -> (cache hit | gate verdict -> publish, manifest last).

Layout of an output location:
    {output}/{digest}/train-CCCCCC-NNNNNN.tar ... val-..., validation.json, manifest.json (written last)
    {output}/_staging/...   work in progress; never read as a dataset
Local outputs are built inside {output}/_staging and published with one directory rename. Object-store outputs
are built in a local temp directory (or, with data.engine='ray', uploaded by the Ray tasks themselves) into
{output}/_staging/build-{token}/, copied server-side into {output}/{digest}/, then the manifest is written; a set
without a manifest is invisible to readers.

Memory: the coordinator holds the plan of at most 2 x workers chunks, one quality-gate batch of rows and the
manifest's list of shards; each worker one record and its write buffers. Neither grows with the corpus' records.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import training.data.listing_index as listing_index
import training.data.quality as quality
from infra import storage
from infra.paths import shardline_home
from training.data.config import DataConfig
from training.data.corpus import Tally, no_usable_records
from training.data.engine import LocalPool, local_workers, ray_workers, run_chunks
from training.data.plan import plan_chunks
from training.data.publish import (
    STAGING,
    publish_local,
    publish_remote,
    reusable,
    shard_set_of,
    verify_published,
)
from training.data.readers import Source
from training.data.records import local_source
from training.data.shards import (
    MANIFEST_NAME,
    SPLITS,
    TOKENIZER_NAME,
    VALIDATION_NAME,
    Manifest,
    ShardEntry,
    SplitEntry,
    layout_of,
    manifest_of,
)
from training.data.shardset import DataError, ShardSet
from training.data.worker import ChunkJob, ChunkResult
from training.tokenizer import LAYOUT_KEYS

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def check_locations(cfg: DataConfig) -> None:
    """DataError when data.source or data.output is not a usable location (unsupported scheme, credentials in
    the URI, a local output inside the local source); the message never repeats a credential. Call before anything
    logs the config."""
    for field, value in (("data.source", cfg.source if not cfg.reader else ""), ("data.output", cfg.output)):
        if value and value != "stdlib":
            try:
                storage.parse(value)
            except storage.StorageError as err:
                raise DataError(f"{field}: {err}") from None
    _check_output_outside_source(cfg)


def _check_output_outside_source(cfg: DataConfig) -> None:
    """DataError when a local output is the local source or lies inside it: its shard sets (and _staging) would be
    listed as corpus by the next build, so the digest would change every run."""
    if cfg.reader or cfg.source == "stdlib" or not cfg.output:
        return
    source, output = storage.parse(cfg.source), storage.parse(cfg.output)
    if source.scheme != "file" or output.scheme != "file":
        return
    source_path, output_path = local_source(cfg.source).resolve(), Path(output.key).expanduser().resolve()
    if output_path.is_relative_to(source_path):
        raise DataError(
            f"data.output {output_path} is inside data.source {source_path}: its shard sets would be read back as "
            "corpus; choose an output outside the source"
        )


def resolve_output(cfg: DataConfig) -> str:
    """Where shard sets go: data.output, else $SHARDLINE_HOME/shards."""
    out = cfg.output or str(shardline_home() / "shards")
    loc = storage.parse(out)
    if loc.scheme == "file":  # absolute: Ray workers and later stages run with other working directories
        return str(Path(loc.key).expanduser().resolve())
    return out.rstrip("/")


def build_shards(cfg: DataConfig, tokenizer: Tokenizer | None = None) -> ShardSet:
    """Build (or find) the validated shard set of `cfg`'s corpus, data.workers chunks at a time. With a `tokenizer`
    every record also carries its token ids (`.ids`, stored as the manifest's layout.token_dtype), tokenized once
    here so that training workers never tokenize; the tokenizer's fingerprint is part of the set's layout and of its
    listing-index key.

    Returns:
        The published ShardSet; `cache_hit` is True when an identical verified set already existed.
    Raises:
        DataError: bad input under a `fail` policy, no usable records, an empty split, or a failed quality gate
            (quality.QualityError carries the full GX report).
        storage.StorageError: the output store failed for good (after data.storage_retries retries).
    """
    check_locations(cfg)
    output = resolve_output(cfg)
    remote = storage.is_remote(output)
    parent = (shardline_home() / "tmp") if remote else Path(output) / STAGING
    parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(parent)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=parent))
    tokens: Tokens | None = None
    if tokenizer is not None:
        from training.tokenizer import shard_layout

        tokens = Tokens(tokenizer.to_str(), shard_layout(tokenizer))
    try:
        return _build(cfg, output, remote, work, tokens)
    finally:
        shutil.rmtree(work, ignore_errors=True)


class Tokens(NamedTuple):
    """A tokenized build's tokenizer: its JSON for the workers, its layout entries for the manifest and the index."""

    json: str
    layout: dict[str, Any]


def _build(cfg: DataConfig, output: str, remote: bool, work: Path, tokens: Tokens | None) -> ShardSet:
    workers = local_workers(cfg.workers) if cfg.engine == "local" else 1
    with LocalPool(workers, cfg.chunk_bytes, auto=cfg.workers == 0) as pool:
        return _build_with(cfg, output, remote, work, pool, tokens)


def _build_with(
    cfg: DataConfig, output: str, remote: bool, work: Path, pool: LocalPool, tokens: Tokens | None
) -> ShardSet:
    spool = work / "listing.jsonl"  # the corpus is listed once: fingerprinted, then planned from the spool
    layout = tokens.layout if tokens else None
    listing_key = listing_index.fingerprint(cfg, spool, pool.listed, layout) if cfg.reuse_unchanged else None
    if listing_key and (found := _indexed(output, listing_key, cfg, layout_of(cfg, layout))) is not None:
        return found
    listing = None
    if listing_key:
        listing = listing_index.spooled_listing(spool)
        pool.listing_done()
    local_shards, gate_dir = work / "shards", work / "gate"
    local_shards.mkdir()
    gate_dir.mkdir()
    # Ray tasks may run on other machines: with an object-store output they upload their shards themselves.
    stage = storage.join(output, STAGING, f"build-{uuid.uuid4().hex[:12]}") if remote else ""
    tasks_upload = remote and cfg.engine == "ray"
    job = ChunkJob(
        cfg,
        shards=stage if tasks_upload else str(local_shards),
        rows=storage.join(stage, "rows") if tasks_upload else str(gate_dir),
        durable=not remote,
        tokenizer=tokens.json if tokens else "",
    )
    staged = tasks_upload  # whether _staging in the store may hold something of this build
    gate: quality.QualityGate | None = None
    try:
        gate = quality.QualityGate(cfg, gate_dir)
        manifest, tally, chunks, workers = _write_chunks(cfg, job, gate, listing, pool, layout)
        # the gate judges this build before a published set of the same digest is reused: the set was judged
        # under the settings of its own build, and a stricter data.split_tolerance since must still apply
        validation = json.dumps(gate.finish(), indent=1, sort_keys=True).encode()
        final = storage.join(output, manifest.dataset_digest)
        if reusable(final, manifest, cfg):
            _index(output, listing_key, manifest, tally, cfg)
            return shard_set_of(final, manifest, True, tally, chunks, workers)
        beside = {VALIDATION_NAME: validation, **({TOKENIZER_NAME: tokens.json.encode()} if tokens else {})}
        for name, data in beside.items():
            if tasks_upload:
                storage.write_bytes(storage.join(stage, name), data, cfg.storage_retries)
            else:
                (local_shards / name).write_bytes(data)
        if remote:
            publish_remote(None if tasks_upload else local_shards, stage, manifest, output, cfg.storage_retries)
        else:
            publish_local(local_shards, manifest, Path(final), cfg)
        _index(output, listing_key, manifest, tally, cfg)
        return shard_set_of(final, manifest, False, tally, chunks, workers)
    finally:
        if gate is not None:
            gate.close()
        if staged:
            try:
                storage.delete_prefix(stage, retries=1)
            except storage.StorageError:
                pass  # the store is down; _staging is never read as a dataset


def _indexed(output: str, key: str, cfg: DataConfig, layout: dict[str, Any]) -> ShardSet | None:
    """The set the listing index names for `key`, verified and of this build's tokenizer; None when there is none, it
    does not verify, or its manifest names another tokenizer (a set published before the tokenizer was part of the
    digest): the corpus is then read and the content digest decides. Other layout settings may differ: a set that
    other settings published with the same shards is this build's content (the digest names every shard), and
    requiring them equal re-read the whole corpus on every later run of those settings, for good."""
    entry = listing_index.lookup(output, key, cfg.storage_retries)
    if entry is None:
        return None
    final = storage.join(output, entry["dataset_digest"])
    manifest_uri = storage.join(final, MANIFEST_NAME)
    if not storage.exists(manifest_uri, cfg.storage_retries):
        return None
    try:
        manifest = Manifest.model_validate_json(storage.read_bytes(manifest_uri, cfg.storage_retries))
    except ValueError:
        return None  # damaged: build from the corpus, which republishes it
    if any(manifest.layout.get(k) != layout.get(k) for k in LAYOUT_KEYS):
        return None
    if verify_published(final, None, cfg.verify_existing, cfg.storage_retries) is not None:
        return None  # damaged or replaced: build from the corpus, which republishes it
    tally = Tally()
    tally.merge({str(k): int(v) for k, v in dict(entry.get("skipped") or {}).items()}, [])
    return shard_set_of(final, manifest, True, tally)


def _index(output: str, key: str | None, manifest: Manifest, tally: Tally, cfg: DataConfig) -> None:
    if key:
        listing_index.record(
            output, key, manifest.dataset_digest, dict(sorted(tally.skipped.items())), cfg.storage_retries
        )


def _write_chunks(
    cfg: DataConfig,
    job: ChunkJob,
    gate: quality.QualityGate,
    listing: Iterable[Source] | None,
    pool: LocalPool,
    tokens: dict[str, Any] | None,
) -> tuple[Manifest, Tally, int, int]:
    """Write every chunk (of `listing`, else of a new listing), feed their rows to the gate in corpus order; the
    manifest, what was skipped, the number of chunks and of workers."""
    workers = ray_workers(cfg.workers) if cfg.engine == "ray" else local_workers(cfg.workers)
    if cfg.engine == "local" and pool.not_worth_it:
        workers = 1  # a small corpus is written in this process (engine.LocalPool)
    shards: dict[str, list[ShardEntry]] = {split: [] for split in SPLITS}
    samples = dict.fromkeys(SPLITS, 0)
    tally, chunks = Tally(), 0
    with contextlib.closing(run_chunks(plan_chunks(cfg, listing), job, cfg.engine, workers, pool)) as results:
        for result in results:
            chunks += 1
            tally.merge(result.skipped, result.examples)
            for split in SPLITS:
                shards[split] += result.splits[split]
                samples[split] += result.samples[split]
            gate.add(_rows(result, cfg.storage_retries))
    total = sum(samples.values())
    if total == 0:
        raise no_usable_records(cfg, tally)
    for split in SPLITS:
        if samples[split] == 0:
            raise DataError(
                f"{cfg.source}: the {split} split is empty ({total} records, data.val_fraction="
                f"{cfg.val_fraction}, data.seed={cfg.seed}); add records or change val_fraction"
            )
    splits = {split: SplitEntry(num_samples=samples[split], shards=shards[split]) for split in SPLITS}
    return manifest_of(splits, cfg, tokens), tally, chunks, workers


def _rows(result: ChunkResult, retries: int) -> Iterator[dict[str, Any]]:
    """The chunk's per-record rows for the gate, with its shard's listed and read-back counts; then deleted."""
    listed = {entry.name: (split, entry.samples) for split in SPLITS for entry in result.splits[split]}
    with storage.open_read(result.rows_uri, retries) as fh:
        for line in fh:
            key, is_val, n_bytes, utf8_valid, shard = json.loads(line)
            split, count = listed[shard]
            yield {
                "key": key,
                "split": split,
                "is_val": is_val,
                "n_bytes": n_bytes,
                "utf8_valid": utf8_valid,
                "shard": f"{split}/{shard}",
                "shard_manifest_count": count,
                "shard_tar_count": result.tar_counts.get(shard, -1),
            }
    storage.delete(result.rows_uri, retries)


ABANDONED_AFTER_S = 24 * 3600


def _remove_abandoned(staging: Path) -> None:
    """Delete local build directories that a crashed run left in the staging area more than a day ago."""
    cutoff = time.time() - ABANDONED_AFTER_S
    for entry in staging.iterdir():
        try:
            if entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue  # removed concurrently
