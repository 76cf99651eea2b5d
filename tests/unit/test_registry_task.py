"""promote_model as a task (task.fn) on a real MLflow store: lineage tags, the canary's skip reasons, retry policy."""

from __future__ import annotations

from deployments.config import CanaryConfig, RegistryConfig
from deployments.registry import AliasChanged, client_for, read_aliases
from deployments.rollout import skip_reason
from infra.names import (
    TAG_CHECKPOINT_URI,
    TAG_DATA_RUN_ID,
    TAG_DATASET_DIGEST,
    TAG_FLOW_RUN_ID,
    TAG_MANIFEST_URI,
    TAG_MODEL_VERSION,
    TAG_PARENT,
    TAG_STAGE,
    TAG_TRAIN_RUN_ID,
    TAG_VALIDATION_RUN_ID,
)
from infra.tracking import Lineage


def _products(lineage: Lineage, n: int):
    """What stages 1-4 hand to promote_model, with a real training run and a real logged model."""
    import mlflow

    from training.data import ShardSet
    from training.evaluate import ValidationResult
    from training.trainer import TrainResult

    client = client_for(lineage.tracking_uri)
    exp = client.get_run(lineage.parent_run_id).info.experiment_id
    train = client.create_run(exp, run_name=f"train_fsdp-{n}").info.run_id
    val = client.create_run(exp, run_name=f"validate_checkpoint-{n}").info.run_id
    model = mlflow.initialize_logged_model(name="model", source_run_id=val, experiment_id=exp)
    shards = ShardSet(
        dataset_digest="0123456789abcdef" * 2,
        uri="/s",
        manifest_uri="/s/manifest.json",
        train_shards=[],
        val_shards=[],
        num_train=1,
        num_val=1,
        total_bytes=10,
        cache_hit=False,
        skipped={},
        data_run_id="data-run",
    )
    trained = TrainResult(
        train_run_id=train, checkpoint_uri=f"/ck/{n}", step=10, final_loss=1.0, tokens_per_s=1.0, world_size=2
    )
    validated = ValidationResult(
        validation_run_id=val,
        checkpoint_uri=f"/ck/{n}",
        val_bits_per_byte=3.5,
        model_uri=f"models:/{model.model_id}",
        seq_len=32,
    )
    return validated, trained, shards


def _stage_run(lineage: Lineage, stage: str):
    client = client_for(lineage.tracking_uri)
    exp = client.get_run(lineage.parent_run_id).info.experiment_id
    runs = client.search_runs(
        [exp], f"tags.`{TAG_PARENT}` = '{lineage.parent_run_id}' and tags.`{TAG_STAGE}` = '{stage}'"
    )
    assert len(runs) == 1
    return runs[0]


def test_promote_task_registers_with_lineage_and_a_first_version_needs_no_canary(lineage, lineage_for):
    from prefect.logging import disable_run_logger

    from tasks.promote import promote_model

    cfg = RegistryConfig(model_name="m")
    validated, trained, shards = _products(lineage, 1)
    with disable_run_logger():
        promoted = promote_model.fn(cfg, validated, trained, shards, lineage)
    assert (promoted.decision, promoted.version, promoted.champion_version) == ("first-champion", "1", None)

    client = client_for(lineage.tracking_uri)
    mv = client.get_model_version("m", "1")
    assert mv.run_id == trained.train_run_id
    assert mv.tags[TAG_DATASET_DIGEST] == shards.dataset_digest
    assert mv.tags[TAG_FLOW_RUN_ID] == "flow-run-1"
    assert mv.tags[TAG_TRAIN_RUN_ID] == trained.train_run_id
    assert mv.tags[TAG_CHECKPOINT_URI] == "/ck/1"
    assert mv.tags[TAG_VALIDATION_RUN_ID] == validated.validation_run_id
    assert mv.tags[TAG_DATA_RUN_ID] == "data-run"
    assert mv.tags[TAG_MANIFEST_URI] == "/s/manifest.json"
    assert read_aliases(client, "m") == {"champion": "1", "challenger": "1"}
    run = _stage_run(lineage, "promote_model")
    assert run.info.status == "FINISHED"
    assert run.data.tags[TAG_MODEL_VERSION] == "1" and run.data.tags["shardline.promotion"] == "first-champion"

    # canary_deploy itself reconciles the live endpoint even when it skips (Ray Serve: tests/integration);
    # here, the registry side of its skip decision
    assert "first run" in skip_reason(client, CanaryConfig(), "m", promoted.champion_version, promoted.version)

    # the next flow run's model challenges; a disabled canary would skip and leave the champion alone
    lineage2 = lineage_for("flow-run-2")
    validated2, trained2, _ = _products(lineage2, 2)
    with disable_run_logger():
        second = promote_model.fn(cfg, validated2, trained2, shards, lineage2)
    assert (second.decision, second.version, second.champion_version) == ("challenger", "2", "1")
    assert skip_reason(client, CanaryConfig(enabled=False), "m", "1", "2") == "canary.enabled is false"
    assert skip_reason(client, CanaryConfig(), "m", "1", "2") == ""
    assert read_aliases(client, "m") == {"champion": "1", "challenger": "2"}
    assert client.get_model_version("m", "2").tags[TAG_FLOW_RUN_ID] == "flow-run-2"
    assert _stage_run(lineage2, "promote_model").data.tags[TAG_MODEL_VERSION] == "2"

    # serve.enabled = false: the run ends at the registry. No Ray is running here: the stage touches no endpoint.
    from deployments.config import ServeConfig
    from infra.cluster import ClusterInfo
    from tasks.canary import canary_deploy

    cluster = ClusterInfo(address="", mode="local", resources={}, nodes=0, started_here=False)
    with disable_run_logger():
        result = canary_deploy.fn(
            CanaryConfig(enabled=False), ServeConfig(enabled=False), second, shards, cluster, cfg, lineage2
        )
    assert (result.decision, result.champion_version, result.endpoint_url) == ("skipped", "1", "")
    assert result.reason == "canary.enabled is false; serve.enabled is false: no endpoint"
    assert read_aliases(client, "m") == {"champion": "1", "challenger": "2"}
    assert _stage_run(lineage2, "canary_deploy").info.status == "FINISHED"


def test_decisions_and_user_errors_are_not_retried():
    from prefect.states import Failed

    from deployments.rollout import CanaryDecided
    from tasks.retry import retry_unless

    should_retry = retry_unless(CanaryDecided, AliasChanged)
    assert should_retry(None, None, Failed(data=CanaryDecided("decided"))) is False
    assert should_retry(None, None, Failed(data=AliasChanged("moved"))) is False
    assert should_retry(None, None, Failed(data=ConnectionError("flaky"))) is True


def test_a_version_carries_its_tokenizer_and_only_a_run_on_the_same_ids_continues_its_weights(lineage):
    """The version's tokenizer fingerprint is a lineage tag, and train.init_from reads it: weights trained on one
    tokenizer's ids (or on bytes) are never continued on another's, 'champion' included."""
    import pytest
    from prefect.logging import disable_run_logger

    from infra.names import TAG_TOKENIZER_SHA256
    from tasks.promote import promote_model
    from training.checkpoint import CheckpointError
    from training.resume import resolve_init_from

    bpe = "ab" * 32
    validated, trained, shards = _products(lineage, 1)
    with disable_run_logger():
        promote_model.fn(
            RegistryConfig(model_name="m"),
            validated,
            trained,
            shards.model_copy(update={"tokenizer_sha256": bpe}),
            lineage,
        )
    assert client_for(lineage.tracking_uri).get_model_version("m", "1").tags[TAG_TOKENIZER_SHA256] == bpe

    init = resolve_init_from("champion", "m", lineage.tracking_uri, bpe)
    assert init is not None and (init.checkpoint_uri, init.model_version) == ("/ck/1", "m/1")
    with pytest.raises(CheckpointError) as e:
        resolve_init_from("champion", "m", lineage.tracking_uri, "")
    assert str(e.value) == (
        "train.init_from='champion': m version 1 was trained on the ids of tokenizer abababababab, this run's shard "
        "set on bytes; its weights embed other ids, so set train.init_from = '' to start from scratch (or shard "
        "with the version's tokenizer)"
    )
    with pytest.raises(CheckpointError, match=r"^train.init_from='models:/m/1': m version 1 was trained on the ids "):
        resolve_init_from("models:/m/1", "m", lineage.tracking_uri, "cd" * 32)
    assert resolve_init_from("", "m", lineage.tracking_uri, "") is None  # from scratch asks nothing of the registry


def test_a_rerun_that_reuses_a_rejected_version_does_not_make_it_challenger_again(lineage, lineage_for):
    """Run A's canary rejected v2; run B (same corpus and config: training reused, the same checkpoint) gets v2
    back from register_version. It is not aliased again, its lineage still names run A, and the canary's
    already-rejected skip removes a `challenger` alias left on it."""
    from prefect.logging import disable_run_logger

    from deployments.config import ServeConfig
    from deployments.registry import clear_challenger, tag_rejected
    from flows.pipeline import run_outcome
    from infra.cluster import ClusterInfo
    from tasks.canary import canary_deploy
    from tasks.promote import promote_model

    cfg = RegistryConfig(model_name="m")
    client = client_for(lineage.tracking_uri)
    run_a = lineage_for("flow-run-2")
    v2 = _products(run_a, 2)
    with disable_run_logger():
        promote_model.fn(cfg, *_products(lineage, 1), lineage)  # v1: the first champion
        assert promote_model.fn(cfg, *v2, run_a).decision == "challenger"
    tag_rejected(client, "m", "2", "step 10%: bits/byte 7.9 vs 2.1")  # what run A's canary applied
    clear_challenger(client, "m", "2")
    judged = client.get_model_version("m", "2").tags
    assert judged[TAG_FLOW_RUN_ID] == "flow-run-2"

    run_b = lineage_for("flow-run-3")
    with disable_run_logger():
        again = promote_model.fn(cfg, *v2, run_b)
    assert (again.decision, again.version, again.champion_version) == ("rejected", "2", "1")
    assert again.reason == (
        "version 2 was already rejected by a canary (step 10%: bits/byte 7.9 vs 2.1); not made 'challenger'"
    )
    assert read_aliases(client, "m") == {"champion": "1"}
    assert client.get_model_version("m", "2").tags == judged  # not re-tagged with run B's lineage
    run = _stage_run(run_b, "promote_model")
    assert run.data.tags["shardline.promotion"] == "rejected" and run.data.tags[TAG_MODEL_VERSION] == "2"

    # a `challenger` alias left on it (as a rerun before this fix did) goes when the canary skips it
    client.set_registered_model_alias("m", "challenger", "2")
    cluster = ClusterInfo(address="", mode="local", resources={}, nodes=0, started_here=False)
    with disable_run_logger():
        canary = canary_deploy.fn(CanaryConfig(), ServeConfig(enabled=False), again, v2[2], cluster, cfg, run_b)
    assert (canary.decision, canary.champion_version) == ("skipped", "1")
    assert canary.reason.startswith("version 2 was already rejected: step 10%: bits/byte 7.9 vs 2.1")
    assert read_aliases(client, "m") == {"champion": "1"}
    assert run_outcome(again, canary) == ("rejected", again.reason, "1")


def test_a_rerun_that_reuses_a_version_by_its_checkpoint_leaves_its_lineage_naming_its_source(lineage, lineage_for):
    """Run B reuses run A's training (the same train run and checkpoint) and validation logs another model: B gets
    A's version back, whose source is A's model. Its lineage tags keep naming A's model, validation and flow run
    (the champion's tags describe what it was registered from); B is recorded apart, under revalidated_by. A
    retried promote of A (the same source) still re-applies its tags and registers no second version."""
    import json

    from prefect.logging import disable_run_logger

    from infra.names import TAG_MODEL_URI, TAG_REVALIDATED_BY
    from tasks.promote import promote_model

    cfg = RegistryConfig(model_name="m")
    client = client_for(lineage.tracking_uri)
    validated_a, trained_a, shards = _products(lineage, 1)
    with disable_run_logger():
        first = promote_model.fn(cfg, validated_a, trained_a, shards, lineage)
    registered = client.get_model_version("m", first.version).tags

    run_b = lineage_for("flow-run-2")
    validated_b, _, _ = _products(run_b, 1)  # the same checkpoint /ck/1, a new validation run and logged model
    with disable_run_logger():
        rerun = promote_model.fn(cfg, validated_b, trained_a, shards, run_b)
    assert rerun.version == first.version == "1"
    mv = client.get_model_version("m", "1")
    assert mv.source == validated_a.model_uri
    assert {k: v for k, v in mv.tags.items() if k != TAG_REVALIDATED_BY} == registered
    assert mv.tags[TAG_MODEL_URI] == validated_a.model_uri
    assert mv.tags[TAG_VALIDATION_RUN_ID] == validated_a.validation_run_id
    assert mv.tags[TAG_FLOW_RUN_ID] == "flow-run-1"
    assert json.loads(mv.tags[TAG_REVALIDATED_BY]) == {
        "prefect_flow_run_id": "flow-run-2",
        "validation_run_id": validated_b.validation_run_id,
        "model_uri": validated_b.model_uri,
    }

    # a retried promote of run A: the same source, its tags (re)applied, still one version
    with disable_run_logger():
        assert promote_model.fn(cfg, validated_a, trained_a, shards, lineage).version == "1"
    assert client.get_model_version("m", "1").tags[TAG_FLOW_RUN_ID] == "flow-run-1"
    assert len(client.search_model_versions("name = 'm'")) == 1
    assert read_aliases(client, "m") == {"champion": "1", "challenger": "1"}


def test_a_rerun_on_the_champions_checkpoint_reports_the_decisions_reason(lineage, lineage_for):
    """A rerun that reuses the champion's checkpoint is 'first-champion' because the candidate is the champion
    already; the run's summary says that, not 'no champion existed'."""
    from prefect.logging import disable_run_logger

    from deployments.config import ServeConfig
    from flows.pipeline import run_outcome
    from infra.cluster import ClusterInfo
    from tasks.canary import canary_deploy
    from tasks.promote import promote_model

    cfg = RegistryConfig(model_name="m")
    cluster = ClusterInfo(address="", mode="local", resources={}, nodes=0, started_here=False)
    v1 = _products(lineage, 1)
    rerun_lineage = lineage_for("flow-run-2")
    with disable_run_logger():
        first = promote_model.fn(cfg, *v1, lineage)
        rerun = promote_model.fn(cfg, *v1, rerun_lineage)
        canary = canary_deploy.fn(
            CanaryConfig(enabled=False), ServeConfig(enabled=False), rerun, v1[2], cluster, cfg, rerun_lineage
        )
    assert first.reason == "m has no 'champion' alias; validated version 1 becomes champion"
    assert (rerun.decision, rerun.version, rerun.champion_version) == ("first-champion", "1", "1")
    assert rerun.reason == "version 1 is already 'champion' of m"
    assert run_outcome(rerun, canary) == ("first-champion", "version 1 is already 'champion' of m", "1")
    assert run_outcome(first, canary)[1] == "m has no 'champion' alias; validated version 1 becomes champion"


def test_a_first_champions_canary_run_names_no_champion_version(lineage):
    from prefect.logging import disable_run_logger

    from deployments.config import ServeConfig
    from infra.cluster import ClusterInfo
    from tasks.canary import canary_deploy
    from tasks.promote import promote_model

    cfg = RegistryConfig(model_name="m")
    cluster = ClusterInfo(address="", mode="local", resources={}, nodes=0, started_here=False)
    _, _, shards = products = _products(lineage, 1)
    with disable_run_logger():
        first = promote_model.fn(cfg, *products, lineage)
        canary_deploy.fn(CanaryConfig(enabled=False), ServeConfig(enabled=False), first, shards, cluster, cfg, lineage)
    assert first.champion_version is None
    tags = _stage_run(lineage, "canary_deploy").data.tags
    assert tags["shardline.champion_version"] == ""  # not 'None'
    assert tags[TAG_MODEL_VERSION] == "1"
