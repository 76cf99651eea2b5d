"""How a served model's ids meet text: bytes are their own ids (`BYTES`), a tokenizer's ids go through the
tokenizer.json the model version carries (`TokenCodec`, training.servable.served_tokenizer).

The engine and generation work on bytes: every id decodes to the bytes it stands for (`piece`), and those bytes go
through one incremental UTF-8 decoder, so a character split across ids, and a stop string split across them, are
held back exactly as they are for a byte model. Scoring counts the UTF-8 bytes the predicted ids cover
(training.tokenizer.predicted), so bits per byte is one scale for every model.
"""

from __future__ import annotations

from typing import Any

RAW_LABEL = "bytes:"  # a logprobs label of bytes that are not whole characters: `bytes:\\xNN...` (OpenAI's form)


def raw_label(raw: bytes) -> str:
    """The `bytes:\\xNN...` label of `raw`."""
    return RAW_LABEL + "".join(f"\\x{b:02x}" for b in raw)


def label_bytes(label: str) -> bytes | None:
    """The bytes a `bytes:\\xNN...` label stands for; None for a label that is text."""
    if not label.startswith(RAW_LABEL):
        return None
    return bytes(int(h, 16) for h in label.removeprefix(RAW_LABEL).split("\\x")[1:])


def byte_label(token: int) -> str:
    """How a byte reads in `logprobs`: the character when it is one on its own, else `bytes:\\xNN`."""
    return chr(token) if token < 128 else raw_label(bytes([token]))


class ByteCodec:
    """A byte-level model: its ids are the text's bytes."""

    vocab = 256
    ends: frozenset[int] = frozenset()  # every id is text: generation ends at max_tokens or a stop string

    def encode(self, text: bytes) -> list[int]:
        return list(text)

    def scored(self, text: bytes) -> tuple[list[int], int]:
        """The ids of `text` and how many bytes a model predicts of them (all but the first)."""
        return list(text), max(0, len(text) - 1)

    def piece(self, token: int) -> bytes:
        return bytes([token])

    def label(self, token: int) -> str:
        return byte_label(token)


BYTES = ByteCodec()


class TokenCodec:
    """A model over a tokenizer's ids. Each id's bytes are read once: for a byte-level BPE exactly, from its token
    string; for another tokenizer, from decoding the id alone. Added (special) tokens stand for no text, and a
    model that emits one has ended its text (`ends`): an end of document (a trained BPE's `<|endoftext|>`, between
    documents in the shards), an end of turn (`<|im_end|>`, `<|eot_id|>`) or the start of another one. Generation
    stops there with finish_reason "stop", as transformers' `generate` stops at `eos_token_id` and OpenAI's API at
    the end of the assistant's turn."""

    def __init__(self, tokenizer: Any) -> None:
        from tokenizers import decoders

        from training.tokenizer import byte_level_table, id_count

        self.tokenizer = tokenizer
        self.vocab = id_count(tokenizer)
        added = tokenizer.get_added_tokens_decoder()
        special = {t.content for t in added.values() if t.special}
        self.ends = frozenset(i for i, t in added.items() if t.special)
        self.special_ids = frozenset(i for i, t in added.items() if t.content in special)
        byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        table = byte_level_table() if byte_level else {}
        fallback = bool(getattr(tokenizer.model, "byte_fallback", False))
        self.pieces: list[bytes] = []
        byte_ids: list[int] = []  # SentencePiece's byte-fallback ids
        for i in range(self.vocab):
            token = tokenizer.id_to_token(i)
            if token is None or token in special:
                self.pieces.append(b"")
            elif byte_level and all(c in table for c in token):
                self.pieces.append(bytes(table[c] for c in token))
            elif fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                self.pieces.append(bytes([int(token[3:5], 16)]))  # SentencePiece's byte fallback: one raw byte
                byte_ids.append(i)
            else:
                self.pieces.append(_decoded(tokenizer, i))
        # a byte-fallback id whose byte is also a token of its own (`<0x61>` and `a`) reads by its name, so the two
        # are told apart in `top_logprobs` (a dict by label)
        fallback_of = set(byte_ids)
        own = {p for i, p in enumerate(self.pieces) if p and i not in fallback_of and i not in self.special_ids}
        self.named_ids = self.special_ids | {i for i in byte_ids if self.pieces[i] in own}

    def encode(self, text: bytes) -> list[int]:
        return self.scored(text)[0]

    def scored(self, text: bytes) -> tuple[list[int], int]:
        """The ids of `text` and the UTF-8 bytes every id but the first covers.

        Raises:
            ValueError: the text is not UTF-8 (a tokenizer reads characters).
        """
        from training.tokenizer import predicted

        try:
            return predicted(self.tokenizer, text)
        except UnicodeDecodeError as e:
            why = f"the text is not UTF-8 (byte {e.start}): this model's tokenizer reads characters"
            raise ValueError(why) from None

    def piece(self, token: int) -> bytes:
        return self.pieces[token] if 0 <= token < len(self.pieces) else b""

    def spans(self, text: bytes) -> tuple[list[str], list[int]]:
        """The labels of `text`'s ids (those `encode` gives) and the character each starts at in `text`, from the
        tokenizer's own offsets: a label can be longer than what it covers (Metaspace's first `▁the` is ` the`, the
        text `the`), so offsets counted by labels ran a character ahead from the second token on."""
        enc = self.tokenizer.encode(text.decode("utf-8"), add_special_tokens=False)
        return [self.label(i) for i in enc.ids], [start for start, _ in enc.offsets]

    def label(self, token: int) -> str:
        """The id's text when its bytes are whole characters, else its bytes as `bytes:\\xNN...` (OpenAI's form); a
        special token, which stands for no text, and a byte-fallback id whose byte has a token of its own, by its
        own name (`</s>`, `<0x61>`), so that no two read the same in `top_logprobs`."""
        if token in self.named_ids:
            return str(self.tokenizer.id_to_token(token))
        raw = self.piece(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw_label(raw)


def _decoded(tokenizer: Any, token: int) -> bytes:
    """The UTF-8 bytes `token` adds to a text it does not start. A decoder treats a text's first token as its start
    (Metaspace and a Strip decoder drop its leading space, WordPiece keeps its `##`), so an id decoded alone can lose
    the space it stands for: decoded after a copy of itself, with that copy's own text cut off, it keeps it."""
    alone = tokenizer.decode([token], skip_special_tokens=False)
    twice = tokenizer.decode([token, token], skip_special_tokens=False)
    return (twice[len(alone) :] if twice.startswith(alone) and len(twice) > len(alone) else alone).encode("utf-8")


def codec_for(tokenizer: Any) -> ByteCodec | TokenCodec:
    """The codec of a model version: its tokenizer's, or bytes when it carries none."""
    return BYTES if tokenizer is None else TokenCodec(tokenizer)
