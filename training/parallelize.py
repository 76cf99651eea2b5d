"""Data parallelism as small ordered transforms (torchtitan style): AC, then FSDP2 per block, then the root; or DDP."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from training.config import TrainConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def _blocks(model: nn.Module) -> nn.ModuleList | None:
    """The repeated transformer blocks, the unit of sharding and recomputation: `model.blocks` (the built-in GPT),
    else the ModuleList whose every child is a class the model declares in `_no_split_modules` (transformers models;
    Accelerate's and torchtitan's rule), looked through activation checkpointing's wrapper."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return blocks
    declared: set[str] = set()
    for module in model.modules():
        declared.update(getattr(module, "_no_split_modules", None) or ())
    if not declared:
        return None
    for module in model.modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module)
            and all(type(getattr(child, "_checkpoint_wrapped_module", child)).__name__ in declared for child in module)
        ):
            return module
    return None


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """bf16 on GPU for `auto`, fp32 on CPU (bf16 matmuls are slower than fp32 on most CPUs)."""
    if cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def apply_ac(model: nn.Module) -> nn.Module:
    """Recompute each block's activations in backward: trades ~1/3 more compute for activation memory."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = _blocks(model)
    if blocks is None:
        raise ValueError(
            "train.activation_checkpointing needs a model with a `blocks` nn.ModuleList or declared "
            "`_no_split_modules` layers"
        )
    for i, block in enumerate(blocks):
        # The wrapper's `_checkpoint_wrapped_module.` prefix is stripped by DCP's get_model_state_dict,
        # so checkpoints keep the plain model's FQNs.
        blocks[i] = checkpoint_wrapper(block, preserve_rng_state=True)
    return model


def apply_fsdp(
    model: nn.Module, cfg: TrainConfig, device: torch.device, world_size: int, mesh: DeviceMesh | None = None
) -> nn.Module:
    """FSDP2: shard every block, then the root (embeddings, final norm, head), over `mesh` (default: every rank).

    Blocks first so each block is its own all-gather / reduce-scatter group: only one block's full
    parameters are materialised at a time, and block i+1's all-gather overlaps block i's compute.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = mesh if mesh is not None else init_device_mesh(device.type, (world_size,))
    dtype = compute_dtype(cfg, device)
    # Reduce in fp32 even when computing in bf16: summing W bf16 gradients loses low-order bits.
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if cfg.cpu_offload and device.type != "cuda":
        raise ValueError("train.cpu_offload=true needs train.use_gpu=true (parameters already live on CPU)")
    offload = CPUOffloadPolicy(pin_memory=True) if cfg.cpu_offload else OffloadPolicy()
    blocks = _blocks(model) or nn.ModuleList()
    for i, block in enumerate(blocks):
        # The last block's parameters are all-gathered again first thing in backward: keep them.
        reshard = cfg.reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=mp, offload_policy=offload)
    return model


def apply_ddp(model: nn.Module, cfg: TrainConfig, device: torch.device) -> nn.Module:
    """DDP (full replicas, all-reduce of gradients), optionally with PowerSGD low-rank gradient compression."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.powersgd_rank > 0:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        # Plain all-reduce through warmup: early gradients are the most sensitive to compression error.
        state = powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=max(2, cfg.warmup_steps),
        )
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    return ddp


def parallelize(model: nn.Module, cfg: TrainConfig, device: torch.device, world_size: int) -> nn.Module:
    """Apply, in this order: activation checkpointing (optional), then FSDP2 or DDP. The model is on `device`."""
    if cfg.activation_checkpointing:
        model = apply_ac(model)
    if cfg.parallelism == "fsdp":
        return apply_fsdp(model, cfg, device, world_size)
    if cfg.powersgd_rank > 0 and world_size < 2:
        raise ValueError(f"train.powersgd_rank={cfg.powersgd_rank} needs at least 2 workers, got {world_size}")
    # DDP keeps fp32 parameters; the loop runs its forward under autocast when compute_dtype is bf16.
    return apply_ddp(model, cfg, device)
