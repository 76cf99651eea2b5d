"""Training-stage benchmark (prints ratios; not a test). The same train_func, model, data and worker count:

1. tokens/s: Ray Train + FSDP2  vs  torchrun + FSDP2 (target >= 0.97)  vs  one process (world size 1);
2. wall time: the stage as the pipeline runs it (ray.init + TorchTrainer + MLflow logging + checkpoints)
   vs a bare `torchrun` of the same training, at the config's step count and at --long-steps
   (targets: <= 30 s fixed overhead; <= 1.15x at 2,000 steps).

    python bench/bench_train.py [--config configs/demo.toml] [--steps 100] [--long-steps 2000] [--skip-long]

Tokens/s is measured inside train_func (after its first step), identically under every launcher.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flows.config import load_config
from training.config import TrainConfig


def shards(config_path: str, home: Path) -> list[str]:
    from training.data import build_shards

    data = load_config(config_path).data.model_copy(update={"output": str(home / "shards")})
    return build_shards(data).train_shards


def torchrun(cfg: TrainConfig, train: list[str], workdir: Path, nproc: int) -> tuple[dict, float]:
    spec = workdir / f"torchrun-{nproc}-{cfg.steps}.json"
    spec.write_text(
        json.dumps(
            {
                "train": cfg.model_dump(),
                "train_shards": train,
                "checkpoint_root": str(workdir / f"ckpt-{nproc}-{cfg.steps}"),
            }
        )
    )
    cmd = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "training.loop",
        str(spec),
    ]
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1]), time.perf_counter() - t


def single(cfg: TrainConfig, train: list[str], workdir: Path) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json,sys; from training.loop import train_func; "
            "print(json.dumps(train_func(json.loads(sys.argv[1]))))",
            json.dumps(
                {
                    "train": cfg.model_copy(update={"workers": 1}).model_dump(),
                    "train_shards": train,
                    "checkpoint_root": str(workdir / f"single-{cfg.steps}"),
                }
            ),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=True,
        cwd=ROOT,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def pipeline_stage(cfg: TrainConfig, train: list[str], workdir: Path, name: str) -> tuple[float, float, float]:
    """Wall time of the stage as the flow runs it (Ray start, MLflow run, TorchTrainer.fit, teardown), its tokens/s
    over the run, and its steady-state step time: the median `step_time_s` of the logged windows after the first."""
    t = time.perf_counter()
    import mlflow
    import ray

    from infra.tracking import setup_tracking
    from training.data import ShardSet
    from training.trainer import run_training

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    exp = setup_tracking(uri, "bench")
    run_id = mlflow.MlflowClient(uri).create_run(exp).info.run_id
    shard_set = ShardSet(
        dataset_digest="0" * 32,
        uri=str(workdir),
        manifest_uri="",
        train_shards=train,
        val_shards=[],
        num_train=len(train),
        num_val=0,
        total_bytes=0,
        cache_hit=False,
    )
    result = run_training(cfg, shard_set, uri, run_id, name)
    ray.shutdown()
    wall = time.perf_counter() - t
    windows = [m.value for m in mlflow.MlflowClient(uri).get_metric_history(run_id, "step_time_s")][1:]
    return wall, result.tokens_per_s, statistics.median(windows) if windows else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.toml"))
    p.add_argument("--steps", type=int, default=0, help="steps of the throughput runs (default: the config's)")
    p.add_argument("--long-steps", type=int, default=2000)
    p.add_argument("--skip-long", action="store_true")
    p.add_argument("--repeat", type=int, default=2, help="alternating runs of each launcher; the best is compared")
    args = p.parse_args()
    # Ray starts its workers at nice 15 (its default), torchrun's at 0: on a machine shared with other work that
    # alone halves Ray's share of the CPU. Compare like with like.
    os.environ.setdefault("RAY_worker_niceness", "0")
    base = load_config(args.config).train
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["SHARDLINE_HOME"] = str(work / "home")
        train = shards(args.config, work / "home")
        cfg = base.model_copy(update={"steps": args.steps or base.steps, "storage_path": str(work / "ray")})
        runs: dict[str, list] = {"torchrun": [], "ray": []}
        for _ in range(args.repeat):  # alternate, so load from other processes hits both alike
            tr, tr_wall = torchrun(cfg, train, work, cfg.workers)
            runs["torchrun"].append((tr["tokens_per_s"], tr_wall))
            shutil.rmtree(work / f"ckpt-{cfg.workers}-{cfg.steps}", ignore_errors=True)
            wall, tps, _ = pipeline_stage(cfg, train, work, f"bench-{len(runs['ray'])}")
            runs["ray"].append((tps, wall))
        one = single(cfg, train, work)
        best = {k: (max(t for t, _ in v), min(w for _, w in v)) for k, v in runs.items()}
        (ray_tps, ray_wall), (tr_tps, tr_wall) = best["ray"], best["torchrun"]
        print(
            f"config {args.config}: {cfg.workers} workers, {cfg.steps} steps, d_model {cfg.d_model}, "
            f"{cfg.n_layer} layers, seq_len {cfg.seq_len}, micro_batch {cfg.micro_batch}; best of {args.repeat}"
        )
        print(f"{'':28s} {'tokens/s':>10s} {'wall s':>8s}   all runs (tokens/s, wall s)")
        print(f"{'Ray Train + FSDP2':28s} {ray_tps:10.0f} {ray_wall:8.1f}   {runs['ray']}")
        print(f"{'torchrun + FSDP2':28s} {tr_tps:10.0f} {tr_wall:8.1f}   {runs['torchrun']}")
        print(f"{'one process':28s} {one['tokens_per_s']:10.0f}")
        print(
            f"tokens/s  Ray/torchrun = {ray_tps / tr_tps:.3f} (target >= 0.97); "
            f"Ray/one process = {ray_tps / one['tokens_per_s']:.2f}"
        )
        print(
            f"wall      pipeline stage - torchrun = {ray_wall - tr_wall:+.1f} s (target <= 30 s); "
            f"ratio {ray_wall / tr_wall:.2f}",
            flush=True,
        )
        if not args.skip_long:
            long_cfg = cfg.model_copy(
                update={"steps": args.long_steps, "checkpoint_every": max(cfg.checkpoint_every, args.long_steps // 10)}
            )
            _, tr_long = torchrun(long_cfg, train, work, cfg.workers)
            ray_long, _, _ = pipeline_stage(long_cfg, train, work, "bench-long")
            print(
                f"wall at {args.long_steps} steps: pipeline stage {ray_long:.1f} s, torchrun {tr_long:.1f} s, "
                f"ratio {ray_long / tr_long:.3f} (target <= 1.15)"
            )


if __name__ == "__main__":
    main()
