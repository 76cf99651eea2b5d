"""Parquet files and a save_to_disk directory in S3 (moto server) and Azure Blob (Azurite): the same set as local."""

from __future__ import annotations

from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.data_helpers import config

from infra import storage
from training.data import DataError, build_shards


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    datasets.disable_progress_bars()


@pytest.fixture(params=["s3", "az"])
def store(request, unique_prefix):
    request.getfixturevalue("s3_server" if request.param == "s3" else "azurite")
    return f"{request.param}://shardline/{unique_prefix}"


def _upload(local_root: Path, base: str) -> str:
    for path in sorted(p for p in local_root.rglob("*") if p.is_file()):
        storage.upload_file(path, storage.join(base, path.relative_to(local_root).as_posix()))
    return base


def _texts(n: int = 90) -> list[str]:
    return [f"row {i}: " + "the quick brown fox " * (2 + i % 5) for i in range(n)]


def test_parquet_in_a_store_gives_the_local_set(tmp_path, store):
    local = tmp_path / "pq"
    local.mkdir()
    texts = _texts()
    for f in range(3):
        pq.write_table(pa.table({"text": texts[f * 30 : (f + 1) * 30]}), local / f"p{f}.parquet", row_group_size=8)
    here = build_shards(config(local, tmp_path / "out", format="parquet", chunk_bytes=1024))
    there = build_shards(
        config(
            _upload(local, storage.join(store, "pq")),
            storage.join(store, "out"),
            format="parquet",
            chunk_bytes=1024,
            workers=2,
        )
    )
    assert there.dataset_digest == here.dataset_digest and there.chunks == 3 and there.skipped == {}


def test_saved_dataset_dict_in_a_store_gives_the_local_set(tmp_path, store):
    texts = _texts()
    splits = {
        "train": datasets.Dataset.from_dict({"text": texts[:70]}),
        "test": datasets.Dataset.from_dict({"text": texts[70:]}),
    }
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"), num_shards={"train": 3, "test": 1})
    here = build_shards(config(tmp_path / "dd", tmp_path / "out", format="hf_dataset", chunk_bytes=1024))
    source = _upload(tmp_path / "dd", storage.join(store, "dd"))
    there = build_shards(config(source, storage.join(store, "out"), format="hf_dataset", chunk_bytes=1024))
    assert there.dataset_digest == here.dataset_digest and there.num_train + there.num_val == 90
    assert there.chunks == here.chunks == 4


def test_saved_dataset_in_a_store_without_the_column_is_one_line(tmp_path, store):
    datasets.Dataset.from_dict({"body": _texts()}).save_to_disk(str(tmp_path / "ds"))
    source = _upload(tmp_path / "ds", storage.join(store, "ds"))
    with pytest.raises(DataError) as err:
        build_shards(config(source, storage.join(store, "out"), format="hf_dataset"))
    assert str(err.value) == f"{source}: no column 'text' (data.text_field; columns: body)"
    assert [e for e in storage.list_prefix(storage.join(store, "out")) if "/_staging/" not in e.uri] == []
