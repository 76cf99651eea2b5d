"""data.format = jsonl / parquet / hf_dataset: the records they give and a shard set that does not depend on the
number of workers (real pyarrow files and real `datasets.save_to_disk` directories)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError
from support.data_helpers import config

from training.data import build_shards
from training.data.config import DataConfig

FILES, ROWS = 4, 40  # every file is over 1 KiB, so with chunk_bytes=1024 each file is its own chunk
ONE_CHUNK_PER_FILE = {"chunk_bytes": 1024}


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    datasets.disable_progress_bars()


def _rows(n: int = FILES * ROWS) -> list[dict]:
    return [{"id": f"r{i:04d}", "text": f"row {i}: " + "the quick brown fox " * (2 + i % 5)} for i in range(n)]


def write_jsonl(root: Path, rows: list[dict]) -> Path:
    root.mkdir(parents=True)
    for f in range(FILES):
        part = rows[f * ROWS : (f + 1) * ROWS]
        (root / f"part{f}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
    return root


def write_parquet(root: Path, rows: list[dict]) -> Path:
    root.mkdir(parents=True)
    for f in range(FILES):
        part = rows[f * ROWS : (f + 1) * ROWS]
        table = pa.table({"id": [r["id"] for r in part], "text": [r["text"] for r in part]})
        pq.write_table(table, root / f"part{f}.parquet", row_group_size=7)  # several row groups per file
    return root


def write_saved(root: Path, rows: list[dict]) -> Path:
    ds = datasets.Dataset.from_dict({"id": [r["id"] for r in rows], "text": [r["text"] for r in rows]})
    ds.save_to_disk(str(root), num_shards=FILES)  # contiguous: file f holds rows f*ROWS .. (f+1)*ROWS-1
    return root


WRITERS = {"jsonl": write_jsonl, "parquet": write_parquet, "hf_dataset": write_saved}


def _files(root: Path) -> dict[str, bytes]:
    """Shards and manifest (validation.json is the GX report, which carries the time it ran)."""
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.name != "validation.json"}


def _samples(shards) -> dict[str, str]:
    """key -> text of every record of a shard set."""
    out = {}
    for uri in shards.train_shards + shards.val_shards:
        with tarfile.open(uri) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for name, body in members.items():
            if name.endswith(".json"):
                out[json.loads(body)["key"]] = members[name[: -len("json")] + "txt"].decode()
    return out


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_one_two_and_three_workers_write_the_same_set(tmp_path, fmt):
    rows = _rows()
    source = WRITERS[fmt](tmp_path / "src", rows)
    sets = {
        w: build_shards(config(source, tmp_path / f"out-{w}", format=fmt, workers=w, **ONE_CHUNK_PER_FILE))
        for w in (1, 2, 3)
    }
    one = sets[1]
    assert one.chunks == FILES and one.num_train + one.num_val == len(rows) and one.skipped == {}
    for workers, shards in sets.items():
        assert shards.workers == workers and shards.dataset_digest == one.dataset_digest
        assert _files(Path(shards.uri)) == _files(Path(one.uri))
    # Every row is a record keyed by file and position (JSON Lines lines count from 1, rows from 0).
    samples = _samples(one)
    first = {"jsonl": "part0.jsonl:1", "parquet": "part0.parquet:0", "hf_dataset": "data-00000-of-00004.arrow:0"}[fmt]
    assert samples[first] == rows[0]["text"]
    assert sorted(samples.values()) == sorted(r["text"] for r in rows)


def test_the_same_rows_in_any_format_give_one_set(tmp_path):
    """Keyed by data.key_field and cut into the same files, JSON Lines, Parquet and a saved dataset are one corpus."""
    rows = _rows()
    digests = {}
    for fmt, write in WRITERS.items():
        source = write(tmp_path / fmt, rows)
        shards = build_shards(
            config(source, tmp_path / f"out-{fmt}", format=fmt, key_field="id", workers=1, **ONE_CHUNK_PER_FILE)
        )
        digests[fmt] = shards.dataset_digest
        assert _samples(shards) == {r["id"]: r["text"] for r in rows}
    assert len(set(digests.values())) == 1, digests


def test_a_saved_dataset_dict_gives_every_split_in_order(tmp_path):
    rows = _rows(60)
    train = datasets.Dataset.from_dict({"text": [r["text"] for r in rows[:45]]})
    test = datasets.Dataset.from_dict({"text": [r["text"] for r in rows[45:]]})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dd"))
    shards = build_shards(config(tmp_path / "dd", tmp_path / "out", format="hf_dataset"))
    samples = _samples(shards)
    assert len(samples) == 60
    assert samples["train/data-00000-of-00001.arrow:0"] == rows[0]["text"]
    assert samples["test/data-00000-of-00001.arrow:14"] == rows[59]["text"]


def test_a_saved_dataset_of_links_into_a_store_gives_the_set_its_files_would(tmp_path):
    """DVC and git-annex leave every data file a link into a content store: the records are keyed by where the
    file sits in the dataset, so the set is the one the plain directory gives."""
    rows = _rows(40)
    plain = write_saved(tmp_path / "plain", rows)
    linked, store = write_saved(tmp_path / "linked", rows), tmp_path / "store"
    store.mkdir()
    for arrow in sorted(linked.glob("*.arrow")):
        arrow.rename(store / arrow.name)
        arrow.symlink_to(store / arrow.name)
    one, two = (build_shards(config(d, tmp_path / f"out-{d.name}", format="hf_dataset")) for d in (plain, linked))
    assert one.dataset_digest == two.dataset_digest and _samples(one) == _samples(two)


def test_parquet_binary_column_and_integer_keys(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    texts = [f"bytes row {i} ".encode() * 4 for i in range(80)]
    pq.write_table(
        pa.table({"n": pa.array(range(100, 180), pa.int32()), "body": pa.array(texts, pa.large_binary())}),
        src / "b.parquet",
    )
    shards = build_shards(config(src, tmp_path / "out", format="parquet", text_field="body", key_field="n"))
    assert _samples(shards) == {str(100 + i): t.decode() for i, t in enumerate(texts)}


def test_what_editors_and_pandas_write_reads_as_the_plain_form(tmp_path):
    """A JSON Lines file that starts with a UTF-8 byte order mark (Windows editors write one) and a Parquet text
    column stored dictionary-encoded (pandas' Categorical) give the same set as the plain files."""
    rows = _rows(40)
    plain = build_shards(config(write_jsonl(tmp_path / "plain", rows), tmp_path / "o1", format="jsonl", key_field="id"))
    bom = write_jsonl(tmp_path / "bom", rows)
    (bom / "part0.jsonl").write_bytes(b"\xef\xbb\xbf" + (bom / "part0.jsonl").read_bytes())
    (bom / "part1.jsonl").write_bytes(b"\xef\xbb\xbf\n" + (bom / "part1.jsonl").read_bytes())  # then a blank line
    with_bom = build_shards(config(bom, tmp_path / "o2", format="jsonl", key_field="id"))
    assert with_bom.skipped == {} and with_bom.dataset_digest == plain.dataset_digest
    src = tmp_path / "dict"
    src.mkdir()
    texts = pa.array([r["text"] for r in rows]).dictionary_encode()
    pq.write_table(pa.table({"id": [r["id"] for r in rows], "text": texts}), src / "c.parquet")
    assert pa.types.is_dictionary(pq.read_schema(src / "c.parquet").field("text").type)
    encoded = build_shards(config(src, tmp_path / "o3", format="parquet", key_field="id"))
    assert _samples(encoded) == {r["id"]: r["text"] for r in rows}
    # pyarrow >= 16 and Polars write the view layouts: string_view text and key, binary_view text
    for layout, kind in (("sv", pa.string_view()), ("bv", pa.binary_view())):
        view = tmp_path / layout
        view.mkdir()
        body = pa.array([r["text"] if kind == pa.string_view() else r["text"].encode() for r in rows], kind)
        pq.write_table(
            pa.table({"id": pa.array([r["id"] for r in rows], pa.string_view()), "text": body}), view / "c.parquet"
        )
        assert pq.read_schema(view / "c.parquet").field("text").type == kind
        viewed = build_shards(config(view, tmp_path / f"o-{layout}", format="parquet", key_field="id"))
        assert viewed.dataset_digest == encoded.dataset_digest and viewed.skipped == {}


def test_include_defaults_to_the_format_extension(tmp_path):
    source = write_parquet(tmp_path / "src", _rows())
    (source / "notes.txt").write_text("not parquet")
    shards = build_shards(config(source, tmp_path / "out", format="parquet"))
    assert shards.num_train + shards.num_val == FILES * ROWS and shards.skipped == {}


def test_a_columnar_format_with_the_stdlib_source_is_refused_at_config_load():
    with pytest.raises(ValidationError, match="data.format='parquet' needs a data.source of that format"):
        DataConfig(format="parquet")
    with pytest.raises(ValidationError, match="text_field"):
        DataConfig(source="x", format="parquet", text_field="")
