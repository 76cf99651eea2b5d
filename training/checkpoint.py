"""Sharded training checkpoints with torch.distributed.checkpoint (DCP), a per-rank manifest, and verification.

Layout of one checkpoint directory (Ray Train merges every rank's files into it):
    .metadata                   DCP's index of every tensor (written by rank 0 after all ranks wrote data)
    __<rank>_<n>.distcp         tensor data written by <rank>
    manifest.rank<rank>.json    written by <rank> AFTER its DCP files: names, byte sizes and sha256 of them

The state holds tensors only: DCP pickles any non-tensor leaf, and we never unpickle data. Per-rank values
(RNG, data position) live under `rank<r>.` keys because DCP keeps one copy of a plain tensor per key.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import pickle
import tempfile
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.dcp_metadata import METADATA_FILE, read_metadata, safe_reader

MANIFEST_FORMAT = "shardline-dcp-manifest/1"


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, corrupt or does not fit the model; the message names the file."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What verify_checkpoint found: the training step, the world size that wrote it, its files and size."""

    path: str
    step: int
    world_size: int
    files: int
    total_bytes: int


def manifest_name(rank: int) -> str:
    return f"manifest.rank{rank:05d}.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------------------

def training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int, data_position: int, rank: int, world_size: int
) -> dict[str, Any]:
    """The DCP state dict of one rank: tensors only, per-rank values under `rank<r>`."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    mine = {
        "data_position": torch.tensor(data_position, dtype=torch.int64),
        "rng_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mine["rng_cuda"] = torch.cuda.get_rng_state()
    return {
        "model": get_model_state_dict(model),
        # param_groups hold floats and tuples (DCP would pickle them); they are rebuilt from the config.
        "optim": get_optimizer_state_dict(model, optimizer)["state"],
        "train": {"step": torch.tensor(step, dtype=torch.int64),
                  "world_size": torch.tensor(world_size, dtype=torch.int64)},
        f"rank{rank}": mine,
    }


def write_manifest(
    directory: str | os.PathLike, rank: int, world_size: int, step: int, resumed_from: int = 0
) -> Path:
    """Record the size and sha256 of the files `rank` wrote; written last, atomically (tmp + rename).

    `resumed_from` is the step this rank's run (attempt) started from: 0, or the checkpoint it resumed.
    """
    d = Path(directory)
    names = sorted(p.name for p in d.iterdir() if p.name.startswith(f"__{rank}_") and p.is_file())
    if rank == 0:
        if not (d / METADATA_FILE).is_file():
            raise CheckpointError(f"{d / METADATA_FILE}: missing after save; DCP did not finish")
        names.append(METADATA_FILE)
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(names)))) as pool:  # hashlib releases the GIL
        digests = dict(zip(names, pool.map(lambda n: _sha256(d / n), names)))
    files = {n: {"bytes": (d / n).stat().st_size, "sha256": digests[n]} for n in names}
    body = {"format": MANIFEST_FORMAT, "rank": rank, "world_size": world_size, "step": step,
            "resumed_from": resumed_from, "files": files}
    tmp = d / f".{manifest_name(rank)}.tmp"
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, d / manifest_name(rank))
    return d / manifest_name(rank)


def _writer(directory: str | os.PathLike, threads: int) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    # sync_files: fsync before the manifest claims the files are there.
    return FileSystemWriter(str(directory), thread_count=threads, sync_files=True, overwrite=True)


def save_checkpoint(
    directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
    data_position: int, rank: int, world_size: int, resumed_from: int = 0, threads: int = 1,
) -> None:
    """Collective: every rank writes its shards into `directory` (its own or a shared one), then its manifest.

    `threads` files per rank are written (and later hashed) in parallel.
    """
    import torch.distributed.checkpoint as dcp

    Path(directory).mkdir(parents=True, exist_ok=True)
    state = training_state(model, optimizer, step, data_position, rank, world_size)
    dcp.save(state, storage_writer=_writer(directory, threads))
    write_manifest(directory, rank, world_size, step, resumed_from)


def _pinned_stager() -> Any:
    """A GPU->CPU stager into pinned host buffers (faster copies than pageable memory); None if torch lacks one.

    Staging is synchronous (async_save returns once the copy is done), so the optimizer may update the
    parameters right after; the write to disk runs in the background. One stager per save: torch 2.11's
    stager fails when its cached buffers are reused for DTensor state.
    """
    if not torch.cuda.is_available():
        return None
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return None
    return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=True))


class AsyncSave:
    """A DCP save running in a background thread (GPU: tensors are staged to CPU before `start` returns).

    `done()` is rank-local; `finish()` waits for the write and then writes this rank's manifest.
    `pinned` says whether staging went through pinned host memory (else pageable, the fallback).
    """

    def __init__(self, directory: str | os.PathLike, step: int, rank: int, world_size: int, future: Any,
                 resumed_from: int = 0) -> None:
        self.directory, self.step, self.rank, self.world_size = directory, step, rank, world_size
        self._future, self.resumed_from = future, resumed_from
        self.pinned, self._stager = False, None

    @classmethod
    def start(
        cls, directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
        data_position: int, rank: int, world_size: int, process_group: Any, resumed_from: int = 0,
        threads: int = 1,
    ) -> "AsyncSave":
        import torch.distributed.checkpoint as dcp

        Path(directory).mkdir(parents=True, exist_ok=True)
        state = training_state(model, optimizer, step, data_position, rank, world_size)
        # A separate (gloo) group: the background thread's collectives must not interleave with training's.
        save = functools.partial(dcp.async_save, state, process_group=process_group)
        stager = _pinned_stager()
        try:
            future = save(storage_writer=_writer(directory, threads), async_stager=stager)
        except (KeyError, TypeError, RuntimeError) as e:
            if stager is None:
                raise
            # Some torch versions' pinned stager cannot deep-copy DTensor state; plain staging can.
            logging.getLogger(__name__).warning("pinned staging failed (%r); staging to pageable memory", e)
            stager.close()
            stager = None
            future = save(storage_writer=_writer(directory, threads), async_stager=None)
        future = getattr(future, "upload_completion", future)
        saved = cls(directory, step, rank, world_size, future, resumed_from)
        saved.pinned, saved._stager = stager is not None, stager
        return saved

    def done(self) -> bool:
        return self._future.done()

    def finish(self) -> None:
        self._future.result()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        write_manifest(self.directory, self.rank, self.world_size, self.step, self.resumed_from)


# ---------------------------------------------------------------------------------------------------------
# Verify and load
# ---------------------------------------------------------------------------------------------------------

def verify_checkpoint(directory: str | os.PathLike) -> CheckpointInfo:
    """Check that a checkpoint directory is complete and intact; return its step and size.

    Complete means: a manifest from every rank 0..W-1 (W read from the manifests), every file a manifest
    names present with its recorded size and sha256, and every file DCP's .metadata names present with
    enough bytes for the (offset, length) it records. The .metadata is itself a pickle written by torch; it
    is read only AFTER its checksum matched rank 0's manifest, and through an allow-list unpickler.

    Raises:
        CheckpointError: the first problem found, naming the file.
    """
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"{d}: no such checkpoint directory")
    manifests = sorted(d.glob("manifest.rank*.json"))
    if not manifests:
        raise CheckpointError(f"{d}: no manifest; the checkpoint is partial or not a shardline checkpoint")
    bodies = {}
    for m in manifests:
        try:
            body = json.loads(m.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{m}: unreadable manifest: {e}") from None
        if body.get("format") != MANIFEST_FORMAT:
            raise CheckpointError(f"{m}: unknown manifest format {body.get('format')!r}")
        bodies[int(body["rank"])] = body
    world = {int(b["world_size"]) for b in bodies.values()}
    steps = {int(b["step"]) for b in bodies.values()}
    if len(world) != 1 or len(steps) != 1:
        raise CheckpointError(f"{d}: manifests disagree (world sizes {sorted(world)}, steps {sorted(steps)})")
    (world_size,), (step,) = world, steps
    missing = sorted(set(range(world_size)) - set(bodies))
    if missing:
        raise CheckpointError(f"{d}: no manifest from rank(s) {missing} of {world_size}; the checkpoint is partial")
    sizes: dict[str, int] = {}
    expected: dict[str, tuple[int, str]] = {}
    for rank in sorted(bodies):
        for name, rec in bodies[rank]["files"].items():
            f = d / name
            if Path(name).name != name:
                raise CheckpointError(f"{d / manifest_name(rank)}: file name {name!r} is not a plain name")
            if not f.is_file():
                raise CheckpointError(f"{f}: missing (named by {manifest_name(rank)})")
            size = f.stat().st_size
            if size != rec["bytes"]:
                raise CheckpointError(f"{f}: {size} bytes, manifest says {rec['bytes']}")
            sizes[name] = size
            expected[name] = (rank, rec["sha256"])
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(expected)))) as pool:
        digests = dict(zip(expected, pool.map(lambda n: _sha256(d / n), expected)))
    for name, (rank, sha) in sorted(expected.items()):
        if digests[name] != sha:
            raise CheckpointError(f"{d / name}: sha256 does not match {manifest_name(rank)}")
    if METADATA_FILE not in sizes:
        raise CheckpointError(f"{d / METADATA_FILE}: not named by rank 0's manifest")
    try:
        md = read_metadata(d)
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        raise CheckpointError(f"{d / METADATA_FILE}: unreadable: {e}") from None
    for index, info in (md.storage_data or {}).items():
        rel = str(info.relative_path)
        have = sizes.get(rel)
        if have is None:
            have = (d / rel).stat().st_size if (d / rel).is_file() else None
        if have is None:
            raise CheckpointError(f"{d / rel}: missing (named by {METADATA_FILE} for {index.fqn})")
        if have < info.offset + info.length:
            raise CheckpointError(
                f"{d / rel}: {have} bytes, {METADATA_FILE} needs {info.offset + info.length} for {index.fqn}"
            )
    return CheckpointInfo(str(d), step, world_size, len(sizes), sum(sizes.values()))


def _no_pickled_leaves(directory: str | os.PathLike) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    pickled = [k for k, v in read_metadata(directory).state_dict_metadata.items()
               if isinstance(v, BytesStorageMetadata)]
    if pickled:
        raise CheckpointError(f"{directory}: holds pickled (non-tensor) entries {pickled[:3]}; refusing to load")


def load_checkpoint(
    directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world_size: int
) -> tuple[int, int]:
    """Collective: restore model, optimizer and (same world size) this rank's RNG; return (step, data_position).

    The directory is verified first. A different world size resumes model and optimizer (DCP reshards) and
    derives the data position from the step.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    info = verify_checkpoint(directory)
    _no_pickled_leaves(directory)
    state = training_state(model, optimizer, 0, 0, rank, world_size)
    osd_groups = get_optimizer_state_dict(model, optimizer)["param_groups"]
    same_world = info.world_size == world_size
    if not same_world:
        state.pop(f"rank{rank}")
    dcp.load(state, storage_reader=safe_reader(directory))
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
    set_optimizer_state_dict(model, optimizer, {"state": state["optim"], "param_groups": osd_groups})
    step = int(state["train"]["step"])
    if not same_world:
        return step, -1
    mine = state[f"rank{rank}"]
    torch.set_rng_state(mine["rng_cpu"])
    if "rng_cuda" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine["rng_cuda"])
    return step, int(mine["data_position"])


def load_unsharded(model: nn.Module, directory: str | os.PathLike) -> CheckpointInfo:
    """Load a checkpoint's model weights into a plain (unsharded) model, without a process group.

    Verifies the checkpoint first and requires every tensor to be finite.

    Raises:
        CheckpointError: incomplete/corrupt checkpoint, keys that do not match the model, or NaN/inf values.
    """
    import torch.distributed.checkpoint as dcp

    info = verify_checkpoint(directory)
    _no_pickled_leaves(directory)
    target = {k: v.detach().clone() for k, v in model.state_dict().items()}
    have = {k[len("model."):] for k in read_metadata(directory).state_dict_metadata if k.startswith("model.")}
    if set(target) != have:
        extra, missing = sorted(have - set(target)), sorted(set(target) - have)
        raise CheckpointError(f"{directory}: model keys differ: missing {missing[:5]}, unexpected {extra[:5]}")
    state = {"model": target}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=safe_reader(directory), no_dist=True)
    bad = [k for k, v in state["model"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"{directory}: non-finite values in {bad[:5]}")
    model.load_state_dict(state["model"], strict=True)
    return info


def _manifest_step(directory: str) -> int:
    try:
        return int(json.loads((Path(directory) / manifest_name(0)).read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def latest_complete(directories: list[str], max_step: int | None = None) -> tuple[int, str] | None:
    """(step, directory) of the newest checkpoint that verifies (at most `max_step`); None when none does.

    Candidates are verified newest first (by the step their rank-0 manifest claims), stopping at the first
    complete one, so older checkpoints are not hashed.
    """
    ordered = sorted(((_manifest_step(d), d) for d in directories), reverse=True)
    for claimed, d in ordered:
        if claimed < 0 or (max_step is not None and claimed > max_step):
            continue
        try:
            return verify_checkpoint(d).step, d
        except CheckpointError:
            continue
    return None


@contextlib.contextmanager
def local_copy(uri: str) -> Iterator[str]:
    """A local directory holding the checkpoint at `uri`: the path itself when local, else a temporary download."""
    from infra import storage

    if not storage.is_remote(uri):
        yield storage.parse(uri).key
        return
    prefix = uri.rstrip("/") + "/"
    with tempfile.TemporaryDirectory(prefix="shardline-ckpt-") as tmp:
        for entry in storage.list_prefix(uri):
            rel = entry.uri[len(prefix):]
            if not rel or "/" in rel or rel in (".", ".."):
                continue  # a checkpoint is flat; nested keys are not ours
            (Path(tmp) / rel).write_bytes(storage.read_bytes(entry.uri))
        yield tmp
