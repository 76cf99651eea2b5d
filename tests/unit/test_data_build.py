"""build_shards on local directories: determinism, manifest, cache hits, atomic
publishing, the quality gate."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

import pytest
from support.data_helpers import config, make_corpus, make_jsonl

from training.data import DataError, build_shards, load_shard_set
from training.data.quality import QualityError
from training.data.shards import assign_split


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))


def _files(root: Path) -> dict[str, bytes]:
    """Shards and manifest (validation.json is the GX report, which carries the time it ran)."""
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.name != "validation.json"}


def test_a_local_shard_set_loads_by_its_file_uri_and_a_relative_path(tmp_path, monkeypatch):
    """Verifying a set looks its shards up as join(set URI, name) in the listing of the set's folder."""
    built = build_shards(config(make_corpus(tmp_path / "corpus"), tmp_path / "out"))
    assert load_shard_set(f"file://{built.uri}", verify="sha256").num_train == built.num_train
    monkeypatch.chdir(tmp_path)
    assert load_shard_set("./" + str(Path(built.uri).relative_to(tmp_path))).num_train == built.num_train


def test_split_is_seeded_and_order_free():
    keys = [f"k{i}" for i in range(2000)]
    first = {k: assign_split(k, 7, 0.2) for k in keys}
    assert first == {k: assign_split(k, 7, 0.2) for k in reversed(keys)}
    assert first != {k: assign_split(k, 8, 0.2) for k in keys}
    assert 0.17 < sum(v == "val" for v in first.values()) / len(keys) < 0.23


def test_two_runs_give_byte_identical_shards_and_digest(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    a = build_shards(config(corpus, tmp_path / "out-a"))
    b = build_shards(config(corpus, tmp_path / "out-b"))
    assert a.dataset_digest == b.dataset_digest and len(a.dataset_digest) == 32
    assert _files(Path(a.uri)) == _files(Path(b.uri))
    assert not a.cache_hit and not b.cache_hit
    assert a.num_train + a.num_val == 60 and a.num_val > 0
    assert len(a.train_shards) == -(-a.num_train // 8)


def test_shards_hold_txt_and_json_with_safe_keys(tmp_path):
    shards = build_shards(config(make_corpus(tmp_path / "c"), tmp_path / "out"))
    with tarfile.open(shards.train_shards[0]) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert {n.split(".", 1)[1] for n in names} == {"txt", "json"}
    assert all("." not in n.split(".", 1)[0] for n in names)
    assert {m.mtime for m in members} == {0} and {m.uname for m in members} == {"shardline"}


def test_manifest_lists_every_shard_with_count_size_and_sha256(tmp_path):
    shards = build_shards(config(make_corpus(tmp_path / "c"), tmp_path / "out"))
    manifest = json.loads(Path(shards.manifest_uri).read_text())
    assert manifest["dataset_digest"] == shards.dataset_digest
    listed = manifest["splits"]["train"]["shards"] + manifest["splits"]["val"]["shards"]
    assert [Path(u).name for u in shards.train_shards + shards.val_shards] == [s["name"] for s in listed]
    for entry in listed:
        data = (Path(shards.uri) / entry["name"]).read_bytes()
        assert entry["bytes"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert sum(s["samples"] for s in listed) == shards.num_train + shards.num_val
    assert json.loads((Path(shards.uri) / "validation.json").read_text())["success"] is True


def test_rerun_is_a_cache_hit_that_rewrites_nothing(tmp_path):
    corpus = make_corpus(tmp_path / "c")
    first = build_shards(config(corpus, tmp_path / "out"))
    before = {p: p.stat().st_mtime_ns for p in Path(first.uri).iterdir()}
    second = build_shards(config(corpus, tmp_path / "out"))
    assert second.cache_hit and second.dataset_digest == first.dataset_digest
    assert {p: p.stat().st_mtime_ns for p in Path(first.uri).iterdir()} == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [first.dataset_digest, "_index", "_staging"]
    assert list((tmp_path / "out" / "_staging").iterdir()) == []


def test_changed_input_gives_a_new_digest_and_set(tmp_path):
    corpus = make_corpus(tmp_path / "c")
    first = build_shards(config(corpus, tmp_path / "out"))
    (corpus / "a" / "doc001.txt").write_text("changed\n")
    second = build_shards(config(corpus, tmp_path / "out"))
    assert second.dataset_digest != first.dataset_digest and not second.cache_hit
    assert Path(first.manifest_uri).exists() and Path(second.manifest_uri).exists()


def test_layout_change_gives_a_new_digest(tmp_path):
    corpus = make_corpus(tmp_path / "c")
    a = build_shards(config(corpus, tmp_path / "out"))
    b = build_shards(config(corpus, tmp_path / "out", max_samples_per_shard=5))
    assert a.dataset_digest != b.dataset_digest and len(b.train_shards) > len(a.train_shards)


def test_settings_that_give_the_same_shards_reuse_the_published_set_and_never_rewrite_it(tmp_path):
    """20 records never reach 64 or 128 a shard: both settings give one set, which the first build published."""
    corpus, out = make_corpus(tmp_path / "c", n=20), tmp_path / "out"
    first = build_shards(config(corpus, out, max_samples_per_shard=64))
    manifest = Path(first.manifest_uri).read_bytes()
    before = {p.name: p.stat().st_mtime_ns for p in Path(first.uri).iterdir()}
    for mps in (128, 64, 128):
        again = build_shards(config(corpus, out, max_samples_per_shard=mps))
        assert (again.dataset_digest, again.cache_hit) == (first.dataset_digest, True)
        assert Path(again.manifest_uri).read_bytes() == manifest  # layout.max_samples_per_shard stays 64
        assert {p.name: p.stat().st_mtime_ns for p in Path(first.uri).iterdir()} == before
    assert json.loads(manifest)["layout"]["max_samples_per_shard"] == 64


def test_tampered_shard_is_not_reused_and_is_republished(tmp_path):
    corpus = make_corpus(tmp_path / "c")
    first = build_shards(config(corpus, tmp_path / "out"))
    shard = Path(first.train_shards[0])
    shard.chmod(0o644)
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    with pytest.raises(DataError, match="sha256 does not match"):
        load_shard_set(first.uri, verify="sha256")
    again = build_shards(config(corpus, tmp_path / "out"))
    assert not again.cache_hit and again.dataset_digest == first.dataset_digest
    assert load_shard_set(first.uri, verify="sha256").num_train == first.num_train


def test_set_without_manifest_is_not_a_dataset(tmp_path):
    corpus = make_corpus(tmp_path / "c")
    first = build_shards(config(corpus, tmp_path / "out"))
    Path(first.manifest_uri).unlink()  # what a crash before the last write leaves
    with pytest.raises(DataError, match="no manifest.json"):
        load_shard_set(first.uri)
    again = build_shards(config(corpus, tmp_path / "out"))
    assert not again.cache_hit and Path(again.manifest_uri).exists()


def test_shard_byte_limit_is_respected(tmp_path):
    shards = build_shards(
        config(make_corpus(tmp_path / "c"), tmp_path / "out", max_shard_bytes=10240, max_samples_per_shard=1000)
    )
    sizes = [Path(u).stat().st_size for u in shards.train_shards]
    assert len(sizes) > 3 and max(sizes) <= 10240
    assert len(sizes) < shards.num_train  # the smallest bound still holds several small records a shard


@pytest.mark.parametrize("limit", [1024, 10239])
def test_a_shard_byte_limit_no_tar_can_meet_is_refused(limit):
    """A tar file is whole 10240-byte records: below that every shard would break the bound."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_shard_bytes\n  Input should be greater than or equal to 10240"):
        config("c", "out", max_shard_bytes=limit)


def test_jsonl_source_with_text_and_key_fields(tmp_path):
    src = make_jsonl(tmp_path / "data.jsonl")
    shards = build_shards(config(src, tmp_path / "out", format="jsonl", text_field="body", key_field="id"))
    assert shards.num_train + shards.num_val == 40


def _dup_reader(source, cfg):
    for i in range(30):
        yield (f"k{i % 25}", f"text number {i}\n".encode())


def test_failing_quality_gate_lists_each_expectation_and_publishes_nothing(tmp_path):
    cfg = config("unused", tmp_path / "out", reader=f"{__name__}:_dup_reader", val_fraction=0.33, split_tolerance=0.0)
    with pytest.raises(QualityError) as err:
        build_shards(cfg)
    lines = str(err.value).splitlines()
    assert "2 of 6 expectations" in lines[0]
    unique = next(line for line in lines if "expect_column_values_to_be_unique" in line)
    assert "10 of 30 records" in unique and "'k0'" in unique
    assert any("expect_column_mean_to_be_between" in line and "observed" in line for line in lines)
    assert err.value.report["success"] is False
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["_staging"]


def test_a_stricter_gate_applies_to_a_set_already_published(tmp_path):
    """The same records under a tighter data.split_tolerance: the set on disk was judged under the old one, so the
    gate runs again and refuses, rather than the build returning the published set as a cache hit."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(f'{{"text": "record {i} text text"}}\n' for i in range(203)))
    lenient = config(corpus, tmp_path / "out", format="jsonl", val_fraction=0.37, split_tolerance=0.5)
    first = build_shards(lenient)
    assert not first.cache_hit and 0.2 < first.num_val / (first.num_train + first.num_val) < 0.5
    with pytest.raises(QualityError, match=r"expect_column_mean_to_be_between\(is_val\)"):
        build_shards(lenient.model_copy(update={"split_tolerance": 0.0}))
    assert build_shards(lenient).cache_hit  # the settings it passed under still reuse it


def test_shard_writer_bytes_equal_webdataset_tarwriter(tmp_path):
    import io

    import webdataset as wds

    from training.data.tarwriter import FIXED_MTIME, UstarWriter

    samples = [{"__key__": f"{i:07d}_k{i}", "txt": b"t" * (i * 97), "json": b'{"k":%d}' % i} for i in range(40)]
    ours, theirs = io.BytesIO(), io.BytesIO()
    theirs.close = lambda: None  # keep the buffer readable after TarWriter closes it
    writer = UstarWriter(ours)
    ours.close = lambda: None
    for sample in samples:
        writer.write(sample)
    writer.close()
    reference = wds.TarWriter(theirs, encoder=False, mtime=FIXED_MTIME, user="shardline", group="shardline", mode=0o444)
    for sample in samples:
        reference.write(sample)
    reference.close()
    assert ours.getvalue() == theirs.getvalue()


def test_relative_output_is_published_as_an_absolute_path(tmp_path, monkeypatch):
    corpus = make_corpus(tmp_path / "c")
    monkeypatch.chdir(tmp_path)
    shards = build_shards(config(corpus, "rel-out"))
    assert Path(shards.uri).is_absolute() and Path(shards.uri).parent == tmp_path / "rel-out"
    assert all(Path(u).is_absolute() for u in shards.train_shards)


def test_shard_read_back_counts_what_tarfile_counts_and_rejects_a_corrupt_header(tmp_path):
    from training.data.shards import count_samples
    from training.data.tarwriter import regular_member_names

    shards = build_shards(config(make_corpus(tmp_path / "c"), tmp_path / "out"))
    for uri in shards.train_shards + shards.val_shards:
        with tarfile.open(uri) as tar:
            assert regular_member_names(uri) == [m.name for m in tar if m.isfile()]
    assert count_samples(Path(shards.train_shards[0])) == 8
    bad = tmp_path / "bad.tar"
    data = bytearray(Path(shards.train_shards[0]).read_bytes())
    data[1024 + 10] ^= 0x01  # the second member's header (after the first .json: 512 header + 512 data)
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="bad tar header checksum at byte 1024"):
        count_samples(bad)


def test_a_file_uri_source_reads_the_same_corpus_as_its_path(tmp_path):
    """file:// is taken as a local path on the source side as on the output side (it was a relative 'file:' dir)."""
    corpus = make_corpus(tmp_path / "c", n=20)
    plain = build_shards(config(corpus, tmp_path / "out"))
    uri = build_shards(config(f"file://{corpus}", f"file://{tmp_path}/out", reuse_unchanged=False))
    assert uri.dataset_digest == plain.dataset_digest and uri.num_train + uri.num_val == 20
    one = build_shards(
        config(f"file://{make_jsonl(tmp_path / 'one.jsonl')}", tmp_path / "j", format="jsonl", text_field="body")
    )
    assert one.num_train + one.num_val == 40
