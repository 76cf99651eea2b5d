"""Parallel sharding: chunks written by 1, 2 or 3 worker processes give the same bytes; errors keep corpus order;
the quality gate gives the same verdict batch by batch as in one piece."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.data_helpers import config, make_corpus

from training.data import DataError, build_shards
from training.data.engine import run_chunks
from training.data.plan import plan_chunks
from training.data.quality import QualityError
from training.data.worker import ChunkJob

# ~60 files of 400-800 bytes: 2 KiB chunks give 20-odd chunks, so every worker count really splits the work.
SMALL_CHUNKS = {"chunk_bytes": 2048}


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))


def _files(root: Path) -> dict[str, bytes]:
    """Shards and manifest (validation.json is the GX report, which carries the time it ran)."""
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.name != "validation.json"}


def test_one_two_and_three_workers_write_byte_identical_sets(tmp_path):
    corpus = make_corpus(tmp_path / "c", n=60)
    sets = {w: build_shards(config(corpus, tmp_path / f"out-{w}", workers=w, **SMALL_CHUNKS)) for w in (1, 2, 3)}
    one = sets[1]
    assert one.chunks >= 10 and one.num_train + one.num_val == 60
    chunk_ids = {Path(u).name.split("-")[1] for u in one.train_shards + one.val_shards}
    assert len(chunk_ids) == one.chunks  # every chunk wrote its own shards
    for workers, shards in sets.items():
        assert shards.workers == workers and shards.chunks == one.chunks
        assert shards.dataset_digest == one.dataset_digest
        assert _files(Path(shards.uri)) == _files(Path(one.uri))


def test_a_corpus_of_a_few_chunks_is_written_in_process_when_workers_are_automatic(tmp_path, monkeypatch):
    # Starting two workers costs more than they save on <= 4 chunks: with data.workers = 0 the listing decides;
    # an explicit data.workers is obeyed. The bytes are the same either way.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # "2 cores", whatever the host
    corpus = make_corpus(tmp_path / "c", n=8)  # ~5 KB: 2-3 chunks of 2 KiB
    auto = build_shards(config(corpus, tmp_path / "auto", workers=0, **SMALL_CHUNKS))
    two = build_shards(config(corpus, tmp_path / "two", workers=2, **SMALL_CHUNKS))
    assert auto.chunks == two.chunks >= 2 and auto.workers == 1 and two.workers == 2
    assert _files(Path(auto.uri)) == _files(Path(two.uri))
    large = build_shards(config(make_corpus(tmp_path / "l", n=60), tmp_path / "large", workers=0, **SMALL_CHUNKS))
    assert large.chunks >= 10 and large.workers == 2
    # Without the listing index nothing is listed before the build: two chunks or more start the workers.
    unlisted = build_shards(config(corpus, tmp_path / "unlisted", workers=0, reuse_unchanged=False, **SMALL_CHUNKS))
    assert unlisted.workers == 2 and unlisted.dataset_digest == auto.dataset_digest


def test_chunks_run_in_worker_processes_and_come_back_in_corpus_order(tmp_path):
    cfg = config(make_corpus(tmp_path / "c", n=60), tmp_path / "out", **SMALL_CHUNKS)
    (tmp_path / "s").mkdir()
    (tmp_path / "r").mkdir()
    job = ChunkJob(cfg, shards=str(tmp_path / "s"), rows=str(tmp_path / "r"))
    results = list(run_chunks(plan_chunks(cfg), job, "local", 2))
    assert [r.index for r in results] == list(range(len(results))) and len(results) >= 10
    assert os.getpid() not in {r.pid for r in results}
    assert sum(r.records for r in results) == 60


def test_the_first_bad_file_in_corpus_order_is_reported_whatever_the_workers(tmp_path):
    corpus = make_corpus(tmp_path / "c", n=60)
    # b/ sorts after a/: the NUL file in a/ comes first in corpus order, the one in b/ many chunks later
    (corpus / "a" / "zz-first.txt").write_bytes(b"first\x00")
    (corpus / "b" / "zz-later.txt").write_bytes(b"later\x00")
    for workers in (1, 3):
        out = tmp_path / f"out-{workers}"
        with pytest.raises(DataError) as err:
            build_shards(config(corpus, out, workers=workers, on_binary="fail", **SMALL_CHUNKS))
        assert str(err.value).startswith(str(corpus / "a" / "zz-first.txt")) and "\n" not in str(err.value)
        assert [p.name for p in out.iterdir()] == ["_staging"] and list((out / "_staging").iterdir()) == []


def test_skipped_records_are_counted_alike_across_chunks(tmp_path):
    corpus = make_corpus(tmp_path / "c", n=60)
    for i in range(5):
        (corpus / "a" / f"empty{i}.txt").write_bytes(b"")
    counts = [build_shards(config(corpus, tmp_path / f"o{w}", workers=w, **SMALL_CHUNKS)).skipped for w in (1, 2)]
    assert counts == [{"empty": 5}, {"empty": 5}]


def test_listing_error_comes_after_the_chunks_listed_before_it(tmp_path):
    """A walk finds 'no matching files' only at its end; a bad entry listed before that is reported first."""
    root = tmp_path / "c"
    root.mkdir()
    os.symlink("missing.txt", root / "gone.txt")
    with pytest.raises(DataError, match="dangling symlink"):
        build_shards(config(root, tmp_path / "out", include="*.txt", on_symlink_loop="fail", workers=2))
    with pytest.raises(DataError, match=r"no files matching '\*\.md'"):
        build_shards(config(root, tmp_path / "out", include="*.md", workers=2))


def _dup_reader(source, cfg):
    for i in range(30):
        yield (f"k{i % 25}", f"text number {i}\n".encode())


@pytest.mark.parametrize("batch", [7, 1000])
def test_gate_in_batches_gives_the_verdict_of_one_frame(tmp_path, batch):
    cfg = config(
        "unused",
        tmp_path / "out",
        reader=f"{__name__}:_dup_reader",
        val_fraction=0.33,
        split_tolerance=0.0,
        gate_batch_records=batch,
    )
    with pytest.raises(QualityError) as err:
        build_shards(cfg)
    lines = str(err.value).splitlines()
    assert "2 of 6 expectations" in lines[0]
    unique = next(line for line in lines if "expect_column_values_to_be_unique" in line)
    assert "10 of 30 records, e.g. keys ['k0', 'k1', 'k2']" in unique
    assert err.value.report["meta"]["shardline"] == {"records": 30, "batches": -(-30 // batch), "batch_records": batch}
    between = [r for r in err.value.report["results"] if r["expectation_config"]["type"].endswith("between")]
    assert all(r["result"]["element_count"] == 30 for r in between if "element_count" in r["result"])


def test_ray_engine_without_a_cluster_is_one_line(tmp_path):
    import ray

    if ray.is_initialized():  # a connection an earlier test of this process left: this test needs none
        ray.shutdown()
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"^data.engine='ray' needs a Ray cluster: run the pipeline"):
        build_shards(config(make_corpus(tmp_path / "c"), out, engine="ray"))
    assert list((out / "_staging").iterdir()) == []
