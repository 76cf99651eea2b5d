"""Across runs: which weights a training starts from (train.init_from), and which training a run resumes or reuses.

A training is identified by what determines its result: the dataset digest, the training config (less the
operational fields below) and the checkpoint it starts from. Its Ray Train run is named after that key, so a
rerun of an interrupted training continues in the same storage from its newest complete checkpoint; a finished
one (its MLflow train run FINISHED with a checkpoint that still verifies) is reused without starting Ray Train.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from infra.names import (  # noqa: F401 - TAG_* re-exported for the stages that log them
    CHAMPION,
    TAG_CHECKPOINT_URI,
    TAG_INIT_CHECKPOINT,
    TAG_INIT_VERSION,
    TAG_PARENT,
    TAG_RESUMED_FROM_STEP,
    TAG_REUSED_FROM,
    TAG_TOKENIZER_SHA256,
    TAG_TRAIN_KEY,
    TAG_TRAIN_REQUEST,
)

if TYPE_CHECKING:
    from training.config import TrainConfig
    from training.trainer import TrainResult

# Fields that change how a training runs, not what it produces.
OPERATIONAL_FIELDS = frozenset(
    {
        "max_failures",
        "keep_checkpoints",
        "checkpoint_threads",
        "checkpoint_every",
        "log_every",
        "storage_path",
        "peak_tflops",
        "resources_per_worker",
        "placement_timeout_s",
    }
)


class InitSource(BaseModel):
    """train.init_from resolved: the checkpoint whose model weights start the training, and where it came from."""

    checkpoint_uri: str
    model_version: str = ""  # "name/version" when it came from the registry
    label: str


def _digest(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def request_key(cfg: TrainConfig, dataset_digest: str) -> str:
    """Key of the training the user asked for: dataset digest + the result-determining config."""
    fields = {k: v for k, v in cfg.model_dump().items() if k not in OPERATIONAL_FIELDS}
    if not fields.get("vocab_size"):  # 0: the data's vocabulary, which the digest pins; older keys stay valid
        fields.pop("vocab_size", None)
    return _digest({"dataset": dataset_digest, "train": fields})


def training_key(request: str, init: InitSource | None) -> str:
    """Key of the training actually run: the request plus the checkpoint it starts from."""
    return _digest({"request": request, "init": init.checkpoint_uri if init else ""})


def resolve_init_from(spec: str, model_name: str, tracking_uri: str, tokenizer_sha256: str = "") -> InitSource | None:
    """The checkpoint train.init_from names; None for '' and for 'champion' while the model has no champion.

    `tokenizer_sha256`: the fingerprint of the tokenizer this run's shard set was made with ("" for bytes). A
    registered version's weights embed the ids of the tokenizer it was tagged with (bytes when untagged), so
    continuing them on another tokenizer's ids would train on ids that mean something else: refused, also for
    'champion' (a run that changes its tokenizer starts from scratch, `train.init_from = ''`). A bare checkpoint
    URI records no tokenizer; only its shapes are checked (check_init_checkpoint).

    Raises:
        CheckpointError: a registry reference that does not exist, whose version records no checkpoint, or
            whose tokenizer is not this run's.
    """
    from training.checkpoint import CheckpointError

    spec = spec.strip()
    if not spec:
        return None
    if spec != "champion" and not spec.startswith("models:/"):
        return InitSource(checkpoint_uri=spec, label=f"checkpoint {spec}")
    from mlflow.exceptions import MlflowException

    from infra.tracking import registry_client

    client = registry_client(tracking_uri)
    name, ref = (model_name, f"@{CHAMPION}") if spec == "champion" else _split_models_uri(spec)
    try:
        mv = (
            client.get_model_version_by_alias(name, ref[1:])
            if ref.startswith("@")
            else client.get_model_version(name, ref)
        )
    except MlflowException as e:
        if spec == "champion" and e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise CheckpointError(f"train.init_from={spec!r}: {name} {ref} is not in the registry") from None
    checkpoint = (mv.tags or {}).get(TAG_CHECKPOINT_URI, "")
    if not checkpoint:
        raise CheckpointError(f"train.init_from={spec!r}: {name} version {mv.version} records no {TAG_CHECKPOINT_URI}")
    theirs = (mv.tags or {}).get(TAG_TOKENIZER_SHA256, "")
    if theirs != tokenizer_sha256:
        raise CheckpointError(
            f"train.init_from={spec!r}: {name} version {mv.version} was trained on "
            f"{_ids(theirs)}, this run's shard set on {_ids(tokenizer_sha256)}; its weights embed other ids, so "
            "set train.init_from = '' to start from scratch (or shard with the version's tokenizer)"
        )
    return InitSource(
        checkpoint_uri=checkpoint, model_version=f"{name}/{mv.version}", label=f"{name} v{mv.version} ({spec})"
    )


def _ids(tokenizer_sha256: str) -> str:
    return f"the ids of tokenizer {tokenizer_sha256[:12]}" if tokenizer_sha256 else "bytes"


def _split_models_uri(spec: str) -> tuple[str, str]:
    from training.checkpoint import CheckpointError

    rest = spec[len("models:/") :].strip("/")
    if "@" in rest:
        name, alias = rest.split("@", 1)
        return name, f"@{alias}"
    name, _, version = rest.partition("/")
    if not name or not version or "/" in version:
        raise CheckpointError(f"train.init_from={spec!r}: expected models:/name/version or models:/name@alias")
    return name, version


def check_init_checkpoint(init: InitSource, cfg: TrainConfig) -> None:
    """Before any worker starts: the checkpoint is complete and intact, and fits the configured model's shapes.

    Raises:
        CheckpointError: naming the file or the tensor and both shapes.
    """
    import torch

    from training.checkpoint import check_shapes, local_copy, verify_checkpoint
    from training.config import load_object

    with torch.device("meta"):  # shapes only, no memory
        model = load_object(cfg.model_factory, "train.model_factory")(cfg)
    with local_copy(init.checkpoint_uri) as directory:
        verify_checkpoint(directory)
        check_shapes(directory, "model.", model.state_dict())


def find_completed(tracking_uri: str, experiment: str, request: str, init: InitSource | None) -> TrainResult | None:
    """The finished training of the same request whose checkpoint still verifies; None when there is none.

    It must start from the same weights as `init`, or be the training that produced them while its own flow run
    never finished: the killed attempt of this very command had already made its product the champion, so
    `init_from = "champion"` now names it. A training whose flow run finished is not reused that way: a second
    run continuing from its product is new training.
    """
    from mlflow import MlflowClient

    from training.checkpoint import CheckpointError, local_copy, verify_checkpoint
    from training.trainer import TrainResult

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs(
        [exp.experiment_id],
        f"tags.`{TAG_TRAIN_REQUEST}` = '{request}' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
    )
    wanted = init.checkpoint_uri if init else ""
    for run in runs:
        tags = run.data.tags
        checkpoint = tags.get(TAG_CHECKPOINT_URI, "")
        if not checkpoint or TAG_REUSED_FROM in tags:
            continue
        if wanted and wanted != tags.get(TAG_INIT_CHECKPOINT, ""):
            parent = tags.get(TAG_PARENT, "")
            if wanted != checkpoint or not parent or client.get_run(parent).info.status == "FINISHED":
                continue
        if not wanted and tags.get(TAG_INIT_CHECKPOINT):
            continue
        try:
            with local_copy(checkpoint) as directory:
                info = verify_checkpoint(directory)
        except (CheckpointError, OSError):
            continue
        metrics = run.data.metrics
        return TrainResult(
            train_run_id=run.info.run_id,
            checkpoint_uri=checkpoint,
            step=info.step,
            final_loss=float(metrics.get("final_loss", float("nan"))),
            tokens_per_s=float(metrics.get("tokens_per_s", 0.0)),
            world_size=info.world_size,
        )
    return None
