"""What the data stage records in MLflow: the dataset input (digest + location) and the quality report."""

from __future__ import annotations

import json
from typing import Any

from infra import storage
from training.data.shards import VALIDATION_NAME
from training.data.shardset import ShardSet


def dataset_source(uri: str) -> Any:
    """An MLflow DatasetSource for the shard-set URI: MLflow's own for local and s3://, a plain one for az://."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source

    try:
        return resolve_dataset_source(uri)
    except Exception:  # MLflow has no source type for this scheme (az://)
        return _uri_source_class()(uri)


def _uri_source_class() -> type:
    from mlflow.data.dataset_source import DatasetSource

    class ShardSetSource(DatasetSource):
        """A shard-set prefix in object storage, recorded by URI only."""

        def __init__(self, uri: str) -> None:
            self.uri = uri

        @staticmethod
        def _get_source_type() -> str:
            return "shardline_uri"

        def load(self, **kwargs: Any) -> str:
            return self.uri

        @staticmethod
        def _can_resolve(raw_source: Any) -> bool:
            return False

        @classmethod
        def _resolve(cls, raw_source: Any) -> ShardSetSource:
            return cls(str(raw_source))

        def to_dict(self) -> dict[str, Any]:
            return {"uri": self.uri}

        @classmethod
        def from_dict(cls, source_dict: dict[Any, Any]) -> ShardSetSource:
            return cls(source_dict["uri"])

    return ShardSetSource


def log_dataset(shards: ShardSet, retries: int = 5) -> dict[str, Any] | None:
    """Log the shard set as the active run's dataset input and its GX report as an artifact; return the report."""
    import mlflow
    from mlflow.data.meta_dataset import MetaDataset

    # MLflow's documented way to log a dataset by reference; its stubs mark `profile` abstract, the class is not
    dataset = MetaDataset(
        source=dataset_source(shards.uri), name=f"shards-{shards.dataset_digest[:8]}", digest=shards.dataset_digest
    )  # type: ignore[abstract]
    mlflow.log_input(dataset, context="training")
    try:
        report = json.loads(storage.read_bytes(storage.join(shards.uri, VALIDATION_NAME), retries))
    except storage.StorageError:
        return None
    mlflow.log_dict(report, "data/validation.json")
    return report
