"""build_shards: read -> split -> write shards locally -> digest -> (cache hit | validate -> publish, manifest last).

Layout of an output location:
    {output}/{digest}/train-000000.tar ... val-000000.tar, validation.json, manifest.json (written last)
    {output}/_staging/...   work in progress; never read as a dataset
Local outputs are built inside {output}/_staging and published with one directory rename. Object-store outputs
are built in a local temp directory, uploaded to {output}/_staging/{digest}-{token}/, copied server-side into
{output}/{digest}/, then the manifest is written; a set without a manifest is invisible to readers.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from infra import storage
from infra.paths import shardline_home
from training.data import quality
from training.data.config import DataConfig
from training.data.corpus import Tally, read_corpus
from training.data.shardset import DataError, ShardSet
from training.data.shards import MANIFEST_NAME, SPLITS, VALIDATION_NAME, Manifest, dataset_digest, quality_rows
from training.data.shards import write_shards

STAGING = "_staging"


def check_locations(cfg: DataConfig) -> None:
    """DataError when data.source or data.output is not a usable location (unsupported scheme, credentials in
    the URI); the message never repeats a credential. Call before anything logs the config."""
    for field, value in (("data.source", cfg.source if not cfg.reader else ""), ("data.output", cfg.output)):
        if value and value != "stdlib":
            try:
                storage.parse(value)
            except storage.StorageError as err:
                raise DataError(f"{field}: {err}") from None


def resolve_output(cfg: DataConfig) -> str:
    """Where shard sets go: data.output, else $SHARDLINE_HOME/shards."""
    out = cfg.output or str(shardline_home() / "shards")
    loc = storage.parse(out)
    if loc.scheme == "file":  # absolute: Ray workers and later stages run with other working directories
        return str(Path(loc.key).expanduser().resolve())
    return out.rstrip("/")


def build_shards(cfg: DataConfig) -> ShardSet:
    """Build (or find) the validated shard set of `cfg`'s corpus.

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
    tally = Tally()
    try:
        written = write_shards(read_corpus(cfg, tally), work, cfg)
        for split in SPLITS:
            if written.splits[split].num_samples == 0:
                total = sum(written.splits[s].num_samples for s in SPLITS)
                raise DataError(
                    f"{cfg.source}: the {split} split is empty ({total} records, data.val_fraction="
                    f"{cfg.val_fraction}, data.seed={cfg.seed}); add records or change val_fraction"
                )
        manifest = written.manifest(cfg)
        final = storage.join(output, manifest.dataset_digest)
        if _reusable(final, manifest, cfg):
            return _shard_set(final, manifest, True, tally)
        report = quality.check(quality_rows(written, work), cfg)
        (work / VALIDATION_NAME).write_bytes(json.dumps(report, indent=1, sort_keys=True).encode())
        if remote:
            _publish_remote(work, manifest, output, cfg.storage_retries)
        else:
            _publish_local(work, manifest, Path(final), cfg)
        return _shard_set(final, manifest, False, tally)
    finally:
        shutil.rmtree(work, ignore_errors=True)


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


def _shard_set(final: str, manifest: Manifest, cache_hit: bool, tally: Tally | None) -> ShardSet:
    uris = {split: [storage.join(final, s.name) for s in manifest.splits[split].shards] for split in SPLITS}
    return ShardSet(
        dataset_digest=manifest.dataset_digest, uri=final, manifest_uri=storage.join(final, MANIFEST_NAME),
        train_shards=uris["train"], val_shards=uris["val"], num_train=manifest.splits["train"].num_samples,
        num_val=manifest.splits["val"].num_samples, total_bytes=manifest.total_bytes, cache_hit=cache_hit,
        skipped=dict(sorted(tally.skipped.items())) if tally else {},
    )


def _reusable(final: str, expected: Manifest, cfg: DataConfig) -> bool:
    """True when `final` holds a manifest equal to `expected` and every shard verifies (size, and sha256 unless
    data.verify_existing='size'). A manifest that does not verify is deleted so no reader trusts it."""
    r = cfg.storage_retries
    manifest_uri = storage.join(final, MANIFEST_NAME)
    if not storage.exists(manifest_uri, r):
        return False
    if _verify(final, expected, cfg.verify_existing, r) is None:
        return True
    storage.delete(manifest_uri, r)
    return False


def _verify(final: str, expected: Manifest | None, mode: str, retries: int) -> str | None:
    """None when the set at `final` verifies against its manifest (and `expected`), else the first reason."""
    import hashlib

    try:
        published = Manifest.model_validate_json(storage.read_bytes(storage.join(final, MANIFEST_NAME), retries))
    except ValueError as err:
        return f"manifest does not parse ({str(err).splitlines()[0]})"
    if dataset_digest(published.splits) != published.dataset_digest or not final.endswith(published.dataset_digest):
        return "manifest digest does not match its shards or its location"
    if expected is not None and published.splits != expected.splits:
        return "manifest lists different shards"
    sizes = {e.uri: e.size for e in storage.list_prefix(final, retries)}
    if storage.join(final, VALIDATION_NAME) not in sizes:
        return f"{VALIDATION_NAME} missing"
    for split in SPLITS:
        for shard in published.splits[split].shards:
            uri = storage.join(final, shard.name)
            if sizes.get(uri) != shard.bytes:
                return f"{uri}: size {sizes.get(uri)} != manifest {shard.bytes}"
            if mode == "sha256" and hashlib.sha256(storage.read_bytes(uri, retries)).hexdigest() != shard.sha256:
                return f"{uri}: sha256 does not match the manifest"
    return None


def fsync_tree(directory: Path) -> None:
    """Flush every file in `directory` and the directory itself to disk (before it is renamed into place)."""
    for path in sorted(directory.iterdir()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish_local(work: Path, manifest: Manifest, final: Path, cfg: DataConfig) -> None:
    (work / MANIFEST_NAME).write_bytes(manifest.to_bytes())
    fsync_tree(work)  # a power cut after the rename must not leave a manifest over empty shards
    if final.exists():
        if _reusable(str(final), manifest, cfg):  # an identical build published meanwhile: keep theirs
            return
        # A leftover without a valid manifest (a crash, or a manifest _reusable removed): move it out of sight.
        stale = final.parent / STAGING / f"stale-{uuid.uuid4().hex[:8]}"
        os.rename(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(work, final)  # atomic: readers see the whole set or nothing
    except OSError:
        if not _reusable(str(final), manifest, cfg):  # lost a race to an identical build: fine if it verifies
            raise
    _fsync_dir(final.parent)


def _publish_remote(work: Path, manifest: Manifest, output: str, retries: int) -> None:
    final = storage.join(output, manifest.dataset_digest)
    stage = storage.join(output, STAGING, f"{manifest.dataset_digest}-{uuid.uuid4().hex[:8]}")
    names = [*manifest.shard_names(), VALIDATION_NAME]
    try:
        for name in names:
            storage.upload_file(work / name, storage.join(stage, name), retries)
        for name in names:
            storage.copy(storage.join(stage, name), storage.join(final, name), retries)
        storage.write_bytes(storage.join(final, MANIFEST_NAME), manifest.to_bytes(), retries)
    finally:
        try:
            storage.delete_prefix(stage, retries=1)
        except storage.StorageError:
            pass  # the store is down; _staging is never read as a dataset


def load_shard_set(uri: str, verify: str = "size", retries: int = 5) -> ShardSet:
    """Open a published shard set by its prefix ({output}/{digest}); DataError when it has no valid manifest."""
    uri = uri.rstrip("/")
    if not storage.exists(storage.join(uri, MANIFEST_NAME), retries):
        raise DataError(f"{uri}: no {MANIFEST_NAME}; not a published shard set")
    reason = _verify(uri, None, verify, retries)
    if reason:
        raise DataError(f"{uri}: {reason}")
    raw = storage.read_bytes(storage.join(uri, MANIFEST_NAME), retries)
    return _shard_set(uri, Manifest.model_validate_json(raw), True, None)
