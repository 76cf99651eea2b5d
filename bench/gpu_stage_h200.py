"""GPU check of the training stage as the pipeline runs it: `training.trainer.run_training` on Ray Train, one GPU.

    python bench/gpu_stage_h200.py --json out.json     # on a GPU machine (Ray started here, 1 GPU)
    python bench/gpu_stage_h200.py --cpu               # the same runs, tiny, on CPU: a smoke test

Four runs of the real stage (Ray Train's TorchTrainer, NCCL, DCP checkpoints, the config's mixed precision) over
WebDataset shards of the standard library, each reporting tokens/s and MFU (the stage's own FLOP formula:
`training.model.flops_per_token`, 6N plus PaLM's attention term for the GPT, a transformers model's own count for
the Llama; peak 989 TFLOP/s dense bf16):
1. the built-in GPT (153M parameters at d_model 1024, 12 layers, seq_len 1024), built-in loop, FSDP2 bf16;
2. the same GPT as a LightningModule (`train.loop = "lightning"`) under Lightning's FSDP2 strategy on Ray Train's
   device; then the same run name again, which must resume at the last step and train nothing; its last
   checkpoint verified and loaded into the module's model and scored (bits per byte of the held-out shard);
3. a transformers Llama from a config (136M parameters; FSDP2 per decoder layer, `_no_split_modules`), built-in loop;
4. the same Llama with activation checkpointing.
Each run is independent: one that fails is reported with its one-line cause, and the others still run. Needs
torch, transformers, lightning, ray[train], pydantic, webdataset; not MLflow (no tracking URI is given).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the test helpers: tests/support

import torch  # noqa: E402

PEAK = 989e12

GPT = {"d_model": 1024, "n_layer": 12, "n_head": 16, "seq_len": 1024, "micro_batch": 16}
LLAMA = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
TINY_GPT = {"d_model": 32, "n_layer": 2, "n_head": 2, "seq_len": 32, "micro_batch": 2}
TINY_LLAMA = dict(LLAMA, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip


def stage(name: str, overrides: dict, shards, gpu: bool, steps: int, home: Path) -> dict:
    """One run of the training stage; tokens/s and MFU as the stage reports them; the checkpoint's step."""
    from training.checkpoint import verify_checkpoint
    from training.config import TrainConfig, load_object
    from training.trainer import run_training

    cfg = TrainConfig(
        workers=1,
        steps=steps,
        checkpoint_every=max(1, steps // 2),
        keep_checkpoints=2,
        log_every=10,
        lr=3e-4,
        warmup_steps=10,
        use_gpu=gpu,
        storage_path=str(home / "ckpt"),
        **overrides,
    )
    t = time.perf_counter()
    result = run_training(cfg, shards, "", "", name)
    wall = time.perf_counter() - t
    model = load_object(cfg.model_factory, "train.model_factory")(cfg)
    from training.model import flops_per_token

    fpt = flops_per_token(model, cfg.seq_len)
    info = verify_checkpoint(result.checkpoint_uri)
    return {
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "step": result.step,
        "final_loss": round(result.final_loss, 3),
        "tokens_per_s": round(result.tokens_per_s),
        "flops_per_token_g": round(fpt / 1e9, 3),
        "tflops": round(result.tokens_per_s * fpt / 1e12, 1),
        "mfu": round(result.tokens_per_s * fpt / PEAK, 3) if gpu else None,
        "stage_wall_s": round(wall, 1),
        "checkpoint": {"step": info.step, "world_size": info.world_size, "bytes": info.total_bytes},
        "_cfg": cfg,
        "_uri": result.checkpoint_uri,
    }


def lightning_checks(run: dict, shards, gpu: bool, steps: int, home: Path) -> dict:
    """The Lightning run again under the same name (resume: nothing left to train); its checkpoint served."""
    from training.checkpoint import load_unsharded
    from training.config import TrainConfig
    from training.data.loader import iter_texts
    from training.evaluate import bits_per_byte
    from training.lightning_loop import lightning_model
    from training.trainer import run_training

    cfg: TrainConfig = run["_cfg"]
    t = time.perf_counter()
    again = run_training(cfg, shards, "", "", "lightning-gpt")
    resume_s = time.perf_counter() - t
    model = lightning_model(cfg)
    load_unsharded(model, run["_uri"])
    device = "cuda" if gpu else "cpu"
    bpb = bits_per_byte(model.to(device), (t for _, t in iter_texts(shards.val_shards)), cfg.seq_len, device=device)
    return {
        "resumed_at_step": again.step,
        "resumed_checkpoint": again.checkpoint_uri == run["_uri"],
        "resume_wall_s": round(resume_s, 1),
        "val_bits_per_byte": round(bpb, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="tiny models on CPU (smoke test)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per run (default 200; CPU 4)")
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args()
    gpu = torch.cuda.is_available() and not args.cpu
    steps = args.steps or (200 if gpu else 4)
    gpt, llama = (GPT, LLAMA) if gpu else (TINY_GPT, TINY_LLAMA)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from support.train_support import shard_set

    out: dict = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        os.environ["SHARDLINE_HOME"] = str(home / "home")
        shards = shard_set(home / "shards", n_bytes=4_000_000 if gpu else 60_000)
        ray.init(address="local", num_cpus=8, num_gpus=1 if gpu else 0, include_dashboard=False, log_to_driver=False)
        try:
            seq = {"seq_len": gpt["seq_len"], "micro_batch": gpt["micro_batch"]}
            runs = {
                "builtin_gpt_fsdp2": ("builtin-gpt", dict(gpt)),
                "lightning_gpt_fsdp2": (
                    "lightning-gpt",
                    dict(gpt, loop="lightning", lightning_module="training.lightning_example:ByteGPTModule"),
                ),
                "builtin_llama_fsdp2": ("builtin-llama", dict(seq, hf_config=llama)),
                "builtin_llama_fsdp2_ac": (
                    "builtin-llama-ac",
                    dict(seq, hf_config=llama, activation_checkpointing=True),
                ),
            }
            for key, (name, overrides) in runs.items():
                try:
                    run = stage(name, overrides, shards, gpu, steps, home)
                    if key == "lightning_gpt_fsdp2":
                        run.update(lightning_checks(run, shards, gpu, steps, home))
                    out[key] = {k: v for k, v in run.items() if not k.startswith("_")}
                except Exception as e:  # noqa: BLE001 - one failed run is reported; the others still run
                    out[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
                    traceback.print_exc()
                print(key, json.dumps(out[key]), flush=True)
        finally:
            ray.shutdown()  # the cluster this script started
    a, b = out.get("lightning_gpt_fsdp2", {}), out.get("builtin_gpt_fsdp2", {})
    if a.get("tokens_per_s") and b.get("tokens_per_s"):
        out["lightning_vs_builtin_tokens_per_s"] = round(a["tokens_per_s"] / b["tokens_per_s"], 3)
    c, d = out.get("builtin_llama_fsdp2_ac", {}), out.get("builtin_llama_fsdp2", {})
    if c.get("tokens_per_s") and d.get("tokens_per_s"):
        out["llama_ac_vs_none_tokens_per_s"] = round(c["tokens_per_s"] / d["tokens_per_s"], 3)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
