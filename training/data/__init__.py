"""The dataset: corpus readers, WebDataset shard writing and validation, and the streaming reader."""

from training.data.build import build_shards
from training.data.publish import load_shard_set
from training.data.shardset import DataError, ShardSet

__all__ = ["DataError", "ShardSet", "build_shards", "load_shard_set"]
