"""A bare FSDP2 training script of a transformers causal LM, the way a team writes one without any framework: the
reference that bench/bench_hf_step.py holds shardline's Ray Train stage against. It imports nothing of shardline.

    torchrun --standalone --nproc-per-node=2 bench/fsdp2_bare.py SPEC.json

SPEC.json: {"hf_config": {...inline config with model_type...}, "steps", "seq_len", "micro_batch", "lr",
"weight_decay", "grad_clip", "seed", "log_every"}. Each rank trains on seeded random byte tokens (data loading is
not what is compared), shards every `_no_split_modules` layer and then the root with `fully_shard`, runs AdamW and
clips the global grad norm. Rank 0 prints one JSON line: tokens/s over the steps after the first (warm-up) one, all
ranks, and the steady-state step time as shardline's loop logs it (mean per window of log_every steps, the first
window left out, median over the windows).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(spec["seed"])
    # parameters in fp32, as shardline builds them (a saved config's dtype would otherwise decide)
    settings = {k: v for k, v in spec["hf_config"].items() if k not in ("model_type", "dtype", "torch_dtype")}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec["hf_config"]["model_type"], **settings))
    mesh = init_device_mesh("cpu", (world,))
    layers = set(model._no_split_modules or ())
    blocks = [m for m in model.modules() if type(m).__name__ in layers]
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": spec["weight_decay"]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=spec["lr"],
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(spec["seed"] + rank)
    shape = (spec["micro_batch"], spec["seq_len"] + 1)
    t0, times = 0.0, []
    for step in range(spec["steps"]):
        if step == 1:  # the first step builds caches and warms the allocator: timed from the second on
            dist.barrier()
            t0 = time.perf_counter()
        began = time.perf_counter()
        block = torch.randint(0, 256, shape, generator=gen)
        logits = model(input_ids=block[:, :-1], use_cache=False).logits
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), block[:, 1:].reshape(-1))
        loss.backward()
        if spec["grad_clip"] > 0:
            nn.utils.clip_grad_norm_(model.parameters(), spec["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # the loop waits for the step, as a logging loop would
        times.append(time.perf_counter() - began)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    if rank == 0:
        tokens = (spec["steps"] - 1) * world * spec["micro_batch"] * spec["seq_len"]
        # as shardline logs it: mean step time per window of log_every steps, the first window (warm-up) left out
        k = spec["log_every"]
        windows = [statistics.fmean(times[i : i + k]) for i in range(0, len(times) - k + 1, k)][1:]
        step_s = statistics.median(windows)
        print(json.dumps({"tokens_per_s": tokens / elapsed, "step_time_s": step_s}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
