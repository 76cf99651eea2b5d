"""`shardline lineage`: follow one chain from a registered model version back to the dataset digest."""

from __future__ import annotations

from typing import Any

from infra.names import (
    TAG_CHAT_TEMPLATE_SHA256,
    TAG_CHAT_TOKENS,
    TAG_CHECKPOINT_URI,
    TAG_DATA_RUN_ID,
    TAG_DATASET_DIGEST,
    TAG_FLOW_RUN_ID,
    TAG_GIT_COMMIT,
    TAG_MANIFEST_URI,
    TAG_PARENT,
    TAG_TOKENIZER_SHA256,
    TAG_VALIDATION_RUN_ID,
)
from infra.tracking import resolve_tracking_uri
from training.chat_template import tokens_of_tag


class LineageError(LookupError):
    """The model, version or alias does not exist, or a link in the chain is missing."""


def describe_lineage(model_name: str, version_or_alias: str, tracking_uri: str = "") -> dict[str, Any]:
    """Resolve a version (or alias) and return its chain: flow run -> data run/digest -> training run -> version.

    The dataset digest is read twice, from the version's tag and from the data run's logged dataset input,
    and `consistent` says whether they agree. A run the chain names but the tracking store no longer has (deleted
    and purged by `mlflow gc`, or from another store) is a missing link, not an error: the chain is still shown,
    what that run would have told is left empty, `missing` names it, and `consistent` is false, as the digest
    cannot be read twice.

    Raises:
        LineageError: the model, version or alias does not exist.
    """
    from mlflow.exceptions import MlflowException

    from deployments.registry import client_for

    client = client_for(resolve_tracking_uri(tracking_uri))
    try:
        if version_or_alias.isdigit():
            mv = client.get_model_version(model_name, version_or_alias)
        else:
            mv = client.get_model_version_by_alias(model_name, version_or_alias)
    except MlflowException as e:
        raise LineageError(f"model {model_name!r} {version_or_alias!r}: {e.message.splitlines()[0]}") from None
    tags = mv.tags
    data_run_id = tags.get(TAG_DATA_RUN_ID, "")
    missing: list[str] = []
    data_run = _run_if_stored(client, data_run_id, "data run", missing)
    logged_digests = [d.dataset.digest for d in data_run.inputs.dataset_inputs] if data_run else []
    train_run = _run_if_stored(client, mv.run_id or "", "train run", missing)
    return {
        "model": model_name,
        "version": str(mv.version),
        "aliases": ",".join(mv.aliases),
        "status": "rejected" if "rejected" in tags else "ok",
        "dataset_digest": tags.get(TAG_DATASET_DIGEST, ""),
        "manifest_uri": tags.get(TAG_MANIFEST_URI, ""),
        "tokenizer_sha256": tags.get(TAG_TOKENIZER_SHA256, ""),  # "" for bytes: what turned the texts into ids
        "chat_template_sha256": tags.get(TAG_CHAT_TEMPLATE_SHA256, ""),  # "" for none: how chat becomes a prompt
        "chat_tokens": tokens_of_tag(tags.get(TAG_CHAT_TOKENS, "")),  # the special tokens it sees ({} for none)
        "data_run_id": data_run_id,
        "train_run_id": mv.run_id or "",
        "checkpoint_uri": tags.get(TAG_CHECKPOINT_URI, ""),
        "validation_run_id": tags.get(TAG_VALIDATION_RUN_ID, ""),
        "parent_run_id": train_run.data.tags.get(TAG_PARENT, "") if train_run else "",
        "prefect_flow_run_id": tags.get(TAG_FLOW_RUN_ID, ""),
        "git_commit": tags.get(TAG_GIT_COMMIT, ""),
        "consistent": bool(logged_digests) and tags.get(TAG_DATASET_DIGEST) in logged_digests,
        "missing": ", ".join(missing),  # runs the chain names that the store does not have ("" for none)
    }


def _run_if_stored(client: Any, run_id: str, role: str, missing: list[str]) -> Any:
    """The run `run_id`, or None when there is none: no id, or one the store does not have (then `role` and the id
    are appended to `missing`). Any other failure (a server that did not answer) is raised: that is no answer
    about the chain."""
    from mlflow.exceptions import MlflowException

    if not run_id:
        return None
    try:
        return client.get_run(run_id)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        missing.append(f"{role} {run_id}")
        return None
