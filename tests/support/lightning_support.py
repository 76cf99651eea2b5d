"""LightningModules for the Lightning loop's tests: the example module recording each worker (like recording_gpt),
one without the `model` attribute the loop serves, and one that does not shard itself."""

from __future__ import annotations

import lightning.pytorch as pl

from support.train_support import recording_gpt
from training.lightning_example import ByteGPTModule


class RecordingByteGPT(ByteGPTModule):
    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.model = recording_gpt(cfg)  # the same GPT, and this worker's rank and pid on record


class NoModel(ByteGPTModule):
    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        del self.model  # what a module that keeps its network under another name looks like to the loop


class UnshardedByteGPT(ByteGPTModule):
    configure_model = pl.LightningModule.configure_model  # what a module written for DDP only looks like
