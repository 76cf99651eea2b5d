"""A transformers model's FSDP2 step on Ray Train vs a bare torchrun script (prints ratios; not a test).

Same model (the config's `train.hf_config`, default configs/llama-tiny.toml), same worker count, batch, sequence
length, optimizer and clipping, three launchers, alternated `--repeat` times and the best run of each compared:

1. the training stage as the pipeline runs it: Ray Train's TorchTrainer, train_func, MLflow logging, checkpoints;
2. the same train_func under `torchrun` (what Ray Train itself costs);
3. bench/fsdp2_bare.py under `torchrun`: `fully_shard` per decoder layer, AdamW, clip, nothing else (what
   shardline's loop costs on top: metrics, checkpoints, the data stream).

Two figures per launcher, both from the end of the first (warm-up) step: the run's average (tokens/s up to the end,
the final checkpoint included) and the steady-state step (the stage's median logged `step_time_s` window, the bare
script's steps averaged the same way). Target: a steady-state step on Ray Train <= 1.10x the bare script's.

    python bench/bench_hf_step.py [--config configs/llama-tiny.toml] [--steps 40] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from bench_train import ROOT, pipeline_stage, shards, torchrun  # noqa: E402 - beside this file, not a package

from flows.config import load_config
from training.config import TrainConfig


def bare(cfg: TrainConfig, workdir: Path) -> tuple[float, float]:
    """(tokens/s, median step time) of bench/fsdp2_bare.py under torchrun with cfg's model and settings."""
    spec = workdir / "bare.json"
    keys = ("steps", "seq_len", "micro_batch", "lr", "weight_decay", "grad_clip", "seed", "log_every")
    spec.write_text(json.dumps({"hf_config": cfg.hf_config, **{k: getattr(cfg, k) for k in keys}}))
    cmd = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        f"--nproc-per-node={cfg.workers}",
        str(BENCH / "fsdp2_bare.py"),
        str(spec),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True, cwd=workdir)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return float(result["tokens_per_s"]), float(result["step_time_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "llama-tiny.toml"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeat", type=int, default=2, help="alternating runs of each launcher; the best is compared")
    args = p.parse_args()
    os.environ.setdefault("RAY_worker_niceness", "0")  # as bench_train: Ray's default nice 15 would skew a loaded box
    base = load_config(args.config).train
    if not isinstance(base.hf_config, dict):
        raise SystemExit(f"{args.config}: train.hf_config is not set; this bench compares a transformers model")
    plain = {
        "grad_accum": 1,
        "activation_checkpointing": False,
        "parallelism": "fsdp",
        "use_gpu": False,
        "mixed_precision": "auto",
        "reshard_after_forward": True,
        "threads_per_worker": 1,
        "cpu_offload": False,
    }
    differ = {k: getattr(base, k) for k, v in plain.items() if getattr(base, k) != v}
    if differ:
        raise SystemExit(f"{args.config}: the bare script runs {plain} on CPU; this config sets {differ}")
    if args.steps < 3 * base.log_every:
        raise SystemExit(f"--steps {args.steps}: at least 3 x train.log_every={base.log_every} (two timed windows)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["SHARDLINE_HOME"] = str(work / "home")
        train = shards(args.config, work / "home")
        cfg = base.model_copy(
            update={
                "steps": args.steps,
                "checkpoint_every": args.steps,
                "storage_path": str(work / "ray"),
                "init_from": "",
            }
        )
        tokens = cfg.workers * cfg.micro_batch * cfg.seq_len
        avg: dict[str, list[float]] = {"ray": [], "torchrun": [], "bare": []}
        step: dict[str, list[float]] = {"ray": [], "bare": []}
        for i in range(args.repeat):  # alternate, so load from other processes hits all alike
            tps, step_s = bare(cfg, work)
            avg["bare"].append(tps)
            step["bare"].append(step_s)
            avg["torchrun"].append(torchrun(cfg, train, work, cfg.workers)[0]["tokens_per_s"])
            shutil.rmtree(work / f"ckpt-{cfg.workers}-{cfg.steps}", ignore_errors=True)  # else the next one resumes
            _, tps, step_s = pipeline_stage(cfg, train, work, f"bench-hf-{i}")
            avg["ray"].append(tps)
            step["ray"].append(step_s)
        best_avg = {k: max(v) for k, v in avg.items()}
        best_step = {k: min(v) for k, v in step.items()}
        print(
            f"config {args.config}: {cfg.hf_config.get('model_type')} {cfg.hf_config.get('num_hidden_layers')} layers "
            f"hidden {cfg.hf_config.get('hidden_size')}, {cfg.workers} workers, {cfg.steps} steps, seq_len "
            f"{cfg.seq_len}, micro_batch {cfg.micro_batch}, log_every {cfg.log_every}; best of {args.repeat}"
        )
        print(f"{'':30s} {'run avg tok/s':>14s} {'step s':>8s} {'step tok/s':>11s}   all runs (avg tok/s; step s)")
        for key, label in (("ray", "Ray Train stage (train_func)"), ("torchrun", "torchrun (train_func)"),
                           ("bare", "torchrun (bare FSDP2 script)")):  # fmt: skip
            s_best = best_step.get(key)
            cols = f"{s_best:8.3f} {tokens / s_best:11.0f}" if s_best else f"{'-':>8s} {'-':>11s}"
            runs = [round(x) for x in avg[key]], [round(x, 3) for x in step.get(key, [])]
            print(f"{label:30s} {best_avg[key]:14.0f} {cols}   {runs[0]}; {runs[1]}")
        print(
            f"steady-state step  Ray Train / bare script = {best_step['ray'] / best_step['bare']:.3f}x "
            f"(target <= 1.10); run average: Ray Train / bare = {best_avg['bare'] / best_avg['ray']:.3f}x, "
            f"Ray Train / torchrun same function = {best_avg['torchrun'] / best_avg['ray']:.3f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
