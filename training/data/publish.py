"""Publishing a built shard set and opening a published one (training/data/build.py builds it): a local set is
fsynced and renamed into place in one step, a remote one is uploaded (or copied server-side) and its manifest written
last; a set is trusted only once its manifest exists and verifies (sizes, and sha256 when asked)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from infra import storage
from training.data.config import DataConfig
from training.data.corpus import Tally
from training.data.shards import (
    MANIFEST_NAME,
    SPLITS,
    TOKENIZER_NAME,
    VALIDATION_NAME,
    Manifest,
    dataset_digest,
    digest_of,
)
from training.data.shardset import DataError, ShardSet

STAGING = "_staging"


def shard_set_of(
    final: str, manifest: Manifest, cache_hit: bool, tally: Tally | None, chunks: int = 0, workers: int = 0
) -> ShardSet:
    uris = {split: [storage.join(final, s.name) for s in manifest.splits[split].shards] for split in SPLITS}
    tokenized = bool(manifest.layout.get("tokenizer_sha256"))
    return ShardSet(
        dataset_digest=manifest.dataset_digest,
        uri=final,
        manifest_uri=storage.join(final, MANIFEST_NAME),
        train_shards=uris["train"],
        val_shards=uris["val"],
        num_train=manifest.splits["train"].num_samples,
        num_val=manifest.splits["val"].num_samples,
        total_bytes=manifest.total_bytes,
        cache_hit=cache_hit,
        skipped=dict(sorted(tally.skipped.items())) if tally else {},
        chunks=chunks,
        workers=workers,
        tokenizer_sha256=str(manifest.layout.get("tokenizer_sha256", "")),
        token_dtype=str(manifest.layout.get("token_dtype", "")),
        vocab_size=int(manifest.layout.get("vocab_size", 0)),
        tokenizer_uri=storage.join(final, TOKENIZER_NAME) if tokenized else "",
    )


def reusable(final: str, expected: Manifest, cfg: DataConfig) -> bool:
    """True when `final` holds a manifest of `expected`'s shards and every shard verifies (size, and sha256 unless
    data.verify_existing='size'); its layout may be another build's that gave the same set, and is kept. A manifest
    that does not verify is deleted so no reader trusts it (the damaged set is then published again)."""
    r = cfg.storage_retries
    manifest_uri = storage.join(final, MANIFEST_NAME)
    if not storage.exists(manifest_uri, r):
        return False
    if verify_published(final, expected, cfg.verify_existing, r) is None:
        return True
    storage.delete(manifest_uri, r)
    return False


def verify_published(final: str, expected: Manifest | None, mode: str, retries: int) -> str | None:
    """None when the set at `final` verifies against its manifest (and `expected`), else the first reason."""
    import hashlib

    try:
        published = Manifest.model_validate_json(storage.read_bytes(storage.join(final, MANIFEST_NAME), retries))
    except ValueError as err:
        return f"manifest does not parse ({str(err).splitlines()[0]})"
    # a tokenized set published before its tokenizer was part of the digest still names its shards alone
    digests = {digest_of(published.splits, published.layout), dataset_digest(published.splits)}
    if published.dataset_digest not in digests or not final.endswith(published.dataset_digest):
        return "manifest digest does not match its shards or its location"
    if expected is not None and published.splits != expected.splits:
        return "manifest lists different shards"
    # Another layout is not damage: the digest names the shards and the tokenizer, so the same digest from other
    # settings (a max_samples_per_shard the corpus never reaches) is the same set; it is reused, never rewritten.
    sizes = {e.uri: e.size for e in storage.list_prefix(final, retries)}
    if storage.join(final, VALIDATION_NAME) not in sizes:
        return f"{VALIDATION_NAME} missing"
    if published.layout.get("tokenizer_sha256"):
        reason = _tokenizer_problem(final, str(published.layout["tokenizer_sha256"]), sizes, retries)
        if reason:
            return reason
    for split in SPLITS:
        for shard in published.splits[split].shards:
            uri = storage.join(final, shard.name)
            if sizes.get(uri) != shard.bytes:
                return f"{uri}: size {sizes.get(uri)} != manifest {shard.bytes}"
            if mode == "sha256" and hashlib.sha256(storage.read_bytes(uri, retries)).hexdigest() != shard.sha256:
                return f"{uri}: sha256 does not match the manifest"
    return None


def _tokenizer_problem(final: str, expected: str, sizes: dict[str, int], retries: int) -> str | None:
    """None when a tokenized set's tokenizer.json is there and is the tokenizer its manifest names."""
    from training.tokenizer import fingerprint_json

    uri = storage.join(final, TOKENIZER_NAME)
    if uri not in sizes:
        return f"{TOKENIZER_NAME} missing"
    try:
        found = fingerprint_json(storage.read_bytes(uri, retries).decode("utf-8"))
    except ValueError:  # not UTF-8 or not JSON
        return f"{TOKENIZER_NAME} does not parse"
    return None if found == expected else f"{TOKENIZER_NAME} is not the tokenizer the manifest names"


def fsync_tree(directory: Path) -> None:
    """Flush every file in `directory` and the directory itself to disk (before it is renamed into place)."""
    for path in sorted(directory.iterdir()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(directory)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_local(work: Path, manifest: Manifest, final: Path, cfg: DataConfig) -> None:
    (work / MANIFEST_NAME).write_bytes(manifest.to_bytes())
    fsync_tree(work)  # a power cut after the rename must not leave a manifest over empty shards
    if final.exists():
        if reusable(str(final), manifest, cfg):  # an identical build published meanwhile: keep theirs
            return
        # A leftover without a valid manifest (a crash, or a manifest `reusable` removed): move it out of sight.
        stale = final.parent / STAGING / f"stale-{uuid.uuid4().hex[:8]}"
        os.rename(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(work, final)  # atomic: readers see the whole set or nothing
    except OSError:
        if not reusable(str(final), manifest, cfg):  # lost a race to an identical build: fine if it verifies
            raise
    fsync_dir(final.parent)


def publish_remote(local: Path | None, stage: str, manifest: Manifest, output: str, retries: int) -> None:
    """Put the set under {output}/{digest}, then write the manifest there, last.

    The manifest is the commit marker: readers (`reusable`, `load_shard_set`) trust a set only once it exists
    and verifies, so shards may be written straight to their final names. Built here (`local`), they are uploaded
    there directly: no staging copy, no server-side copy, so a private Azure account needs no SAS. Written by Ray
    tasks on other machines into `stage` (the digest is known only once every chunk is done), they are copied
    server-side (Azure: Copy Blob with a short-lived read SAS). The caller deletes `stage`.
    """
    final = storage.join(output, manifest.dataset_digest)
    names = [
        *manifest.shard_names(),
        VALIDATION_NAME,
        *([TOKENIZER_NAME] if manifest.layout.get("tokenizer_sha256") else []),
    ]
    for name in names:
        if local is not None:
            storage.upload_file(local / name, storage.join(final, name), retries)
        else:
            storage.copy(storage.join(stage, name), storage.join(final, name), retries)
    storage.write_bytes(storage.join(final, MANIFEST_NAME), manifest.to_bytes(), retries)


def load_shard_set(uri: str, verify: str = "size", retries: int = 5) -> ShardSet:
    """Open a published shard set by its prefix ({output}/{digest}); DataError when it has no valid manifest."""
    uri = uri.rstrip("/")
    if not storage.exists(storage.join(uri, MANIFEST_NAME), retries):
        raise DataError(f"{uri}: no {MANIFEST_NAME}; not a published shard set")
    reason = verify_published(uri, None, verify, retries)
    if reason:
        raise DataError(f"{uri}: {reason}")
    raw = storage.read_bytes(storage.join(uri, MANIFEST_NAME), retries)
    return shard_set_of(uri, Manifest.model_validate_json(raw), True, None)
