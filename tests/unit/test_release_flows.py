"""The two smaller deployments' pure parts: which shard set a release reads, which canary a version gets."""

from __future__ import annotations

import pytest

from flows.canary_version import challenge
from flows.release import shard_set_prefix


def test_shard_set_prefix_accepts_prefix_or_manifest():
    assert shard_set_prefix("s3://b/shards/abc/manifest.json") == "s3://b/shards/abc"
    assert shard_set_prefix("/data/shards/abc/") == "/data/shards/abc"
    with pytest.raises(ValueError, match="shard_set is empty"):
        shard_set_prefix(" ")


def test_challenge_compares_against_todays_champion():
    promoted = challenge("m", "5", {"champion": "3", "challenger": "4"})
    assert (promoted.version, promoted.champion_version, promoted.challenger_version) == ("5", "3", "5")
    with pytest.raises(ValueError, match="no champion"):
        challenge("m", "5", {})
    with pytest.raises(ValueError, match="is the champion already"):
        challenge("m", "3", {"champion": "3"})


def test_a_release_opens_a_text_set_and_refuses_a_set_of_token_ids(tmp_path, lineage, lineage_for, monkeypatch):
    from support.data_helpers import config, make_corpus

    from flows.config import ConfigError
    from flows.release import open_shard_set
    from training import tokenizer as tk
    from training.data import build_shards

    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    corpus = make_corpus(tmp_path / "c")
    text = build_shards(config(corpus, tmp_path / "out"))
    assert open_shard_set.fn(text.manifest_uri, lineage).dataset_digest == text.dataset_digest
    tokens = build_shards(
        config(corpus, tmp_path / "out"), tk.train_bpe([corpus.joinpath("a", "doc001.txt").read_bytes()], 300)
    )
    with pytest.raises(ConfigError, match=r"^shard_set .*: its records carry token ids \(tokenizer [0-9a-f]{12}\)"):
        open_shard_set.fn(tokens.uri, lineage_for("flow-run-2"))
