"""Data stage at scale (prints ratios; not a test): how time and memory grow from ~50 MB to ~2 GB of corpus.

For each corpus size: the whole data stage (build_shards: read, check, split, write, sha256, GX gate, fsync of every
shard, publish) in a child process, with its seconds, MB/s and peak resident memory (the largest process, from
getrusage, and the whole process tree summed, sampled from /proc every 100 ms; the gate's one-off imports of Great
Expectations and pandas are done before the clock starts and printed apart); beside it Python's `tarfile`
writing the same files into tar files of the same member count, fsyncing each, as the stage fsyncs each shard.
At the largest size (where the serial parts, pool start and gate, weigh least), the stage with 1 worker and with 2
(--repeat runs each, interleaved, fastest kept).

Targets: time(largest)/time(smallest) <= 1.1 x the size ratio; peak tree RSS at the largest <= 1.2 x at the
smallest; stage MB/s >= 0.5 x tarfile MB/s; 2 workers >= 1.7 x 1 worker. With automatic workers (--workers 0,
the default) a corpus of at most 4 chunks is written in one process, so the smallest size is also run with the
cores' worker count: the RSS ratio at the same process layout.

Corpora are generated under --where from the interpreter's standard-library .py files, each copy perturbed (a
header line naming the copy, and its files' lines rotated by the copy number) so no two records are equal; they
are deleted afterwards.

    python bench/bench_shard_scale.py [--sizes 50,500,2000] [--where /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHILD = """
import json, resource, sys, time
sys.path.insert(0, {repo!r})
start = time.perf_counter()
import great_expectations, pandas  # the gate's one-off imports (~3 s, 10 s on a loaded box): not throughput
imports = time.perf_counter() - start
from training.data import build_shards
from training.data.config import DataConfig
cfg = DataConfig.model_validate_json({cfg!r})
start = time.perf_counter()
shards = build_shards(cfg)
seconds = time.perf_counter() - start
print(json.dumps({{"seconds": seconds, "imports": imports, "digest": shards.dataset_digest, "bytes": shards.total_bytes,
                  "records": shards.num_train + shards.num_val, "chunks": shards.chunks,
                  "self_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "children_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}}))
"""


def make_corpus(root: Path, megabytes: int) -> int:
    """Copies of the stdlib's top-level .py files under root/copy-NNNNN/, perturbed per copy; returns bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [
        (p.name, p.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True))
        for p in sorted(stdlib.iterdir())
        if p.is_file() and p.name.endswith(".py")
    ]
    texts = [(name, lines) for name, lines in texts if lines]
    total, copy = 0, 0
    while total < megabytes * 1_000_000:
        directory = root / f"copy-{copy:05d}"
        directory.mkdir(parents=True)
        for name, lines in texts:
            k = copy % len(lines)
            body = f"# shardline bench copy {copy} of {name}\n" + "".join(lines[k:] + lines[:k])
            data = body.encode("utf-8")
            (directory / name).write_bytes(data)
            total += len(data)
        copy += 1
    return total


def _tree_rss_kb(root_pid: int) -> int:
    """Resident kB of root_pid and its descendants, following /proc/PID/task/TID/children (not a scan of every
    process on the box, which cost the stage a fifth of a core at 20 samples/s)."""
    page_kb, total, todo = os.sysconf("SC_PAGE_SIZE") // 1024, 0, [root_pid]
    while todo:
        pid = todo.pop()
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page_kb
            for task in os.scandir(f"/proc/{pid}/task"):
                todo += [int(c) for c in Path(task.path, "children").read_text().split()]
        except (OSError, ValueError):
            continue  # exited meanwhile
    return total


def run_stage(corpus: Path, out: Path, workers: int, keep: bool = False) -> dict:
    """The data stage in a child process; its own report plus the sampled peak RSS of its process tree.
    The output is deleted afterwards unless `keep`."""
    from training.data.config import DataConfig

    cfg = DataConfig(source=str(corpus), output=str(out), workers=workers)
    code = CHILD.format(repo=str(REPO), cfg=cfg.model_dump_json())
    env = {**os.environ, "SHARDLINE_HOME": str(out.parent / "home")}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss_kb(proc.pid))
        time.sleep(0.1)
    stdout = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"stage failed with exit code {proc.returncode}")
    report = json.loads(stdout.strip().splitlines()[-1])
    report["tree_kb"] = peak
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return report


def run_tar(corpus: Path, out: Path, per_tar: int) -> tuple[float, int]:
    """tarfile writing every corpus file, `per_tar` members per tar file, each fsynced; (seconds, bytes)."""
    files = sorted(p for p in corpus.rglob("*") if p.is_file())
    out.mkdir(parents=True)
    start, written = time.perf_counter(), 0
    for n in range(0, len(files), per_tar):
        path = out / f"{n // per_tar:06d}.tar"
        with open(path, "wb") as fh:
            with tarfile.open(fileobj=fh, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                for f in files[n : n + per_tar]:
                    tar.add(f, arcname=str(f.relative_to(corpus)))
            fh.flush()
            os.fsync(fh.fileno())
            written += fh.tell()
    fd = os.open(out, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    seconds = time.perf_counter() - start
    shutil.rmtree(out)
    return seconds, written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,500,2000", help="corpus sizes in MB, comma-separated")
    parser.add_argument("--where", default=tempfile.gettempdir(), help="where corpora and outputs are written")
    parser.add_argument("--workers", type=int, default=0, help="workers of the size series (0: the cores)")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each side of the 1-vs-2-workers comparison")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    sys.path.insert(0, str(REPO))
    from training.data.config import DataConfig

    per_tar = DataConfig().max_samples_per_shard
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-shard-scale-", dir=args.where) as tmp:
        for mb in sizes:
            corpus = Path(tmp) / f"corpus-{mb}"
            t0 = time.perf_counter()
            size = make_corpus(corpus, mb)
            print(f"corpus {mb} MB: {size / 1e6:.0f} MB generated in {time.perf_counter() - t0:.0f} s", flush=True)
            tar_s, _ = run_tar(corpus, Path(tmp) / "tar", per_tar)
            stage = run_stage(corpus, Path(tmp) / "out", args.workers, keep=True)
            rerun = run_stage(corpus, Path(tmp) / "out", args.workers)  # the nightly rerun: listing unchanged
            rows[mb] = {"bytes": size, "tar_s": tar_s, "rerun_s": rerun["seconds"], **stage}
            if mb == sizes[0] and args.workers == 0:  # automatic workers write a small corpus in one process
                pooled = run_stage(corpus, Path(tmp) / "out", cores)
                rows[mb]["pooled_tree_kb"] = pooled["tree_kb"]
                print(
                    f"  with data.workers={cores} (the processes of the largest size): {pooled['seconds']:.2f} s, "
                    f"peak RSS {pooled['tree_kb'] / 1024:.0f} MB tree",
                    flush=True,
                )
            print(
                f"  stage ({stage['chunks']} chunks): {stage['seconds']:.1f} s = {size / 1e6 / stage['seconds']:.1f} "
                f"MB/s, peak RSS {stage['tree_kb'] / 1024:.0f} MB tree / "
                f"{max(stage['self_kb'], stage['children_kb']) / 1024:.0f} MB largest process "
                f"(+{stage['imports']:.1f} s imports before the clock); tarfile "
                f"{tar_s:.1f} s = {size / 1e6 / tar_s:.1f} MB/s -> {tar_s / stage['seconds']:.2f}x tar; rerun with "
                f"the listing unchanged {rerun['seconds']:.2f} s ({rerun['chunks']} chunks read)",
                flush=True,
            )
            if mb == sizes[-1]:
                runs: dict[int, list[dict]] = {1: [], 2: []}
                for _ in range(args.repeat):  # interleaved; the fastest of each is the least disturbed
                    for workers in (1, 2):
                        runs[workers].append(run_stage(corpus, Path(tmp) / "out", workers))
                one, two = (min(runs[w], key=lambda r: r["seconds"]) for w in (1, 2))
                rows["workers"] = (one, two)
                print(
                    f"  1 worker {one['seconds']:.1f} s, 2 workers {two['seconds']:.1f} s -> "
                    f"{one['seconds'] / two['seconds']:.2f}x (same digest: {one['digest'] == two['digest']})",
                    flush=True,
                )
            shutil.rmtree(corpus)
    small, large = rows[sizes[0]], rows[sizes[-1]]
    size_ratio = large["bytes"] / small["bytes"]
    time_ratio = large["seconds"] / small["seconds"]
    rss_ratio = large["tree_kb"] / small["tree_kb"]
    rss_largest = max(large["self_kb"], large["children_kb"]) / max(small["self_kb"], small["children_kb"])
    tar_ratio = large["tar_s"] / large["seconds"]
    tar_worst = min(rows[mb]["tar_s"] / rows[mb]["seconds"] for mb in sizes)
    one, two = rows["workers"]
    print(
        f"TIME RATIO {sizes[-1]}/{sizes[0]} MB = {time_ratio:.1f} for size ratio {size_ratio:.1f}: "
        f"{time_ratio / size_ratio:.2f}x the size ratio (target <= 1.1)"
    )
    print(f"RSS RATIO {sizes[-1]}/{sizes[0]} MB = {rss_ratio:.2f} (process tree; target <= 1.2)")
    if "pooled_tree_kb" in small:
        print(
            f"RSS RATIO {sizes[-1]}/{sizes[0]} MB with the same processes ({cores} workers at both) = "
            f"{large['tree_kb'] / small['pooled_tree_kb']:.2f}; largest process {rss_largest:.2f} "
            f"(at {sizes[0]} MB the automatic workers wrote it in one process)"
        )
    print(
        f"TAR RATIO stage/tarfile throughput = {tar_ratio:.2f}x at {sizes[-1]} MB, {tar_worst:.2f}x at worst "
        "(target >= 0.5)"
    )
    print(
        f"RERUN (listing unchanged) at {sizes[-1]} MB: {large['rerun_s']:.2f} s vs {large['seconds']:.1f} s "
        "to build (the corpus is not read; the set is verified by sha256)"
    )
    print(f"WORKERS RATIO 2/1 = {one['seconds'] / two['seconds']:.2f}x (target >= 1.7)")


if __name__ == "__main__":
    main()
