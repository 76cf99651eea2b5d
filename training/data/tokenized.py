"""The data stage with a `[tokenizer]`: text in, shards that carry token ids out.

- bytes: the text shard set, as without a tokenizer (training reads the UTF-8 bytes of .txt).
- file: the tokenizer.json at tokenizer.path, read and checked before any record is, then one build whose records
  carry their ids.
- train: the text shard set first, then a byte-level BPE trained on its training split only (the held-out texts
  never shape the vocabulary), cached under $SHARDLINE_HOME/tokenizers by the set's digest and the settings, then the
  tokenized build of the same corpus. A rerun over an unchanged corpus is a listing-index hit for both builds and a
  cache hit for the tokenizer: nothing is read or trained again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, Field

from infra.paths import shardline_home
from training import tokenizer as tk
from training.data.build import build_shards
from training.data.config import DataConfig
from training.data.shardset import ShardSet


class TokenizedSet(BaseModel):
    """A tokenized build: the set training reads, the text set a trained tokenizer learned from, and the tokenizer."""

    shards: ShardSet = Field(description="The set to train on (records carry .ids unless tokenizer.kind='bytes').")
    text_digest: str = Field("", description="kind='train': the text set whose training split the BPE learned.")
    tokenizer_path: str = Field("", description="The tokenizer.json used (the trained one is in the cache).")
    tokenizer_sha256: str = Field("", description="training.tokenizer.fingerprint of it; '' for bytes.")
    tokenizer_cache_hit: bool = Field(False, description="kind='train': the tokenizer was read from the cache.")


def build_tokenized(cfg: DataConfig, tok_cfg: tk.TokenizerConfig, cache_dir: Path | None = None) -> TokenizedSet:
    """Build (or find) the shard set of `cfg`'s corpus for the tokenizer `tok_cfg` (see the module docstring).

    Raises:
        tokenizer.TokenizerError: tokenizer.path is missing or not a tokenizer.json (before the corpus is read).
        DataError, storage.StorageError: as build_shards.
    """
    if tok_cfg.kind == "bytes":
        return TokenizedSet(shards=build_shards(cfg))
    if tok_cfg.kind == "file":
        tok = tk.load(tok_cfg.path)
        shards = build_shards(cfg, tok)
        return TokenizedSet(
            shards=shards,
            tokenizer_path=tok_cfg.path,
            tokenizer_sha256=tk.fingerprint(tok),
        )
    text = build_shards(cfg)

    def train_split() -> Iterator[bytes]:
        from training.data.loader import iter_texts  # webdataset and torch: only when a tokenizer is trained

        return (data for _, data in iter_texts(text.train_shards))

    cache = cache_dir or shardline_home() / "tokenizers"
    tok, path, hit = tk.trained(tok_cfg, text.dataset_digest, train_split, cache)
    return TokenizedSet(
        shards=build_shards(cfg, tok),
        text_digest=text.dataset_digest,
        tokenizer_path=str(path),
        tokenizer_sha256=tk.fingerprint(tok),
        tokenizer_cache_hit=hit,
    )
