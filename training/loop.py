"""The per-worker training function. It runs unchanged under `torchrun` and under Ray Train's TorchTrainer.

`train_func` reads as: restore, then for each step: `train_step`, log (`MetricsWindow`), maybe save. The
checkpoints' state (resume step, the async save in flight) lives in `training.checkpointer.Checkpointer`; the
only launcher-specific line picks its hooks: report a checkpoint to Ray Train, or keep it in a local directory.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from training import checkpoint as ckpt
from training import placement, prom_metrics
from training.checkpointer import Checkpointer, LocalHooks, RayHooks, inside_ray_train
from training.config import TrainConfig, check_global_batch, load_object
from training.model import flops_per_token
from training.parallelize import compute_dtype, parallelize
from training.train_metrics import CPU_PEAK_TFLOPS, GPU_PEAK_TFLOPS, MetricsWindow, MlflowLogger


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup to cfg.lr, cosine decay to cfg.min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on biases, norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


# ---------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------


def data_stream(
    shard_uris: list[str], rank: int, world: int, cfg: TrainConfig, start: int, position: int, token_dtype: str = ""
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro batches from optimizer step `start` on; the resume rule lives here. `token_dtype`
    (ShardSet.token_dtype): the set's records carry token ids, which are read instead of the text's bytes.

    Same world size (`position` >= 0, the micro batches this rank had consumed when the checkpoint was saved):
    the uninterrupted run's stream, its first `position` batches skipped, so a resumed run sees exactly the
    batches an uninterrupted one would (skipping re-reads those records: O(position), no gradient work).
    Another world size (`position` = -1): per-rank streams cannot be continued (each rank reads its own shards),
    so each rank starts a fresh stream seeded by (seed, rank, start): the same distribution, no batch replayed
    on purpose, but not the uninterrupted run's sequence.
    The DataLoader draws its base seed from the global RNG; that draw is fenced off so the restored RNG state
    (dropout) continues exactly as it would have.
    """
    from training.data.loader import train_batches  # the data part's streaming reader

    if position >= 0:
        stream: Iterator[tuple[torch.Tensor, torch.Tensor]] = itertools.islice(
            train_batches(shard_uris, rank, world, cfg, 0, token_dtype=token_dtype), position, None
        )
    else:
        stream = iter(train_batches(shard_uris, rank, world, cfg, start, token_dtype=token_dtype))
    with torch.random.fork_rng(devices=[]):
        first = next(stream, None)
    return itertools.chain([] if first is None else [first], stream)


def forward_backward_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig, device: torch.device, sync: bool
) -> torch.Tensor:
    """One micro batch: forward, loss / grad_accum, backward; gradients are communicated only when `sync`."""
    autocast_dtype = compute_dtype(cfg, device) if cfg.parallelism == "ddp" else torch.float32
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if set_sync is not None:  # FSDP2
        set_sync(sync)
        sync_ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    else:  # DDP
        sync_ctx = contextlib.nullcontext() if sync else cast(Any, model).no_sync()
    with sync_ctx, torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype != torch.float32):
        logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1)) / cfg.grad_accum
        loss.backward()
    return loss.detach()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    cfg: TrainConfig,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Optimizer step `step` (0-based) over cfg.grad_accum micro batches: (this rank's loss, gradient norm, lr)."""
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    step_loss = torch.zeros((), device=device)
    for micro in range(cfg.grad_accum):
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        step_loss += forward_backward_step(model, x, y, cfg, device, sync=micro == cfg.grad_accum - 1)
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss, grad_norm, lr


def init_weights(model: nn.Module, checkpoint_uri: str) -> None:
    """train.init_from: load a checkpoint's model weights into the plain model (before FSDP wraps it)."""
    with ckpt.local_copy(checkpoint_uri) as directory:
        ckpt.load_unsharded(model, directory)


def _setup_distributed(cfg: TrainConfig) -> tuple[int, int, torch.device]:
    """rank, world size, device; creates the process group when the launcher (torchrun) did not."""
    if not dist.is_initialized():
        backend = "nccl" if cfg.use_gpu else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend)  # torchrun: env://
        else:  # a plain single process
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.use_gpu:
        local = int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return rank, world, device


def train_func(config: dict[str, Any]) -> dict[str, float]:
    """Train on this rank until `train.steps`, resuming from the latest complete checkpoint.

    config keys: train (TrainConfig as dict), train_shards (URIs), token_dtype (a tokenized set's; optional),
    tracking_uri and run_id (MLflow; optional),
    checkpoint_root (torchrun only: shared directory for checkpoints), init_checkpoint (optional: a checkpoint
    whose model weights start the run, train.init_from resolved).

    Returns:
        Rank-local summary: final step, final loss, mean tokens/s (all ranks), world size.
    """
    from infra.credentials import adopt_worker_secrets

    adopt_worker_secrets()  # a run on the long-lived local head: its storage credentials (no-op elsewhere)
    cfg = TrainConfig.model_validate(config["train"])
    torch.set_num_threads(cfg.threads_per_worker)
    rank, world, device = _setup_distributed(cfg)
    global_batch = check_global_batch(cfg, world)

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (FSDP shards, DDP broadcasts)
    model = load_object(cfg.model_factory, "train.model_factory")(cfg)
    if config.get("init_checkpoint"):  # continued training; a checkpoint of this run (below) still wins
        init_weights(model, config["init_checkpoint"])
    elif cfg.hf_weights:  # fine-tuning a transformers model's save_pretrained weights; resume (below) still wins
        from training.hf_model import load_pretrained

        load_pretrained(model, cfg.hf_weights)
    model = model.to(device)
    fpt = flops_per_token(model, cfg.seq_len)
    model = parallelize(model, cfg, device, world)
    optimizer = build_optimizer(model, cfg, device)
    torch.manual_seed(cfg.seed + 1 + rank)  # dropout differs per rank; restored exactly on resume

    peak = cfg.peak_tflops or (GPU_PEAK_TFLOPS if device.type == "cuda" else CPU_PEAK_TFLOPS)
    window = MetricsWindow(global_batch * cfg.seq_len, fpt, peak, world, device)
    # The launcher-specific line: Ray Train's checkpoint store, or a directory torchrun's ranks share.
    hooks = RayHooks() if inside_ray_train() else LocalHooks(config["checkpoint_root"], cfg.keep_checkpoints)
    checkpointer = Checkpointer(hooks, model, optimizer, cfg, rank, world, device, report=window.summary)
    start, position = checkpointer.restore()

    batches = data_stream(config["train_shards"], rank, world, cfg, start, position, config.get("token_dtype", ""))
    logger = MlflowLogger(config.get("tracking_uri", ""), config.get("run_id", "")) if rank == 0 else None
    nodes = placement.gather_nodes(device)  # lineage: the nodes that trained (an autoscaler may just have added them)
    if logger is not None:
        logger.record(*placement.placement_lineage(nodes))

    window.start()
    for step in range(start, cfg.steps):
        step_loss, grad_norm, lr = train_step(model, optimizer, batches, step, cfg, device)
        done = step + 1
        window.step_done()
        checkpointer.publish_finished()
        if done % cfg.log_every == 0 or done == cfg.steps:
            metrics = window.collect(step_loss, grad_norm, lr)
            if logger is not None:
                logger.log(metrics, done)
                prom_metrics.export(metrics, done, config.get("run_id", ""))  # a no-op unless on Ray
        checkpointer.save(done, last_step=done == cfg.steps)
    checkpointer.close()
    if logger is not None:
        logger.close()
    return window.summary(cfg.steps)


def main(argv: list[str] | None = None) -> None:
    """torchrun entry: `torchrun --nproc-per-node N -m training.loop CONFIG.json` (the dict train_func takes).

    Rank 0 prints train_func's summary as one JSON line.
    """
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: torchrun --nproc-per-node N -m training.loop CONFIG.json")
    config = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    summary = train_func(config)
    if dist.get_rank() == 0:
        print(json.dumps(summary), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
