"""training/tokenizer.py with the real `tokenizers` library: training is deterministic and cached by digest and
settings, ids round-trip to the exact UTF-8 text, and bad files or sizes are one-line errors."""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from training import tokenizer as tk
from training.bpb import text_bits, token_bits, token_windows

TEXTS = [
    b"def add(a, b):\n    return a + b\n",
    "caf\u00e9 na\u00efve \u00fcber \u2014 \U0001f680 \u65e5\u672c\u8a9e\n".encode(),
    b"class Queue:\n    def put(self, item):\n        self.items.append(item)\n",
]


@pytest.fixture(scope="module")
def corpus() -> list[bytes]:
    """A slice of real text: the standard library's first modules."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:12]
    return [f.read_bytes() for f in files if f.stat().st_size] + TEXTS


@pytest.fixture(scope="module")
def bpe(corpus: list[bytes]) -> tk.Tokenizer:
    return tk.train_bpe(corpus, vocab_size=600)


def test_training_twice_on_the_same_texts_gives_the_same_tokenizer(corpus: list[bytes], bpe: tk.Tokenizer) -> None:
    again = tk.train_bpe(corpus, vocab_size=600)
    assert again.to_str() == bpe.to_str()
    assert tk.fingerprint(again) == tk.fingerprint(bpe)
    assert bpe.get_vocab_size() == 600
    assert bpe.token_to_id(tk.END_OF_TEXT) == 0
    assert tk.fingerprint(tk.train_bpe(corpus, vocab_size=500)) != tk.fingerprint(bpe)


def test_ids_round_trip_to_the_exact_bytes_and_compress(corpus: list[bytes], bpe: tk.Tokenizer) -> None:
    stored = tk.encode_records(bpe, corpus)
    assert [tk.decode_ids(bpe, s) for s in stored] == corpus  # non-ASCII and emoji included
    ids = np.frombuffer(stored[0], dtype="<u2")
    assert len(stored[0]) == 2 * len(ids)
    assert int(ids.max()) < 600
    assert sum(len(s) // 2 for s in stored) < sum(map(len, corpus)) / 2  # merges learned: > 2 bytes per token


def test_id_dtype_widens_past_65536_ids() -> None:
    assert tk.id_dtype(4096) == np.dtype("<u2")
    assert tk.id_dtype(65536) == np.dtype("<u2")
    assert tk.id_dtype(65537) == np.dtype("<u4")


def test_a_saved_tokenizer_loads_with_the_same_fingerprint(tmp_path: Path, bpe: tk.Tokenizer) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(bpe.to_str(), encoding="utf-8")
    assert tk.fingerprint(tk.load(str(path))) == tk.fingerprint(bpe)


@pytest.mark.parametrize(
    ("content", "expected"),
    [(None, "No such file"), (b'{"model": ', "not a tokenizer.json"), (b"\xff\xfe", "not a tokenizer.json")],
    ids=["missing", "truncated-json", "not-utf8"],
)
def test_a_bad_tokenizer_file_is_one_line_naming_it(tmp_path: Path, content: bytes | None, expected: str) -> None:
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(tk.TokenizerError) as err:
        tk.load(str(path))
    assert str(path) in str(err.value) and expected in str(err.value)
    assert "\n" not in str(err.value)


def test_a_vocabulary_larger_than_the_embedding_is_refused_with_both_sizes(bpe: tk.Tokenizer) -> None:
    with pytest.raises(tk.TokenizerError, match=r"600 ids but the built-in GPT embeds 256"):
        tk.check_fits(bpe, 256, "the built-in GPT")
    tk.check_fits(bpe, 600, "the built-in GPT")  # exactly enough rows


def test_a_tokenizer_with_unused_ids_counts_its_largest_id_not_its_tokens() -> None:
    """A tokenizer.json may number its tokens with holes: its embedding needs the largest id + 1 rows, and its
    stored ids that range (uint32 past 65,535), not the token count (6 here)."""
    from tokenizers import models, pre_tokenizers

    for top, dtype in ((300, "<u2"), (70000, "<u4")):
        tok = tk.Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "big": top}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        assert tok.get_vocab_size(with_added_tokens=True) == 4 and tk.id_count(tok) == top + 1
        assert tk.shard_layout(tok)["vocab_size"] == top + 1 and tk.shard_layout(tok)["token_dtype"] == dtype
        stored = tk.encode_records(tok, [b"hello big world"])[0]
        assert np.frombuffer(stored, dtype=dtype).tolist() == [1, top, 2]
        assert tk.decode_ids(tok, stored) == b"hello big world"
        with pytest.raises(tk.TokenizerError, match=rf"has {top + 1} ids but a 6-row model embeds 6"):
            tk.check_fits(tok, 6, "a 6-row model")


def test_a_trained_tokenizer_is_cached_by_digest_and_settings(tmp_path: Path, corpus: list[bytes]) -> None:
    reads: list[str] = []

    def texts() -> Iterator[bytes]:
        reads.append("read")
        return iter(corpus)

    cfg = tk.TokenizerConfig(kind="train", vocab_size=600)
    first, path, hit = tk.trained(cfg, "digest-a", texts, tmp_path)
    assert (hit, len(reads), path.is_file()) == (False, 1, True)
    again, path_again, hit = tk.trained(cfg, "digest-a", texts, tmp_path)
    assert (hit, len(reads), path_again) == (True, 1, path)  # the training split is not read again
    assert tk.fingerprint(again) == tk.fingerprint(first)
    _, other_digest, hit = tk.trained(cfg, "digest-b", texts, tmp_path)
    _, other_size, hit_size = tk.trained(cfg.model_copy(update={"vocab_size": 500}), "digest-a", texts, tmp_path)
    assert (hit, hit_size, len(reads)) == (False, False, 3)
    assert len({path.parent, other_digest.parent, other_size.parent}) == 3
    assert not list(tmp_path.rglob(".tokenizer.json.tmp*"))


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"kind": "file"}, "needs tokenizer.path"),
        ({"kind": "bytes", "path": "tok.json"}, "read only with tokenizer.kind='file'"),
        ({"kind": "train", "vocab_size": 256}, "greater than or equal to 257"),
        ({"kind": "wordpiece"}, "'bytes', 'file' or 'train'"),
    ],
)
def test_a_tokenizer_section_that_cannot_work_is_refused(fields: dict[str, object], expected: str) -> None:
    with pytest.raises(ValidationError, match=expected):
        tk.TokenizerConfig.model_validate(fields)


def _uniform(vocab: int):
    """A model that knows nothing: equal logits for every id, so each prediction costs log2(vocab) bits."""
    return lambda idx: torch.zeros(*idx.shape, vocab)


def test_token_bits_count_every_token_but_the_first_over_the_bytes_they_cover(bpe: tk.Tokenizer) -> None:
    text = TEXTS[1] * 3  # multi-byte characters, some split across tokens
    ids, covered = tk.predicted(bpe, text)
    first = bpe.id_to_token(ids[0])
    assert covered == len(text) - len(first) and 0 < len(first) < len(text)
    bits, nbytes = token_bits(_uniform(600), ids, covered, seq_len=8, batch_size=3)
    assert nbytes == covered
    assert bits == pytest.approx((len(ids) - 1) * math.log2(600), rel=1e-6)
    byte_bits, byte_count = text_bits(_uniform(256), text, seq_len=8)
    assert byte_bits / byte_count == pytest.approx(8.0)  # the byte model's scale: same text, same rule
    code_ids, code_bytes = tk.predicted(bpe, TEXTS[2] * 3)  # Python, which the BPE learned: ~3 bytes per token
    code_bits, _ = token_bits(_uniform(600), code_ids, code_bytes, seq_len=8)
    assert code_bits / code_bytes < 8.0  # a blind 600-id model pays fewer bits per byte than a blind byte model


def test_a_prefix_space_the_pre_tokenizer_adds_is_not_a_byte_of_the_text(bpe: tk.Tokenizer) -> None:
    """A tokenizer.json whose ByteLevel pre-tokenizer adds a prefix space (GPT-2's and RoBERTa's option): its first
    token holds a byte the text lacks, and the bytes the later ones cover are the text's but the first word's."""
    from tokenizers import pre_tokenizers

    spaced = tk.Tokenizer.from_str(bpe.to_str())
    spaced.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    text = b"hello world"
    ids, covered = tk.predicted(spaced, text)
    assert spaced.encode(text.decode(), add_special_tokens=False).tokens[0].startswith("\u0120")  # the added space
    first_word = len(spaced.decode([ids[0]]).strip().encode())
    assert covered == len(text) - first_word


def test_token_windows_overlap_by_one_and_cover_every_token() -> None:
    ids = list(range(20))
    got = [w.tolist() for w in token_windows(ids, 8)]
    assert got == [list(range(0, 9)), list(range(8, 17)), list(range(16, 20))]
    assert sum(len(w) - 1 for w in got) == len(ids) - 1
    assert token_windows([5], 8) == []


def test_a_tokenizer_that_is_not_byte_level_counts_bytes_from_offsets() -> None:
    from tokenizers import models, pre_tokenizers

    words = tk.Tokenizer(models.WordLevel({"[UNK]": 0, "h\u00e9llo": 1, "world": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    ids, covered = tk.predicted(words, "h\u00e9llo  world".encode())
    assert (ids, covered) == ([1, 2], len(b"world"))  # the first word, its accent and both spaces are not predicted
