"""Configuration of the data stage: where the corpus is, how it is split and sharded, what is rejected."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from training.data.tarwriter import TAR_RECORD

Policy = Literal["fail", "skip"]


class DataConfig(BaseModel):
    """Corpus source, shard destination, split, shard limits and the bad-input policy."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound never fails a check

    source: str = Field(
        "stdlib",
        description="The corpus: 'stdlib' (the running interpreter's top-level standard-library .py files), "
        "a local directory or .jsonl / .parquet file, 's3://bucket/prefix' or 'az://container/prefix' (or one "
        "object there: 's3://bucket/data/one.jsonl').",
    )
    format: Literal["text", "jsonl", "parquet", "hf_dataset"] = Field(
        "text",
        description="text: one record per file; jsonl: one record per line of each .jsonl file; parquet: one "
        "record per row of each .parquet file (read a row group at a time); hf_dataset: one record per row of the "
        "directory data.source written by datasets' save_to_disk (a Dataset or a DatasetDict: every split, in "
        "order; data.include is not used).",
    )
    text_field: str = Field(
        "text",
        min_length=1,
        description="Field of each JSON Lines object, or column of the Parquet files or saved dataset, that holds "
        "the text (a string column; binary columns are taken as UTF-8 bytes).",
    )
    key_field: str = Field(
        "",
        description="Field (JSON Lines) or column (parquet, hf_dataset) used as the record key: a string or an "
        "integer. '' keys by file and line (JSON Lines, from 1) or file and row (from 0).",
    )
    include: str = Field(
        "*",
        description="Glob that file names (not paths) must match; 'stdlib' always uses '*.py'; '*' means "
        "'*.jsonl' or '*.parquet' for those formats.",
    )
    reader: str = Field(
        "",
        description="Import path 'module:function' of a custom record reader; it gets (source, config) and "
        "yields (key, bytes). Empty uses the built-in reader for `format`.",
    )
    output: str = Field(
        "",
        description="Where shard sets are published: a local directory, 's3://bucket/prefix' or "
        "'az://container/prefix'. Empty means $SHARDLINE_HOME/shards.",
    )
    val_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="Fraction of records held out for validation (seeded hash split)."
    )
    split_tolerance: float = Field(
        0.1, ge=0.0, le=1.0, description="Allowed deviation of the realised validation fraction from val_fraction."
    )
    seed: int = Field(0, description="Seed of the train/validation split.")
    max_samples_per_shard: int = Field(64, ge=1, description="Records per shard at most.")
    max_shard_bytes: int = Field(
        32 * 1024 * 1024,
        ge=TAR_RECORD,
        description=f"Bytes per shard at most (a record never spans shards). At least {TAR_RECORD}: a tar file is "
        "written in whole records of that size, so a smaller bound would be broken by every shard.",
    )
    min_record_bytes: int = Field(
        1,
        ge=1,
        description="Records shorter than this are bad input (empty files). At least 1: the quality gate "
        "(expectations.json) always fails an empty record, so 0 would let one through to fail the whole stage.",
    )
    max_record_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1,
        le=2**31 - 1,
        description="Records longer than this are bad input (e.g. a single 200 MB line).",
    )
    on_empty_record: Policy = Field("skip", description="Empty or too-short record: fail the stage or skip and count.")
    on_oversize: Policy = Field("skip", description="Record over max_record_bytes: fail or skip and count.")
    on_binary: Policy = Field("skip", description="File that looks binary (NUL bytes): fail or skip and count.")
    on_undecodable: Policy = Field("skip", description="Bytes that are not valid UTF-8: fail or skip and count.")
    on_unreadable: Policy = Field("fail", description="File that cannot be read (permissions, I/O): fail or skip.")
    on_symlink_loop: Policy = Field("skip", description="Symlink loop or dangling link: fail or skip and count.")
    on_unsafe_name: Policy = Field(
        "fail", description="Name with '..' or an absolute component, or not UTF-8: fail or skip and count."
    )
    verify_existing: Literal["sha256", "size"] = Field(
        "sha256",
        description="How an already published set is verified before it is reused (cache hit): every shard's "
        "sha256, or only its size (cheaper for large remote sets).",
    )
    reuse_unchanged: bool = Field(
        True,
        description="Reuse a published set without reading the corpus when the corpus' listing (every input's "
        "key, size and change stamp: file times, object ETags) and the shaping settings equal those it was built "
        "from; the set is verified first (verify_existing). false: read everything, the content digest decides.",
    )
    workers: int = Field(
        0,
        ge=0,
        description="Chunks processed at once: worker processes (engine=local) or Ray tasks in flight "
        "(engine=ray). 0 means the cores this process may use (local; a corpus of at most 4 chunks is then "
        "written in this process, where starting workers would cost more than they save) or the cluster's CPUs "
        "(ray). The shards are byte-identical whatever the number.",
    )
    engine: Literal["local", "ray"] = Field(
        "local",
        description="local: worker processes on this machine; ray: Ray tasks on the provisioned cluster, which "
        "read the corpus and, for an s3:// or az:// output, upload the shards themselves.",
    )
    chunk_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        description="Listed corpus bytes per chunk, the unit of parallel work: consecutive files or objects of "
        "the sorted listing (a file is never split). Part of the layout: changing it changes the shards.",
    )
    gate_batch_records: int = Field(
        10_000,
        ge=1,
        description="Records per Great Expectations batch: bounds the quality gate's memory whatever the corpus "
        "size (uniqueness and the split fraction are exact aggregates over all records).",
    )
    storage_retries: int = Field(
        5, ge=0, description="Retries (exponential backoff) of one storage call on endpoint errors, 5xx, timeouts."
    )

    @model_validator(mode="after")
    def _format_fits_source(self) -> DataConfig:
        if self.source == "stdlib" and not self.reader and self.format != "text":
            raise ValueError(
                f"data.format={self.format!r} needs a data.source of that format; 'stdlib' is the "
                "interpreter's .py files (data.format='text')"
            )
        if self.min_record_bytes > self.max_record_bytes:  # every record would be bad input, found after reading all
            raise ValueError(
                f"data.min_record_bytes={self.min_record_bytes} > data.max_record_bytes={self.max_record_bytes}: "
                "no record could be kept"
            )
        return self
