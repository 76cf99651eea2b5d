"""`train.loop = "lightning"`: a user's LightningModule trained under Ray Train's Lightning integration.

The contract of `train.lightning_module` ('module:Class'):
- `Class(cfg)` takes the TrainConfig (the run's whole `[train]` table) and builds its model;
- `self.model` is the nn.Module that is validated, registered and served: `model(idx)` maps a (batch, seq_len)
  LongTensor of byte ids to (batch, seq_len, 256) logits, as `train.model_factory` models do;
- `training_step((x, y), batch_idx)` returns the loss; `configure_optimizers()` returns one optimizer (the module
  owns its learning rate; `training.lightning_example` follows `[train]`'s warmup and cosine schedule).

Each worker runs a `lightning.Trainer` with `RayLightningEnvironment` and, by `train.parallelism`:
- `ddp`: Ray's `RayDDPStrategy`, checked by `prepare_trainer`;
- `fsdp`: `RayFSDP2Strategy`, Lightning's FSDP2 strategy (`ModelParallelStrategy`) on Ray Train's device. The module
  shards its model in `configure_model()` on the strategy's device mesh; `shard_model(self, cfg)` does it per block
  with the run's mixed precision, as the built-in loop does (training.lightning_example calls it). Ray's own
  `RayFSDPStrategy` wraps FSDP1, which torch runs on GPUs only and whose checkpoints are not DCP's FSDP2 layout.

The data are the run's WebDataset shards, read per rank exactly as the built-in loop reads them
(`loop.data_stream`); Lightning accumulates `train.grad_accum` micro batches per optimizer step and clips at
`train.grad_clip`. `ShardlineCheckpoints` is the report callback: every `train.checkpoint_every` optimizer steps
(and at the last) it saves the model and optimizer with torch.distributed.checkpoint, in the same layout as the
built-in loop (so the validate stage, the registry and the canary take it unchanged), and hands the directory to
Ray Train with `ray.train.report`. A restarted worker group restores the newest complete checkpoint before the
first batch: weights, optimizer, Lightning's step counter and the data position, so the run still ends at exactly
`train.steps`. Lightning's own `.ckpt` files are never written: they are pickles, and checkpoints here are loaded
with `weights_only`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor

from training import placement, prom_metrics
from training.checkpointer import Checkpointer, RayHooks
from training.config import TrainConfig, check_global_batch, lightning_class
from training.loop import data_stream, init_weights
from training.model import flops_per_token
from training.parallelize import apply_fsdp, compute_dtype
from training.train_metrics import CPU_PEAK_TFLOPS, GPU_PEAK_TFLOPS, MetricsWindow, MlflowLogger


def build_module(cfg: TrainConfig) -> pl.LightningModule:
    """`train.lightning_module`'s class built from the TrainConfig.

    Raises:
        ValueError: one line naming the module, when its constructor fails.
    """
    from infra.redact import first_line

    cls = lightning_class(cfg.lightning_module)
    try:
        return cls(cfg)
    except Exception as e:  # noqa: BLE001 - the user's constructor: any failure is named in one line
        cause = f"{type(e).__name__}: {first_line(e)}"
        raise ValueError(f"train.lightning_module={cfg.lightning_module!r}: {cls.__name__}(cfg) failed: {cause}") from e


def served_model(module: pl.LightningModule, cfg: TrainConfig) -> nn.Module:
    """The module's `.model`: what validation, the registry and the replicas serve.

    Raises:
        ValueError: one line naming the module, when it has no `model` that is an nn.Module.
    """
    model = getattr(module, "model", None)
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"train.lightning_module={cfg.lightning_module!r}: its `model` attribute must be the nn.Module to serve, "
            f"got {type(model).__name__}"
        )
    return model


def lightning_model(cfg: TrainConfig) -> nn.Module:
    """`train.model_factory` of a Lightning run: the module's `.model`, which validation and serving rebuild."""
    return served_model(build_module(cfg), cfg)


class RayFSDP2Strategy(ModelParallelStrategy):
    """Lightning's FSDP2 strategy placed the way Ray's strategies place theirs: on Ray Train's device for this
    worker, every worker one data-parallel rank (no tensor parallelism). `prepare_trainer` accepts Ray's own
    classes only, so train_func does not call it for this one: all it would check is the environment, which
    train_func sets to RayLightningEnvironment itself."""

    def __init__(self, world: int) -> None:
        super().__init__(data_parallel_size=world, tensor_parallel_size=1)

    @property
    def root_device(self) -> torch.device:
        import ray.train.torch

        return ray.train.torch.get_device()


def shard_model(module: pl.LightningModule, cfg: TrainConfig) -> None:
    """FSDP2 over `module.model` per block, then the root, on the strategy's data-parallel mesh, computing in the
    run's precision (`train.mixed_precision`) and reducing in fp32. Call it from `configure_model()`; under DDP
    (`train.parallelism = "ddp"`) it does nothing."""
    if cfg.parallelism != "fsdp":
        return
    if module.device_mesh is None:
        raise RuntimeError("shard_model runs in configure_model() under RayFSDP2Strategy, which sets the mesh")
    mesh = module.device_mesh["data_parallel"]
    apply_fsdp(served_model(module, cfg), cfg, torch.device(mesh.device_type), mesh.size(), mesh=mesh)


def check_module(trainer: Any, pl_module: Any, cfg: TrainConfig) -> None:
    """What the checkpoint callback can save and restore exactly, checked before the first batch.

    Raises:
        ValueError: one line naming the module: a learning-rate scheduler (its state is not checkpointed; set the
            rate in the module, as training.lightning_example does), manual optimization, or optimized parameters
            outside `.model` (the checkpoint holds `.model` and its optimizer state only).
    """
    name = f"train.lightning_module={cfg.lightning_module!r}"
    if trainer.lr_scheduler_configs:
        raise ValueError(
            f"{name}: configure_optimizers returns a learning-rate scheduler; set the rate per step in "
            "the module instead (on_train_batch_start, as training.lightning_example does)"
        )
    if not pl_module.automatic_optimization:
        raise ValueError(f"{name}: manual optimization is not supported (automatic_optimization is False)")
    if len(trainer.optimizers) != 1:
        raise ValueError(f"{name}: configure_optimizers must return one optimizer, got {len(trainer.optimizers)}")
    served = {id(p) for p in pl_module.model.parameters()}
    outside = [p for g in trainer.optimizers[0].param_groups for p in g["params"] if id(p) not in served]
    if outside:
        raise ValueError(
            f"{name}: the optimizer updates {len(outside)} parameters outside `model`, which the "
            "checkpoint and the served model would lose"
        )


class _Stream(torch.utils.data.IterableDataset):
    """This rank's micro batches, from the position the checkpoint callback restored (read at the first iter)."""

    def __init__(self, shards: list[str], rank: int, world: int, cfg: TrainConfig, token_dtype: str = "") -> None:
        self.shards, self.rank, self.world, self.cfg, self.token_dtype = shards, rank, world, cfg, token_dtype
        self.start, self.position = 0, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return data_stream(self.shards, self.rank, self.world, self.cfg, self.start, self.position, self.token_dtype)


class ShardlineCheckpoints(pl.Callback):
    """The report callback: restore before the first batch, save and report every checkpoint step, log metrics."""

    def __init__(self, cfg: TrainConfig, stream: _Stream, config: dict[str, Any], rank: int, world: int) -> None:
        super().__init__()
        self.cfg, self.stream, self.rank, self.world = cfg, stream, rank, world
        self.run_id = config.get("run_id", "")
        self.logger = MlflowLogger(config.get("tracking_uri", ""), self.run_id) if rank == 0 else None
        self.checkpointer: Checkpointer | None = None
        self.window: MetricsWindow | None = None
        self.grad_norm = torch.zeros(())
        self.loss = torch.zeros(())
        self.last_step = 0

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        check_module(trainer, pl_module, self.cfg)
        device = pl_module.device
        self.loss = torch.zeros((), device=device)  # all-reduced at each log: NCCL takes device tensors only
        self.window = MetricsWindow(
            check_global_batch(self.cfg, self.world) * self.cfg.seq_len,
            flops_per_token(pl_module.model, self.cfg.seq_len),
            self.cfg.peak_tflops or (GPU_PEAK_TFLOPS if device.type == "cuda" else CPU_PEAK_TFLOPS),
            self.world,
            device,
        )
        self.checkpointer = Checkpointer(
            RayHooks(), pl_module.model, trainer.optimizers[0], self.cfg, self.rank, self.world, device,
            report=self.window.summary,
        )  # fmt: skip
        start, position = self.checkpointer.restore()
        # Lightning's step counter continues from the checkpoint (what its own restore sets), so `max_steps` and
        # the module's schedule see the run's real step; the stream skips what the ranks had consumed.
        trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = start
        trainer.fit_loop.epoch_loop._batches_that_stepped = start
        self.stream.start, self.stream.position = start, position
        self.last_step = start
        nodes = placement.gather_nodes(device)  # a collective: lineage of the nodes that trained
        if self.logger is not None:
            self.logger.record(*placement.placement_lineage(nodes))
        self.window.start()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad.detach() for p in pl_module.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        self.grad_norm = norm.full_tensor() if isinstance(norm, DTensor) else norm  # FSDP2: every shard's norm

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs  # already divided by grad_accum
        self.loss = self.loss + loss.detach().float()
        done = int(trainer.global_step)
        if done == self.last_step:  # accumulating: no optimizer step with this micro batch
            return
        self.last_step = done
        assert self.checkpointer is not None and self.window is not None
        self.window.step_done()
        self.checkpointer.publish_finished()
        if done % self.cfg.log_every == 0 or done == self.cfg.steps:
            lr = float(trainer.optimizers[0].param_groups[0]["lr"])
            metrics = self.window.collect(self.loss.clone(), self.grad_norm, lr)
            if self.logger is not None:
                self.logger.log(metrics, done)
                prom_metrics.export(metrics, done, self.run_id)
        self.loss = torch.zeros((), device=self.loss.device)
        self.checkpointer.save(done, last_step=done == self.cfg.steps)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.last_step != self.cfg.steps:  # the stream ran dry, or Lightning stopped early: no silent short run
            raise RuntimeError(f"the Lightning run stopped at step {self.last_step} of train.steps={self.cfg.steps}")

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.logger is not None:
            self.logger.close()


def train_func(config: dict[str, Any]) -> dict[str, float]:
    """The Ray Train worker function of a Lightning run (same `config` keys as training.loop.train_func)."""
    import ray.train.torch
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

    from infra.credentials import adopt_worker_secrets

    adopt_worker_secrets()
    cfg = TrainConfig.model_validate(config["train"])
    torch.set_num_threads(cfg.threads_per_worker)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = ray.train.torch.get_device()
    check_global_batch(cfg, world)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    module = build_module(cfg)
    model = served_model(module, cfg)  # the module without one fails here, before any worker trains
    if config.get("init_checkpoint"):  # train.init_from; a checkpoint of this run (restored at fit start) still wins
        init_weights(model, config["init_checkpoint"])
    stream = _Stream(config["train_shards"], rank, world, cfg, config.get("token_dtype", ""))
    callback = ShardlineCheckpoints(cfg, stream, config, rank, world)
    fsdp = cfg.parallelism == "fsdp"
    bf16 = compute_dtype(cfg, device) == torch.bfloat16
    # Lightning's own resume (ckpt_path "hpc": SLURM_NTASKS set and an hpc_ckpt_* under default_root_dir, which
    # would be the worker's working directory) never finds anything: its root is fresh and empty, and fit loads
    # weights only. Resume is ShardlineCheckpoints' (DCP, checked for pickles).
    root = tempfile.TemporaryDirectory(prefix="shardline-lightning-")
    trainer = pl.Trainer(
        default_root_dir=root.name,
        accelerator="gpu" if cfg.use_gpu else "cpu",
        # FSDP2 computes in bf16 through its own mixed-precision policy (shard_model); DDP through autocast
        precision="bf16-mixed" if bf16 and not fsdp else "32-true",
        devices="auto",
        strategy=RayFSDP2Strategy(world) if fsdp else RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        callbacks=[callback],
        max_steps=cfg.steps,
        accumulate_grad_batches=cfg.grad_accum,
        gradient_clip_val=cfg.grad_clip if cfg.grad_clip > 0 else None,
        use_distributed_sampler=False,  # each rank reads its own shards (loop.data_stream)
        enable_checkpointing=False,  # checkpoints are ShardlineCheckpoints' (DCP), not Lightning's pickles
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        num_sanity_val_steps=0,
    )
    if not fsdp:  # it accepts Ray's strategy classes only; the environment it checks is the one given above
        trainer = prepare_trainer(trainer)
    torch.manual_seed(cfg.seed + 1 + rank)
    # its own generator: a DataLoader draws a base seed from the global RNG at iter(), which here comes after the
    # checkpoint's RNG state was restored; that draw must not move the restored state (dropout would differ)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, generator=torch.Generator())
    try:
        trainer.fit(module, train_dataloaders=loader, weights_only=True)
    finally:
        root.cleanup()
    assert callback.window is not None
    return callback.window.summary(cfg.steps)
