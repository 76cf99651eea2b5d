"""Sharded training checkpoints with torch.distributed.checkpoint (DCP), a per-rank manifest, and verification.

Layout of one checkpoint directory (Ray Train merges every rank's files into it):
    .metadata                   DCP's index of every tensor (written by rank 0 after all ranks wrote data)
    __<rank>_<n>.distcp         tensor data written by <rank>
    manifest.rank<rank>.json    written by <rank> AFTER its DCP files: names, sizes and XXH3-128 of them, and
                                an XXH3-64 of every tensor chunk taken in memory at save time (checkpoint_manifest.py)

The state holds tensors only: DCP pickles any non-tensor leaf, and we never unpickle data. Per-rank values
(RNG, data position) live under `rank<r>.` keys because DCP keeps one copy of a plain tensor per key.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.checkpoint_hashing import checksum_planner, writer
from training.checkpoint_manifest import (  # noqa: F401 - re-exported: the checkpoint API lives here
    MANIFEST_FORMAT,
    CheckpointError,
    CheckpointInfo,
    checked_load_planner,
    file_digest,
    file_record,
    manifest_name,
    tensor_checksum,
    verify_checkpoint,
    write_manifest,
)
from training.dcp_metadata import read_metadata, safe_reader

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
        "train": {
            "step": torch.tensor(step, dtype=torch.int64),
            "world_size": torch.tensor(world_size, dtype=torch.int64),
        },
        f"rank{rank}": mine,
    }


def save_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    data_position: int,
    rank: int,
    world_size: int,
    resumed_from: int = 0,
    threads: int = 1,
) -> None:
    """Collective: every rank writes its shards into `directory` (its own or a shared one), then its manifest.

    `threads` files per rank are written in parallel, each hashed as it is written; tensor checksums are taken
    by the writer threads just before each tensor is serialised.
    """
    import torch.distributed.checkpoint as dcp

    Path(directory).mkdir(parents=True, exist_ok=True)
    state = training_state(model, optimizer, step, data_position, rank, world_size)
    w, planner = writer(directory, files_per_rank(state, threads)), checksum_planner()
    # One rank has nothing to agree on: no_dist skips DCP's plan collectives (pickled plans through gloo).
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=w, planner=planner, no_dist=world_size == 1)
    write_manifest(directory, rank, world_size, step, resumed_from, files=w.fs.files, tensors=planner.tensors)


FILE_BYTES = 64 << 20  # at least this much of a rank's state per file: a file (and its fsync) per tensor costs more


def files_per_rank(state: dict[str, Any], threads: int) -> int:
    """Files (writer threads) for this rank's state: up to `threads`, one per FILE_BYTES of local tensor data.

    A small state in 8 files pays 8 opens, fsyncs and threads for nothing (demo state: 51 ms in one file vs 67 ms
    in eight, bench_checkpoint.py); a large one is written and checksummed in parallel.
    """

    def local_bytes(value: Any) -> int:
        if isinstance(value, dict):
            return sum(local_bytes(v) for v in value.values())
        if isinstance(value, torch.Tensor):
            t = value.to_local() if hasattr(value, "to_local") else value
            return t.numel() * t.element_size()
        return 0

    return max(1, min(threads, local_bytes(state) // FILE_BYTES))


# ---------------------------------------------------------------------------------------------------------
# Verify and load
# ---------------------------------------------------------------------------------------------------------


def _no_pickled_leaves(directory: str | os.PathLike) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    pickled = [
        k for k, v in read_metadata(directory).state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)
    ]
    if pickled:
        raise CheckpointError(f"{directory}: holds pickled (non-tensor) entries {pickled[:3]}; refusing to load")


def check_shapes(directory: str | os.PathLike, prefix: str, target: dict[str, Any]) -> None:
    """CheckpointError when the checkpoint's entries under `prefix` are not the model's: keys missing or unexpected
    (a model of another depth: DCP would load the keys both have and ignore the rest), or the first tensor whose
    saved (global) shape differs."""
    saved = read_metadata(directory).state_dict_metadata
    have = {k[len(prefix) :] for k in saved if k.startswith(prefix)}
    if set(target) != have:
        extra, missing = sorted(have - set(target)), sorted(set(target) - have)
        raise CheckpointError(f"{directory}: model keys differ: missing {missing[:5]}, unexpected {extra[:5]}")
    for key, value in target.items():
        md = saved.get(f"{prefix}{key}")
        shape = getattr(md, "size", None)
        if shape is not None and isinstance(value, torch.Tensor) and tuple(shape) != tuple(value.shape):
            raise CheckpointError(
                f"{directory}: tensor {prefix}{key} has shape {list(shape)} in the checkpoint but "
                f"{list(value.shape)} in the model; the checkpoint was saved from another model configuration"
            )


def _dcp_load(directory: str | os.PathLike, state: dict[str, Any], **kwargs: Any) -> None:
    """dcp.load with the save-time checksums checked; DCP's CheckpointException becomes a CheckpointError.

    torch's CheckpointException derives from BaseException, so it would slip past every `except Exception`.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=safe_reader(directory), planner=checked_load_planner(directory), **kwargs)
    except CheckpointException as e:
        failures = [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]
        ours = next((f for f in failures if isinstance(f, CheckpointError)), None)
        if ours is not None:
            raise CheckpointError(str(ours)) from None
        first = failures[0] if failures else e
        line = (str(first).strip().splitlines() or [type(first).__name__])[0]
        raise CheckpointError(f"{directory}: DCP could not load it: {type(first).__name__}: {line}") from None


def load_checkpoint(
    directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world_size: int
) -> tuple[int, int]:
    """Collective: restore model, optimizer and (same world size) this rank's RNG; return (step, data_position).

    The directory is verified first, and every tensor chunk read whole is checked against its save-time checksum.
    A different world size resumes model and optimizer (DCP reshards) and returns data position -1.

    Raises:
        CheckpointError: incomplete/corrupt checkpoint, or one saved from a model of another shape.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    info = verify_checkpoint(directory)
    _no_pickled_leaves(directory)
    state = training_state(model, optimizer, 0, 0, rank, world_size)
    check_shapes(directory, "model.", state["model"])
    osd_groups = get_optimizer_state_dict(model, optimizer)["param_groups"]
    same_world = info.world_size == world_size
    if not same_world:
        state.pop(f"rank{rank}")
    _dcp_load(directory, state)
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

    Verifies the checkpoint first, checks every chunk against its save-time checksum, and requires every tensor to
    be finite.

    Raises:
        CheckpointError: incomplete/corrupt checkpoint, keys or shapes that do not match the model, or NaN/inf
            values; the message names the file or tensor.
    """
    info = verify_checkpoint(directory)
    _no_pickled_leaves(directory)
    target = {k: v.detach().clone() for k, v in model.state_dict().items()}
    check_shapes(directory, "model.", target)
    state = {"model": target}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        _dcp_load(directory, state, no_dist=True)
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
            rel = entry.uri[len(prefix) :]
            if not rel or "/" in rel or rel in (".", ".."):
                continue  # a checkpoint is flat; nested keys are not ours
            (Path(tmp) / rel).write_bytes(storage.read_bytes(entry.uri))
        yield tmp
