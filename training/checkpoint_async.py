"""A DCP checkpoint saved in the background (training/checkpointer.py drives it): the state is staged before `start`
returns (pinned host memory on GPU), written by a thread, and the rank's manifest is written once the write is done.
The layout and what is verified on load: training/checkpoint.py."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.checkpoint import files_per_rank, training_state
from training.checkpoint_hashing import checksum_planner, writer
from training.checkpoint_manifest import write_manifest


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
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=True
        )
    )


class AsyncSave:
    """A DCP save running in a background thread (GPU: tensors are staged to CPU before `start` returns).

    `done()` is rank-local; `finish()` waits for the write and then writes this rank's manifest.
    `pinned` says whether staging went through pinned host memory (else pageable, the fallback).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        step: int,
        rank: int,
        world_size: int,
        future: Any,
        resumed_from: int = 0,
        writer: Any = None,
        planner: Any = None,
    ) -> None:
        self.directory, self.step, self.rank, self.world_size = directory, step, rank, world_size
        self._future, self.resumed_from = future, resumed_from
        self._writer, self._planner = writer, planner
        self.pinned, self._stager = False, None

    @classmethod
    def start(
        cls,
        directory: str | os.PathLike,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        step: int,
        data_position: int,
        rank: int,
        world_size: int,
        process_group: Any,
        resumed_from: int = 0,
        threads: int = 1,
    ) -> AsyncSave:
        import torch.distributed.checkpoint as dcp

        Path(directory).mkdir(parents=True, exist_ok=True)
        state = training_state(model, optimizer, step, data_position, rank, world_size)
        # A separate (gloo) group: the background thread's collectives must not interleave with training's.
        planner = checksum_planner()
        save = functools.partial(dcp.async_save, state, process_group=process_group, planner=planner)
        stager = _pinned_stager()
        threads = files_per_rank(state, threads)
        w = writer(directory, threads)
        try:
            future = save(storage_writer=w, async_stager=stager)
        except (KeyError, TypeError, RuntimeError) as e:
            if stager is None:
                raise
            # Some torch versions' pinned stager cannot deep-copy DTensor state; plain staging can.
            logging.getLogger(__name__).warning("pinned staging failed (%r); staging to pageable memory", e)
            stager.close()
            stager = None
            planner.tensors.clear()
            w = writer(directory, threads)
            future = save(storage_writer=w, async_stager=None)
        future = getattr(future, "upload_completion", future)
        saved = cls(directory, step, rank, world_size, future, resumed_from, w, planner)
        saved.pinned, saved._stager = stager is not None, stager
        return saved

    def done(self) -> bool:
        return self._future.done()

    def finish(self) -> None:
        self._future.result()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        write_manifest(
            self.directory,
            self.rank,
            self.world_size,
            self.step,
            self.resumed_from,
            files=self._writer.fs.files,
            tensors=self._planner.tensors,
        )
