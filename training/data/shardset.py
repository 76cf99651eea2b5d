"""The data stage's product (ShardSet) and its one error type (DataError)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class DataError(ValueError):
    """Bad input or a failed quality gate; the message names the file, field or expectation (one line per cause)."""


class ShardSet(BaseModel):
    """A published, validated shard set: what training and evaluation read."""

    dataset_digest: str = Field(description="32 hex chars over the shard contents and layout.")
    uri: str = Field(description="The shard-set prefix: {output}/{dataset_digest}.")
    manifest_uri: str = Field(description="The manifest, written last; its presence means the set is complete.")
    train_shards: list[str] = Field(description="Full URIs of the training shards (.tar).")
    val_shards: list[str] = Field(description="Full URIs of the validation shards (.tar).")
    num_train: int = Field(description="Training records.")
    num_val: int = Field(description="Validation records.")
    total_bytes: int = Field(description="Bytes of all shards together.")
    cache_hit: bool = Field(description="True when an identical, verified shard set was already published.")
    skipped: dict[str, int] = Field(default_factory=dict, description="Records skipped by policy, per cause.")
    data_run_id: str = Field("", description="MLflow run id of the shard_dataset stage that produced this.")
    chunks: int = Field(0, description="Chunks the corpus was written in (0 when opened, not built).")
    workers: int = Field(0, description="Worker processes, or Ray tasks in flight, that wrote them.")
    tokenizer_sha256: str = Field(
        "", description="Fingerprint of the tokenizer whose ids every record carries as .ids; '' for text only."
    )
    token_dtype: str = Field("", description="How the .ids are stored: '<u2' or '<u4' (numpy); '' for text only.")
    vocab_size: int = Field(0, description="The tokenizer's ids (every id is below it); 0 for text only.")
    tokenizer_uri: str = Field(
        "", description="The set's own tokenizer.json (verified against tokenizer_sha256); '' for text only."
    )
