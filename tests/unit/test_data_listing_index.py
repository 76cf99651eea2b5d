"""The listing index: an unchanged corpus is a cache hit without being read; any change to what was listed, or
to a setting that shapes shards, or damage to the published set, falls back to reading and building."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.data_helpers import config, make_corpus

from training.data import build, build_shards


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))


@pytest.fixture
def built(tmp_path):
    corpus = make_corpus(tmp_path / "c")
    return corpus, build_shards(config(corpus, tmp_path / "out"))


def _no_reading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the corpus was read")

    monkeypatch.setattr(build, "run_chunks", refuse)


def test_unchanged_listing_is_a_cache_hit_that_reads_nothing(tmp_path, built, monkeypatch):
    corpus, first = built
    index = list((tmp_path / "out" / "_index").iterdir())
    assert len(index) == 1 and json.loads(index[0].read_text())["dataset_digest"] == first.dataset_digest
    _no_reading(monkeypatch)
    again = build_shards(config(corpus, tmp_path / "out", workers=3))  # how it is written shapes nothing
    assert again.cache_hit and again.chunks == 0
    assert again.model_dump(exclude={"cache_hit", "chunks", "workers"}) == first.model_dump(
        exclude={"cache_hit", "chunks", "workers"}
    )


def test_same_size_rewrite_with_the_old_mtime_is_seen(tmp_path, built):
    corpus, first = built
    doc = corpus / "a" / "doc001.txt"
    st = doc.stat()
    doc.write_bytes(bytes(reversed(doc.read_bytes())))
    os.utime(doc, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime set back; the inode change time cannot be
    again = build_shards(config(corpus, tmp_path / "out"))
    assert again.chunks > 0 and again.dataset_digest != first.dataset_digest and not again.cache_hit


def test_touched_file_is_read_again_and_gives_the_same_set(tmp_path, built):
    corpus, first = built
    os.utime(corpus / "a" / "doc001.txt")
    again = build_shards(config(corpus, tmp_path / "out"))
    assert again.chunks > 0 and again.cache_hit and again.dataset_digest == first.dataset_digest


def test_shaping_setting_or_reuse_off_reads_the_corpus(tmp_path, built):
    corpus, first = built
    assert build_shards(config(corpus, tmp_path / "out", seed=first.num_train + 1)).chunks > 0
    off = build_shards(config(corpus, tmp_path / "out", reuse_unchanged=False))
    assert off.chunks > 0 and off.cache_hit and off.dataset_digest == first.dataset_digest


def test_damaged_set_named_by_the_index_is_rebuilt(tmp_path, built):
    corpus, first = built
    Path(first.val_shards[0]).unlink()
    again = build_shards(config(corpus, tmp_path / "out"))
    assert again.chunks > 0 and not again.cache_hit and again.dataset_digest == first.dataset_digest
    assert Path(first.val_shards[0]).exists()


def test_an_indexed_set_of_other_settings_is_taken_unread_but_not_one_of_another_tokenizer(tmp_path, built):
    """A set that other settings published with the same shards is this build's content: requiring its whole layout
    equal re-read the corpus on every later run of those settings, for good. One whose manifest names another
    tokenizer (published before the tokenizer was part of the digest) is not what this config builds: the corpus is
    read and the content digest decides."""
    corpus, first = built
    manifest = json.loads(Path(first.manifest_uri).read_text())
    manifest["layout"]["max_samples_per_shard"] = 1000  # no effect on a text set's digest
    Path(first.manifest_uri).write_text(json.dumps(manifest))
    again = build_shards(config(corpus, tmp_path / "out"))
    assert again.cache_hit and again.chunks == 0 and again.dataset_digest == first.dataset_digest
    manifest["layout"]["tokenizer_sha256"] = "f" * 64
    Path(first.manifest_uri).write_text(json.dumps(manifest))
    again = build_shards(config(corpus, tmp_path / "out"))
    assert again.chunks > 0 and again.dataset_digest == first.dataset_digest
