"""data.engine='ray': the same chunks as Ray tasks on a real (local) Ray cluster give the same bytes as one local
process; with an S3 output (moto server) the tasks upload the shards themselves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.data_helpers import config, make_corpus

from infra import storage
from training.data import DataError, build_shards, load_shard_set

SMALL_CHUNKS = {"chunk_bytes": 2048}


@pytest.fixture(scope="module")
def ray_cluster(s3_service):
    """Ray on this machine, started after the S3 variables are set so its worker processes inherit them."""
    import ray

    saved = {k: os.environ.get(k) for k in s3_service.env()}
    os.environ.update(s3_service.env())
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))


def _contents(uris: list[str]) -> list[tuple[str, bytes]]:
    return [(u.rsplit("/", 1)[1], storage.read_bytes(u)) for u in uris]


def test_ray_engine_writes_what_one_local_process_writes(ray_cluster, tmp_path):
    corpus = make_corpus(tmp_path / "c", n=60)
    local = build_shards(config(corpus, tmp_path / "local", workers=1, **SMALL_CHUNKS))
    on_ray = build_shards(config(corpus, tmp_path / "ray", engine="ray", **SMALL_CHUNKS))
    assert on_ray.chunks == local.chunks >= 10 and on_ray.workers == 2  # data.workers=0: the cluster's CPUs
    assert on_ray.dataset_digest == local.dataset_digest
    assert _contents(on_ray.train_shards + on_ray.val_shards) == _contents(local.train_shards + local.val_shards)
    assert Path(on_ray.manifest_uri).read_bytes() == Path(local.manifest_uri).read_bytes()


def test_ray_tasks_read_an_s3_corpus_and_upload_the_shards(ray_cluster, s3_server, unique_prefix, tmp_path):
    corpus = make_corpus(tmp_path / "c", n=60)
    base = f"s3://shardline/{unique_prefix}"
    for path in sorted(p for p in corpus.rglob("*") if p.is_file()):
        storage.upload_file(path, storage.join(base, "corpus", str(path.relative_to(corpus))))
    local = build_shards(config(corpus, tmp_path / "local", workers=1, **SMALL_CHUNKS))
    remote = build_shards(
        config(storage.join(base, "corpus"), storage.join(base, "out"), engine="ray", workers=2, **SMALL_CHUNKS)
    )
    assert remote.dataset_digest == local.dataset_digest and not remote.cache_hit
    assert _contents(remote.train_shards + remote.val_shards) == _contents(local.train_shards + local.val_shards)
    assert storage.list_prefix(storage.join(base, "out", "_staging")) == []
    assert load_shard_set(remote.uri, verify="sha256").num_train == local.num_train
    again = build_shards(
        config(storage.join(base, "corpus"), storage.join(base, "out"), engine="ray", workers=2, **SMALL_CHUNKS)
    )
    assert again.cache_hit and storage.list_prefix(storage.join(base, "out", "_staging")) == []


def test_a_bad_record_in_a_ray_task_is_one_line_naming_the_file(ray_cluster, tmp_path):
    corpus = make_corpus(tmp_path / "c", n=60)
    (corpus / "b" / "zz.txt").write_bytes(b"caf\xe9\n")
    out = tmp_path / "out"
    with pytest.raises(DataError) as err:
        build_shards(config(corpus, out, engine="ray", on_undecodable="fail", **SMALL_CHUNKS))
    assert str(err.value) == f"{corpus / 'b' / 'zz.txt'}: not valid UTF-8 at byte 3 (data.on_undecodable=fail)"
    assert list((out / "_staging").iterdir()) == []
