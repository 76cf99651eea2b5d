"""Which stage results Prefect itself may reuse across flow runs (its cache policies and persisted results).

Validation is a pure function of what it reads: the checkpoint's bytes (named by the sha256s in its manifests),
the held-out shards (the dataset digest), the validation and model config and the champion it is compared
with. Its result is therefore cached by Prefect under that key, persisted as JSON (no pickle) under
$SHARDLINE_HOME/results: a rerun after a crash in a later stage (promotion, canary) returns the recorded
ValidationResult instead of scoring and exporting the model again (~30 s of the debug run's 80). MLflow stays the
system of record: the cached result points at the validation run and logged model the first attempt recorded.

The other stages are not cached by Prefect, on purpose. The shard set is reused by its content digest, which is
known only after the corpus is read (a cache on the config would serve stale shards of a changed corpus). A
training is reused or resumed from MLflow and the checkpoint store (`training/resume.py`), because reuse must
first verify that the checkpoint is still there and intact, and resume must find the newest complete checkpoint
of an attempt that never returned a result. Registration is idempotent in the registry itself (the version made
from the same checkpoint is reused), and provisioning and the canary act on live systems: their "result" is
not a value worth replaying.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.cache_policies import TASK_SOURCE, CachePolicy

log = logging.getLogger(__name__)
RESULTS_DIR = "results"
# what a record may be decoded as: Prefect's JSON serializer, its own decoder, and only these classes in the result
_JSON_SERIALIZER = {
    "type": "json",
    "jsonlib": "json",
    "object_decoder": "prefect.serializers.prefect_json_object_decoder",
    "loads_kwargs": {},
}
RESULT_CLASSES = {"training.evaluate.ValidationResult"}


class UntrustedRecord(ValueError):
    """A persisted result record that Prefect would decode with pickle, or into a class the flow never returns."""


def results_dir() -> Path:
    """Where persisted task results and cache records live: $SHARDLINE_HOME/results."""
    from infra.paths import shardline_home

    return shardline_home() / RESULTS_DIR


def screen_record(path: Path) -> None:
    """Move a persisted record Prefect must not decode out of its way (to PATH.refused, with one warning line).

    Prefect decodes a stored record with the serializer the record itself names, not the task's: a record in the
    results folder that names Prefect's pickle serializer would be unpickled on a cache hit (even by the check
    that the record exists), whatever `result_serializer` the task sets. The cache policy screens the record of
    the key it computed before Prefect reads it; with none there, the task runs and writes a good one.
    """
    if not path.is_file():
        return
    try:
        checked_record(str(path), path.read_bytes())
    except UntrustedRecord as e:
        path.replace(path.with_name(path.name + ".refused"))
        log.warning("%s; moved aside, validation runs again", e)


def checked_record(path: str, content: bytes) -> bytes:
    """`content` when it is a result record Prefect will decode as JSON into RESULT_CLASSES only, else
    UntrustedRecord naming `path` and what is wrong."""
    try:
        record = json.loads(content)
        serializer = dict(record["metadata"]["serializer"])
    except (ValueError, KeyError, TypeError) as e:
        raise UntrustedRecord(f"{path}: not a result record ({type(e).__name__})") from None
    wrong = {k: serializer.get(k) for k, v in _JSON_SERIALIZER.items() if serializer.get(k, v) != v}
    if wrong:
        raise UntrustedRecord(f"{path}: its serializer {wrong} is not Prefect's JSON; refusing to decode it")
    try:
        result = json.loads(record["result"])
    except (ValueError, KeyError, TypeError) as e:
        raise UntrustedRecord(f"{path}: its result is not JSON ({type(e).__name__})") from None
    for name in _class_names(result):
        if name not in RESULT_CLASSES:
            raise UntrustedRecord(f"{path}: its result names class {name!r}; refusing to decode it")
    return content


def _class_names(value: Any) -> list[str]:
    """Every class a JSON value asks Prefect's decoder to build (`__class__`, `__exc_type__`), nested ones too."""
    if isinstance(value, list):
        return [n for v in value for n in _class_names(v)]
    if not isinstance(value, dict):
        return []
    own = [str(value[k]) for k in ("__class__", "__exc_type__") if k in value]
    return own + [n for v in value.values() for n in _class_names(v)]


def validation_key(
    cfg: Any, train_cfg: Any, trained: Any, shards: Any, lineage: Any, registry: Any, chat_template: Any = ""
) -> str | None:
    """The cache key of a validation: checkpoint content, data, configs, registry, current champion and the chat
    template the logged model carries.

    None (no caching) when the checkpoint's manifests cannot be read: the task then runs and reports why.
    """
    from mlflow.exceptions import MlflowException

    from deployments.registry import CHAMPION, client_for, read_aliases
    from infra import storage
    from training.chat_template import ChatFormat, fingerprint
    from training.checkpoint_manifest import manifest_name

    try:
        manifests = [
            hashlib.sha256(storage.read_bytes(storage.join(trained.checkpoint_uri, manifest_name(rank)), 1)).hexdigest()
            for rank in range(max(1, trained.world_size))
        ]
        champion = (
            read_aliases(client_for(lineage.tracking_uri), registry.model_name).get(CHAMPION, "")
            if registry is not None
            else ""
        )
    except (OSError, storage.StorageError, MlflowException):
        return None
    payload = {
        "checkpoint": trained.checkpoint_uri,
        "manifests": manifests,
        "dataset": shards.dataset_digest,
        "validation": cfg.model_dump(mode="json"),
        "train": train_cfg.model_dump(mode="json"),
        "tracking": hashlib.sha256(lineage.tracking_uri.encode()).hexdigest(),
        "experiment": lineage.experiment,
        "model": registry.model_name if registry is not None else "",
        "champion": champion,
    }
    chat = ChatFormat.given(chat_template)
    if chat:  # only when set: a run without one hashes the same inputs as before
        payload["chat_template"] = fingerprint(chat.template)
    if chat.tokens():  # the special tokens chat renders with, likewise only when named
        payload["chat_tokens"] = chat.tokens()
    return "validate-" + hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class ValidationInputs(CachePolicy):
    """Prefect cache policy keyed by `validation_key` of the task's inputs and the task's source code (a change
    to the code invalidates what it recorded). No key, no caching: not composed with `+`, which would drop a
    None key and cache on the source alone."""

    def compute_key(
        self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any
    ) -> str | None:
        key = validation_key(
            inputs["cfg"],
            inputs["train_cfg"],
            inputs["trained"],
            inputs["shards"],
            inputs["lineage"],
            inputs.get("registry"),
            inputs.get("chat_template", ""),
        )
        if key is None:
            return None
        full = f"{key}-{TASK_SOURCE.compute_key(task_ctx, inputs, flow_parameters, **kwargs)}"
        screen_record(results_dir() / full)
        return full


VALIDATION_CACHE = ValidationInputs()
