"""Data-stage benchmark (prints ratios; not a test).

1. Shard writing throughput (webdataset.ShardWriter + metadata + sha256 of every shard) against a plain sequential
   write of the same record bytes to the same directory.                                   target >= 0.5x
2. Reader throughput of one rank (train_batches, demo config, world size = train.workers) against what the
   training stage consumes per rank (default 2000 tokens/s, i.e. bytes/s; --train-tokens-per-s).  target >= 10x

    python bench/bench_data.py [--config configs/demo.toml] [--repeat 5] [--scale 4] [--train-tokens-per-s 2000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flows.config import load_config
from training.data import build_shards
from training.data.corpus import Record, Tally, read_corpus
from training.data.loader import train_batches
from training.data.publish import fsync_tree
from training.data.shards import write_shards


def _median_time(fn, where: Path, repeat: int) -> float:
    """Median wall time of fn(fresh_path) over `repeat` runs; clean-up is not timed."""
    times = []
    for i in range(repeat):
        target = where / f"run-{i}"
        start = time.perf_counter()
        fn(target)
        times.append(time.perf_counter() - start)
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    return statistics.median(times)


def bench_writer(records: list[Record], cfg, where: Path, repeat: int, durable: bool) -> float:
    """Both sides write the same record bytes into a new path in the same directory. durable=False: into the page
    cache; durable=True: each side also fsyncs what it wrote, as the stage does before publishing locally."""
    payload = sum(len(r.data) for r in records)

    def shards(target: Path) -> None:
        write_shards(iter(records), target, cfg)
        if durable:
            fsync_tree(target)

    def plain(target: Path) -> None:
        with open(target, "wb") as fh:
            for rec in records:
                fh.write(rec.data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())

    t_shards, t_plain = [], []
    for _ in range(3):  # interleaved, so a noisy neighbour hits both sides alike
        t_shards.append(_median_time(shards, where, repeat))
        t_plain.append(_median_time(plain, where, repeat))
    t_shards_m, t_plain_m = statistics.median(t_shards), statistics.median(t_plain)
    mb = payload / 1e6
    print(
        f"writer ({'fsync' if durable else 'page cache'}): {len(records)} records, {mb:.1f} MB; "
        f"shards {mb / t_shards_m:.0f} MB/s "
        f"(tar + .json metadata + sha256 of every shard), plain write {mb / t_plain_m:.0f} MB/s"
    )
    ratio = t_plain_m / t_shards_m
    print(f"WRITE RATIO ({'durable' if durable else 'cached'}) shards/plain = {ratio:.2f}x (target >= 0.5x)")
    return ratio


def bench_reader(shards, train_cfg, tokens_per_s: float, seconds: float) -> float:
    """Batches/s one rank gets from train_batches (in-process and with one DataLoader worker, as training runs
    it), against the batches/s training consumes; records/s follow from the mean record size."""
    world = train_cfg.workers
    batch_tokens = train_cfg.micro_batch * train_cfg.seq_len
    mean_record = shards.total_bytes / max(1, shards.num_train + shards.num_val)
    need_batches = tokens_per_s / batch_tokens
    print(
        f"training consumes {tokens_per_s:.0f} tokens/s per rank = {need_batches:.2f} micro batches/s "
        f"(micro_batch={train_cfg.micro_batch}, seq_len={train_cfg.seq_len}) = "
        f"{tokens_per_s / mean_record:.3f} records/s (mean record {mean_record / 1e3:.1f} kB)"
    )
    ratios = []
    for workers in (0, 1):
        stream = train_batches(shards.train_shards, 0, world, train_cfg, 0, batches=10**9, num_workers=workers)
        next(stream)  # start-up (a forked DataLoader worker) is not throughput
        start, n = time.perf_counter(), 0
        for _ in stream:
            n += 1
            if time.perf_counter() - start > seconds:
                break
        rate = n / (time.perf_counter() - start)
        ratios.append(rate / need_batches)
        print(
            f"reader rank 0 of {world}, num_workers={workers}: {rate:.0f} micro batches/s = "
            f"{rate * batch_tokens / 1e6:.2f} M tokens/s = {rate * batch_tokens / mean_record:.0f} records/s "
            f"-> {ratios[-1]:.0f}x consumption"
        )
    ratio = min(ratios)
    print(f"READ RATIO reader/consumption = {ratio:.0f}x (the slower of the two; target >= 10x)")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(Path(__file__).resolve().parent.parent / "configs" / "demo.toml"))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--scale", type=int, default=4, help="Repeat the corpus this many times for the writer.")
    parser.add_argument("--train-tokens-per-s", type=float, default=2000.0)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    cfg = load_config(args.config)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        where = Path(tmp)
        base = list(read_corpus(cfg.data, Tally()))
        records = [Record(f"{i}/{r.key}", r.data, r.origin) for i in range(args.scale) for r in base]
        cached = bench_writer(records, cfg.data, where, args.repeat, durable=False)
        durable = bench_writer(records, cfg.data, where, args.repeat, durable=True)
        shards = build_shards(cfg.data.model_copy(update={"output": str(where / "out")}))
        read = bench_reader(shards, cfg.train, args.train_tokens_per_s, args.seconds)
    print(f"SUMMARY write {durable:.2f}x durable ({cached:.2f}x page cache only), read {read:.0f}x")


if __name__ == "__main__":
    main()
