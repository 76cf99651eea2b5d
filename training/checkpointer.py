"""The training loop's checkpoints: where a run resumes from, and the async save it keeps in flight.

`Checkpointer` owns the state (the save in flight, the resume step); the launcher hooks say where checkpoint
directories live and what happens to a finished one: `LocalHooks` (torchrun, one process: a directory all ranks
share) or `RayHooks` (Ray Train: reported to the controller). The hooks are the only Ray-specific code here.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from training import checkpoint as ckpt
from training.checkpoint_async import AsyncSave
from training.config import TrainConfig


class LauncherHooks(Protocol):
    def resume_candidates(self) -> contextlib.AbstractContextManager[list[str]]: ...
    def new_dir(self, step: int, rank: int) -> str: ...
    def publish(self, directory: str, step: int, metrics: dict[str, float], rank: int) -> None: ...


class LocalHooks:
    """torchrun / single process: checkpoints live in `root/checkpoint_<step>` on a filesystem all ranks share."""

    def __init__(self, root: str, keep: int) -> None:
        self.root, self.keep = Path(root), keep

    @contextlib.contextmanager
    def resume_candidates(self) -> Iterator[list[str]]:
        yield [str(p) for p in self.root.glob("checkpoint_0*")] if self.root.is_dir() else []

    def new_dir(self, step: int, rank: int) -> str:
        return str(self.root / f"checkpoint_{step:08d}")

    def publish(self, directory: str, step: int, metrics: dict[str, float], rank: int) -> None:
        dist.barrier()
        if rank == 0:  # keep the newest N complete checkpoints
            done = sorted(self.root.glob("checkpoint_0*"))
            for old in done[: max(0, len(done) - self.keep)]:
                shutil.rmtree(old, ignore_errors=True)


class RayHooks:
    """Ray Train: resume from ray.train.get_checkpoint(); every rank reports its own files of a checkpoint."""

    def __init__(self) -> None:
        import ray.train

        self.train = ray.train

    @contextlib.contextmanager
    def resume_candidates(self) -> Iterator[list[str]]:
        """Ray's latest registered checkpoint, plus (local storage) every checkpoint directory of this run.

        The controller registers a reported checkpoint only at its next poll of the workers (every ~2 s); a
        worker killed in between leaves a complete but unregistered checkpoint, which the manifest vouches for.
        """
        dirs = []
        storage = self.train.get_context().get_storage()
        if storage.storage_filesystem.type_name == "local":
            dirs = [str(p) for p in Path(storage.experiment_fs_path).glob("checkpoint_0*") if p.is_dir()]
        checkpoint = self.train.get_checkpoint()
        if checkpoint is None:
            yield dirs
            return
        with checkpoint.as_directory() as d:  # a download for remote storage, the path itself when local
            yield [*dirs, d]

    def new_dir(self, step: int, rank: int) -> str:
        # Each rank writes into its own local directory; Ray merges them into one checkpoint in storage.
        return tempfile.mkdtemp(prefix=f"shardline-ckpt-{step:08d}-r{rank}-")

    def publish(self, directory: str, step: int, metrics: dict[str, float], rank: int) -> None:
        self.train.report(
            metrics,
            checkpoint=self.train.Checkpoint.from_directory(directory),
            checkpoint_dir_name=f"checkpoint_{step:08d}",
            delete_local_checkpoint_after_upload=True,
        )


def inside_ray_train() -> bool:
    """Whether this process is a Ray Train worker (else torchrun or a plain process)."""
    try:
        import ray.train

        ray.train.get_context()
        return True
    except Exception:  # noqa: BLE001 - not a Ray Train worker (ImportError, RuntimeError, ...)
        return False


class Checkpointer:
    """This rank's side of the run's checkpoints. Every method is a collective: all ranks call it at the same step.

    `restore()` loads the newest checkpoint complete on every rank. `save(step, last_step)` saves every
    `cfg.checkpoint_every` steps and at the last step. With `async_save` (default: on GPU) a save other than the
    last is staged to host memory and written in the background: one save is in flight at a time; it is
    published (manifest written, then handed to the launcher hooks with `report(step)`'s metrics) by the first
    `publish_finished()` after every rank's write has finished, or waited for by the next `save` or `close()`.
    """

    def __init__(
        self,
        hooks: LauncherHooks,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: TrainConfig,
        rank: int,
        world: int,
        device: torch.device,
        report: Callable[[int], dict[str, float]],
        async_save: bool | None = None,
    ) -> None:
        self.hooks, self.model, self.optimizer, self.cfg = hooks, model, optimizer, cfg
        self.rank, self.world, self.device, self.report = rank, world, device, report
        self.async_save = device.type == "cuda" if async_save is None else async_save
        self.resumed_from = 0  # the step this run restored (0: a fresh start); recorded in every manifest
        self.pending: AsyncSave | None = None
        # A separate (gloo) group: the background thread's collectives must not interleave with training's.
        self._save_group = dist.new_group(backend="gloo") if self.async_save else None

    def restore(self) -> tuple[int, int]:
        """(step to start from, this rank's data position) after loading the agreed checkpoint; (0, 0) if none.

        Raises:
            CheckpointError: this rank has no complete checkpoint of the step the ranks agreed on.
        """
        with self.hooks.resume_candidates() as candidates:
            found = ckpt.latest_complete(candidates)
            # Every rank must resume from the same step: agree on the smallest newest-complete step.
            agreed = torch.tensor([found[0] if found else 0], dtype=torch.int64, device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            step = int(agreed)
            if step == 0:
                return 0, 0
            if found is None or found[0] != step:
                found = ckpt.latest_complete(candidates, max_step=step)
            if found is None or found[0] != step:
                raise ckpt.CheckpointError(f"rank {self.rank}: no complete checkpoint of step {step} to resume")
            start, position = ckpt.load_checkpoint(found[1], self.model, self.optimizer, self.rank, self.world)
        self.resumed_from = start
        return start, position

    def publish_finished(self) -> None:
        """Call after every step: publish the save in flight once every rank's background write has finished."""
        if self.pending is None:
            return
        flag = torch.tensor([1.0 if self.pending.done() else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() == 1.0:
            self._wait_and_publish()

    def save(self, step: int, last_step: bool = False) -> None:
        """Save the state after `step` optimizer steps if it is a checkpoint step (every N, and the last)."""
        if step % self.cfg.checkpoint_every != 0 and not last_step:
            return
        self._wait_and_publish()  # one save in flight at a time
        directory = self.hooks.new_dir(step, self.rank)
        position = step * self.cfg.grad_accum  # micro batches this rank has consumed
        if self.async_save and not last_step:
            self.pending = AsyncSave.start(
                directory,
                self.model,
                self.optimizer,
                step,
                position,
                self.rank,
                self.world,
                self._save_group,
                resumed_from=self.resumed_from,
                threads=self.cfg.checkpoint_threads,
            )
        else:  # the last save is synchronous: the run returns only once its final checkpoint is published
            ckpt.save_checkpoint(
                directory,
                self.model,
                self.optimizer,
                step,
                position,
                self.rank,
                self.world,
                resumed_from=self.resumed_from,
                threads=self.cfg.checkpoint_threads,
            )
            self.hooks.publish(directory, step, self.report(step), self.rank)

    def close(self) -> None:
        """Wait for the save in flight, if any, and publish it."""
        self._wait_and_publish()

    def _wait_and_publish(self) -> None:
        if self.pending is not None:
            self.pending.finish()
            self.hooks.publish(
                str(self.pending.directory), self.pending.step, self.report(self.pending.step), self.rank
            )
            self.pending = None
