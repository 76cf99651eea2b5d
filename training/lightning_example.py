"""A LightningModule for `train.loop = "lightning"`: the built-in byte-level GPT, trained the Lightning way.

It is the example `configs/lightning.toml` runs and the shape a team's own module takes (training/lightning_loop.py
has the contract): built from the TrainConfig, `self.model` is the nn.Module that gets served, `training_step`
returns the loss, `configure_optimizers` returns one optimizer. The learning rate follows `[train]`'s warmup and
cosine schedule by Lightning's step counter, which a resumed run continues.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from training.config import TrainConfig
from training.lightning_loop import shard_model
from training.loop import build_optimizer, lr_at
from training.model import build_gpt


class ByteGPTModule(pl.LightningModule):
    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = build_gpt(cfg)  # never cfg.model_factory: for a Lightning run that is this module's `.model`

    def configure_model(self) -> None:
        shard_model(self, self.cfg)  # FSDP2 per block with train.parallelism = "fsdp"; nothing under DDP

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        for group in self.trainer.optimizers[0].param_groups:
            group["lr"] = lr_at(self.trainer.global_step, self.cfg)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return build_optimizer(self.model, self.cfg, self.device)
