"""One-GPU FSDP2 bf16 throughput of a ~300M-parameter byte-level GPT: tokens/s and MFU, plus checkpoint timing.

    python bench/gpu_fsdp_h200.py                 # H200: ~300M params, seq 1024, bf16, fits in ~3 minutes
    python bench/gpu_fsdp_h200.py --tiny          # CPU smoke test of the same code path (seconds)

Uses shardline's own model, FSDP2 transforms, optimizer, schedule and DCP checkpoint code (world size 1, a
single-process group). Batches are random bytes already on the device: this measures the model step, not I/O.
MFU = flops_per_token x tokens/s / peak (989 TFLOP/s dense bf16 on H100/H200 SXM unless --peak-tflops).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F

from training import checkpoint as ckpt
from training.checkpoint_async import AsyncSave
from training.config import TrainConfig
from training.loop import build_optimizer, lr_at
from training.model import build_gpt, flops_per_token
from training.parallelize import parallelize


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    p.add_argument("--steps", type=int, default=0, help="timed steps (default 30; tiny 3)")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps first (default 5; tiny 1)")
    p.add_argument("--micro-batch", type=int, default=0, help="sequences per step (default 32; tiny 2)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--ac", action="store_true", help="activation checkpointing")
    p.add_argument("--no-checkpoint", action="store_true", help="skip the DCP save timing")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="default 989 on GPU, 0.1 on CPU")
    p.add_argument("--json", default="", help="also write the results here")
    return p.parse_args()


def checkpoint_timings(model, optimizer, step, sync, gpu: bool) -> dict:
    """DCP save at 1/4/8 files per rank (write+fsync, then manifest sha256) vs torch.save (+fsync); async save."""
    import os

    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for threads in (1, 4, 8):
            d = f"{tmp}/t{threads}"
            t = time.perf_counter()
            # files hashed while written and tensor checksums taken at save time: the manifest costs no re-read
            ckpt.save_checkpoint(d, model, optimizer, 1, 1, 0, 1, threads=threads)
            out[f"dcp_save_s_threads{threads}"] = round(time.perf_counter() - t, 2)
        size_mb = sum(f.stat().st_size for f in Path(tmp, "t1").iterdir()) / 2**20
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        t = time.perf_counter()
        with open(f"{tmp}/plain.pt", "wb") as f:
            torch.save({"model": full, "optim": optimizer.state_dict()}, f)
            t_nosync = time.perf_counter() - t
            f.flush()
            os.fsync(f.fileno())
        torch_save_s = time.perf_counter() - t
        group = dist.new_group(backend="gloo") if gpu else None
        for i in (1, 2):
            t = time.perf_counter()
            pending = AsyncSave.start(f"{tmp}/async{i}", model, optimizer, 2, 2, 0, 1, group, threads=8)
            out[f"async{i}_blocked_s"] = round(time.perf_counter() - t, 2)
            out[f"async{i}_pinned"] = pending.pinned
            step(0)  # training continues while the write runs in the background
            sync()
            pending.finish()
            out[f"async{i}_total_s"] = round(time.perf_counter() - t, 2)
            ckpt.verify_checkpoint(f"{tmp}/async{i}")
    best = min(out[f"dcp_save_s_threads{n}"] for n in (1, 4, 8))
    out.update(
        {
            "checkpoint_mb": round(size_mb),
            "torch_save_s_no_fsync": round(t_nosync, 2),
            "torch_save_s_fsync": round(torch_save_s, 2),
            "torch_save_mb_s_fsync": round(size_mb / torch_save_s),
            "dcp_save_mb_s_threads8": round(size_mb / out["dcp_save_s_threads8"]),
            "dcp_vs_torch_save_fsync_threads8": round(torch_save_s / out["dcp_save_s_threads8"], 2),
            "dcp_vs_torch_save_fsync_best": round(torch_save_s / best, 2),
        }
    )
    return out


def main() -> None:
    args = parse()
    gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    size = (
        dict(seq_len=64, n_layer=2, n_head=2, d_model=64)
        if args.tiny
        else dict(seq_len=1024, n_layer=24, n_head=16, d_model=1024)
    )  # 12 * 24 * 1024^2 = 302M in blocks
    cfg = TrainConfig(
        workers=1,
        steps=1000,
        warmup_steps=10,
        micro_batch=args.micro_batch or (2 if args.tiny else 32),
        use_gpu=gpu,
        mixed_precision="bf16" if gpu else "fp32",
        activation_checkpointing=args.ac,
        reshard_after_forward=False,
        **size,
    )
    steps, warmup = args.steps or (3 if args.tiny else 30), args.warmup or (1 if args.tiny else 5)

    dist.init_process_group("nccl" if gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(cfg.seed)
    model = build_gpt(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    fpt = flops_per_token(model, cfg.seq_len)
    model = parallelize(model, cfg, device, 1)
    if args.compile:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    optimizer = build_optimizer(model, cfg, device)
    g = torch.Generator(device=device).manual_seed(0)
    data = torch.randint(0, 256, (8, cfg.micro_batch, cfg.seq_len + 1), device=device, generator=g)

    def step(i: int) -> torch.Tensor:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(i, cfg)
        batch = data[i % len(data)]
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, 256), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    sync = torch.cuda.synchronize if gpu else (lambda: None)
    t_start = time.perf_counter()
    for i in range(warmup):
        first = step(i)
    sync()
    warm_s = time.perf_counter() - t_start
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        last = step(i)
    sync()
    elapsed = time.perf_counter() - t0
    tokens = steps * cfg.micro_batch * cfg.seq_len
    tps = tokens / elapsed
    out = {
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "torch": torch.__version__,
        "params_M": round(n_params / 1e6, 1),
        "seq_len": cfg.seq_len,
        "micro_batch": cfg.micro_batch,
        "compile": args.compile,
        "ac": args.ac,
        "warmup_s": round(warm_s, 2),
        "step_ms": round(1000 * elapsed / steps, 1),
        "tokens_per_s": round(tps),
        "tflops_per_s": round(fpt * tps / 1e12, 1),
        "mfu": round(fpt * tps / ((args.peak_tflops or (989.0 if gpu else 0.1)) * 1e12), 4),
        "loss_first_last": [round(float(first), 3), round(float(last), 3)],
        "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None,
    }

    if not args.no_checkpoint:
        out.update(checkpoint_timings(model, optimizer, step, sync, gpu))
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
