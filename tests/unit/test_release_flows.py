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
