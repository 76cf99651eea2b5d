"""`shardline shard` as a user runs it (prints figures; not a test): the whole process against the stage inside it.

For each corpus size and worker count, a fresh $SHARDLINE_HOME (so MLflow's schema is created, as on a first run)
and a fresh output, the command `shardline shard --json` is timed as a process; its own `wall_seconds` is the data
stage. The difference is the fixed cost a user pays per run: interpreter start, imports, MLflow's store, the
parent run. Great Expectations is imported on a thread from the gate's start (training/data/quality.py), so its
~2-3 s overlap the listing and the first chunks instead of adding to them.

    python bench/bench_shard_process.py [--sizes 50,400] [--workers 1,2] [--repeat 2] [--where /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_shard_scale import make_corpus  # bench/ is on sys.path when this script runs

REPO = Path(__file__).resolve().parent.parent


def run_once(corpus: Path, where: Path, workers: int) -> tuple[float, float]:
    """(process seconds, stage seconds) of one `shardline shard` on a fresh home and output."""
    home = Path(tempfile.mkdtemp(prefix="home-", dir=where))
    out = Path(tempfile.mkdtemp(prefix="out-", dir=where))
    env = {
        **os.environ,
        "SHARDLINE_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "RAY_USAGE_STATS_ENABLED": "0",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [
        str(Path(sys.executable).with_name("shardline")),
        "shard",
        "--json",
        "--set",
        f'data.source="{corpus}"',
        "--set",
        f'data.output="{out}"',
        "--set",
        f"data.workers={workers}",
        "--set",
        'data.format="text"',
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    seconds = time.perf_counter() - start
    shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"shardline shard failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    return seconds, float(json.loads(proc.stdout.strip().splitlines()[-1])["wall_seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,400", help="corpus sizes in MB, comma-separated")
    parser.add_argument("--workers", default="1,2", help="data.workers values, comma-separated")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each case (fastest kept)")
    parser.add_argument("--where", default=tempfile.gettempdir(), help="where corpora, homes and outputs go")
    args = parser.parse_args()
    where = Path(tempfile.mkdtemp(prefix="shard-process-", dir=args.where))
    try:
        print(f"{'MB':>5} {'workers':>7} {'process s':>10} {'stage s':>8} {'fixed s':>8} {'stage/process':>13}")
        for mb in [int(s) for s in args.sizes.split(",")]:
            corpus = where / f"corpus-{mb}"
            make_corpus(corpus, mb)
            for workers in [int(w) for w in args.workers.split(",")]:
                runs = [run_once(corpus, where, workers) for _ in range(args.repeat)]
                process, stage = min(runs)
                print(
                    f"{mb:>5} {workers:>7} {process:>10.2f} {stage:>8.2f} {process - stage:>8.2f} "
                    f"{stage / process:>13.2f}",
                    flush=True,
                )
            shutil.rmtree(corpus, ignore_errors=True)
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
