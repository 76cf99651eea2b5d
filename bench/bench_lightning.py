"""Lightning-loop benchmark (prints ratios; not a test). The same GPT, data, worker count and parallelism on Ray Train:

tokens/s of `train.loop = "lightning"` (training/lightning_example.py under RayDDPStrategy, or Lightning's FSDP2
strategy with `--parallelism fsdp`, with shardline's DCP report callback) vs the built-in loop under the same DDP or
FSDP2, and the wall time of each stage as the pipeline runs it. Runs alternate (load from other work hits both
alike); the best of each is compared.

    python bench/bench_lightning.py [--config configs/lightning.toml] [--steps 100] [--repeat 2] [--parallelism fsdp]

Tokens/s is measured the same way in both loops (MetricsWindow: from the end of the first step).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_train import pipeline_stage, shards

from flows.config import load_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "lightning.toml"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--parallelism", choices=["ddp", "fsdp"], default="", help="default: the config's")
    args = p.parse_args()
    os.environ.setdefault("RAY_worker_niceness", "0")
    lit = load_config(args.config).train
    if args.parallelism:
        lit = lit.model_copy(update={"parallelism": args.parallelism})
    builtin = lit.model_copy(
        update={"loop": "builtin", "lightning_module": "", "model_factory": "training.model:build_gpt"}
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["SHARDLINE_HOME"] = str(work / "home")
        train = shards(args.config, work / "home")
        runs: dict[str, list[tuple[float, float]]] = {"lightning": [], "builtin": []}
        for i in range(args.repeat):
            for name, cfg in (("lightning", lit), ("builtin", builtin)):
                cfg = cfg.model_copy(
                    update={"steps": args.steps, "checkpoint_every": args.steps, "storage_path": str(work / "ray")}
                )
                wall, tps, _ = pipeline_stage(cfg, train, work, f"bench-{name}-{i}")
                runs[name].append((tps, wall))
        best = {k: (max(t for t, _ in v), min(w for _, w in v)) for k, v in runs.items()}
        (l_tps, l_wall), (b_tps, b_wall) = best["lightning"], best["builtin"]
        print(
            f"config {args.config}: {lit.workers} workers ({lit.parallelism}), {args.steps} steps, "
            f"d_model {lit.d_model}, {lit.n_layer} layers, seq_len {lit.seq_len}, "
            f"micro_batch {lit.micro_batch}; best of {args.repeat}"
        )
        print(f"{'':28s} {'tokens/s':>10s} {'wall s':>8s}   all runs (tokens/s, wall s)")
        print(f"{'Lightning loop':28s} {l_tps:10.0f} {l_wall:8.1f}   {runs['lightning']}")
        print(f"{'built-in loop':28s} {b_tps:10.0f} {b_wall:8.1f}   {runs['builtin']}")
        print(f"tokens/s  Lightning/built-in = {l_tps / b_tps:.3f}; wall  Lightning/built-in = {l_wall / b_wall:.3f}")


if __name__ == "__main__":
    main()
