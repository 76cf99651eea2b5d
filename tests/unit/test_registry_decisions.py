"""Promotion decisions as pure functions, and the lineage tags a version carries."""

from __future__ import annotations

from deployments.registry import decide_promotion, model_id_of, version_tags
from infra.names import TAG_CHECKPOINT_URI, TAG_DATASET_DIGEST, TAG_TRAIN_RUN_ID


def test_no_champion_makes_the_first_champion():
    d = decide_promotion("m", "1", {})
    assert (d.verdict, d.candidate, d.baseline) == ("first-champion", "1", None)
    r = d.result()
    assert r.decision == "first-champion" and r.champion_version is None and r.challenger_version == "1"


def test_an_existing_champion_is_challenged():
    d = decide_promotion("m", "3", {"champion": "2", "challenger": "2"})
    assert (d.verdict, d.baseline) == ("challenger", "2")
    assert d.result().champion_version == "2"
    assert "challenges champion version 2" in d.reason


def test_a_retry_after_the_decision_was_applied_keeps_it():
    d = decide_promotion("m", "1", {"champion": "1"})
    assert d.verdict == "first-champion" and d.baseline == "1"


def test_model_id_is_parsed_only_from_logged_model_uris():
    assert model_id_of("models:/m-0123abcd") == "m-0123abcd"
    assert model_id_of("models:/name/3") is None
    assert model_id_of("models:/name@champion") is None
    assert model_id_of("runs:/abc/model") is None


def test_version_tags_drop_empty_values():
    tags = version_tags(
        dataset_digest="d" * 32,
        flow_run_id="",
        train_run_id="t1",
        checkpoint_uri="/ck/5",
        validation_run_id="v1",
        model_uri="models:/m-1",
    )
    assert tags[TAG_DATASET_DIGEST] == "d" * 32 and tags[TAG_TRAIN_RUN_ID] == "t1"
    assert tags[TAG_CHECKPOINT_URI] == "/ck/5"
    assert "shardline.prefect_flow_run_id" not in tags
    assert all(isinstance(v, str) and v for v in tags.values())
