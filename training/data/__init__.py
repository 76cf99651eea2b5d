"""The dataset: corpus readers, WebDataset shard writing and validation, and the streaming reader."""
