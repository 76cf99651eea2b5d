"""Tokenizers a team brings or trains: a `tokenizer.json` of Hugging Face's `tokenizers` library, read from a path,
s3:// or az://, or a byte-level BPE trained on a shard set's training split and cached by its digest and settings.

Token ids travel as little-endian unsigned integers (uint16 when the vocabulary fits, else uint32), never pickled.
A byte-level BPE (GPT-2's scheme) is lossless on any UTF-8 text, so bits per byte stay comparable with the built-in
byte model: a text's summed token NLL divided by its UTF-8 bytes (training/bpb.py).

Nothing is fetched from a model hub: a tokenizer is a file or the product of `train_bpe`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from infra import storage
from infra.redact import redact
from training.config import TokenizerConfig  # noqa: F401 - re-exported: the section is configured as tk.TokenizerConfig

FILE_NAME = "tokenizer.json"
END_OF_TEXT = "<|endoftext|>"  # the one special token a trained BPE carries: id 0, between documents
TRAINER_VERSION = 1  # part of the cache key: bump when train_bpe's settings change what it learns


class TokenizerError(ValueError):
    """A tokenizer that cannot be used: the message is one line and names the file or setting."""


def byte_level_table() -> dict[str, int]:
    """GPT-2's byte-to-character map reversed: a byte-level BPE writes byte b as the character this maps to b."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(visible), 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(visible, chars, strict=True)}


def train_bpe(texts: Iterable[bytes], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE learned from `texts` (UTF-8 records), in their order: the same texts give the same
    tokenizer, byte for byte of its JSON. Its first 256 non-special ids cover every byte, so no text is unknown."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((t.decode("utf-8") for t in texts), trainer=trainer)
    return tok


def load(uri: str) -> Tokenizer:
    """The tokenizer.json at a path, s3:// or az:// URI.

    Raises:
        TokenizerError: the file is missing, unreadable or not a tokenizer (one line, naming the URI).
    """
    try:
        raw = storage.read_bytes(uri)
    except storage.StorageError as err:
        raise TokenizerError(f"tokenizer.path: {err}") from None
    try:
        return Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON; also UnicodeDecodeError
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise TokenizerError(f"tokenizer.path={redact(uri)}: not a tokenizer.json ({first})") from None


def fingerprint(tok: Tokenizer) -> str:
    """sha256 of the tokenizer's canonical JSON: the lineage tag of what turned text into ids."""
    return fingerprint_json(tok.to_str())


def fingerprint_json(text: str) -> str:
    """fingerprint of a tokenizer.json's text, without parsing it into a Tokenizer (key order and spacing aside)."""
    canonical = json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def id_count(tok: Tokenizer) -> int:
    """How many ids `tok` can emit, counted as its largest id + 1: the embedding rows it needs and the range its
    stored ids take. A tokenizer.json may leave ids unused (`get_vocab_size` counts tokens, which is less then)."""
    return max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def check_fits(tok: Tokenizer, embedding_rows: int, where: str) -> None:
    """TokenizerError when an id of `tok` has no row in a model embedding of `embedding_rows` (named by `where`)."""
    vocab = id_count(tok)
    if vocab > embedding_rows:
        raise TokenizerError(
            f"the tokenizer has {vocab} ids but {where} embeds {embedding_rows}; "
            f"use a model with vocab_size >= {vocab} or a smaller tokenizer.vocab_size"
        )


def id_dtype(vocab_size: int) -> np.dtype:
    """How token ids are stored in shards: little-endian uint16 up to 65,536 ids, else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


LAYOUT_KEYS = ("tokenizer_sha256", "token_dtype", "vocab_size")  # shard_layout's: what reads a set's ids back


def shard_layout(tok: Tokenizer) -> dict[str, Any]:
    """What a tokenized shard set records of its tokenizer (manifest layout, listing-index key): the ids can be read
    back only with these (LAYOUT_KEYS)."""
    vocab = id_count(tok)
    return dict(zip(LAYOUT_KEYS, (fingerprint(tok), id_dtype(vocab).str, vocab), strict=True))


def batch_encoder(tokenizer_json: str) -> Callable[[list[bytes]], list[bytes]]:
    """UTF-8 records -> their stored token ids, for a data-stage worker that got the tokenizer as JSON text."""
    tok = Tokenizer.from_str(tokenizer_json)
    return lambda texts: encode_records(tok, texts)


def encode_records(tok: Tokenizer, texts: list[bytes]) -> list[bytes]:
    """Each UTF-8 record's token ids as stored bytes (id_dtype), encoded as one batch on the library's threads."""
    dtype = id_dtype(id_count(tok))
    encoded = tok.encode_batch_fast([t.decode("utf-8") for t in texts], add_special_tokens=False)
    return [np.asarray(e.ids, dtype=dtype).tobytes() for e in encoded]


def decode_ids(tok: Tokenizer, stored: bytes) -> bytes:
    """The UTF-8 text of stored token ids (encode_records' inverse for a byte-level BPE)."""
    dtype = id_dtype(id_count(tok))
    return tok.decode(np.frombuffer(stored, dtype=dtype).tolist(), skip_special_tokens=False).encode("utf-8")


def predicted(tok: Tokenizer, text: bytes) -> tuple[list[int], int]:
    """The text's token ids, and the UTF-8 bytes that every token but the first covers: what a model scoring the
    text predicts (training.bpb.token_bits). A byte-level tokenizer's token is one character per byte, so the
    count is exact; for other tokenizers it is read from the second token's character offset (a character split
    across the first two tokens then counts whole)."""
    ids_enc = tok.encode(text.decode("utf-8"), add_special_tokens=False)
    if len(ids_enc.ids) < 2:
        return list(ids_enc.ids), 0
    if isinstance(tok.decoder, decoders.ByteLevel):
        # each character of a byte-level token is one byte of the text: count the later tokens' own, not the text
        # less the first token's (a pre-tokenizer that adds a prefix space puts a byte in it the text does not have)
        return list(ids_enc.ids), sum(len(t) for t in ids_enc.tokens[1:])
    first = len(text.decode("utf-8")[: ids_enc.offsets[1][0]].encode("utf-8"))
    return list(ids_enc.ids), len(text) - first


def cache_key(cfg: TokenizerConfig, dataset_digest: str) -> str:
    """What a trained tokenizer depends on: the shard set, the settings, the trainer and the library version."""
    parts = {
        "dataset_digest": dataset_digest,
        "vocab_size": cfg.vocab_size,
        "min_frequency": cfg.min_frequency,
        "trainer": TRAINER_VERSION,
        "tokenizers": tokenizers.__version__,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def trained(
    cfg: TokenizerConfig, dataset_digest: str, train_texts: Callable[[], Iterator[bytes]], cache_dir: Path
) -> tuple[Tokenizer, Path, bool]:
    """The BPE of `cfg` for the shard set `dataset_digest`: read from `cache_dir` when this key was trained before,
    else trained on `train_texts()` and written there (renamed into place, so a killed run leaves no half file).

    Returns:
        (tokenizer, its tokenizer.json, cache_hit).
    """
    path = cache_dir / cache_key(cfg, dataset_digest) / FILE_NAME
    if path.is_file():
        return load(str(path)), path, True
    tok = train_bpe(train_texts(), cfg.vocab_size, cfg.min_frequency)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{FILE_NAME}.tmp{os.getpid()}")
    tmp.write_text(tok.to_str(), encoding="utf-8")
    os.replace(tmp, path)
    return tok, path, False
