"""The data stage with a tokenizer (build_shards, build_tokenized): every record carries its token ids beside its
text, a trained BPE learns the training split only and is cached, the set is byte-identical
for 1, 2 or 3 workers, and the tokenizer is part of the set's layout, digest and listing-index key."""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from support.data_helpers import config, make_corpus

from training import tokenizer as tk
from training.config import TrainConfig
from training.data import build_shards
from training.data.loader import iter_texts, token_blocks, train_batches
from training.data.records import Record
from training.data.shards import MANIFEST_NAME, Manifest, with_ids
from training.data.tokenized import build_tokenized
from training.model import GPT

SMALL_CHUNKS = {"chunk_bytes": 2048}  # 20-odd chunks of the 60-file corpus: every worker count splits the work


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = make_corpus(tmp_path / "c", n=60)
    text = "caf\u00e9 \u2014 \U0001f680 \u65e5\u672c\u8a9e fox\n" * 3
    (root / "a" / "unicode.txt").write_text(text, encoding="utf-8")
    return root


def _bpe(corpus: Path, vocab_size: int = 320) -> tk.Tokenizer:
    return tk.train_bpe((p.read_bytes() for p in sorted(corpus.rglob("*.txt"))), vocab_size)


def _samples(shard: str) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(shard) as tar:
        for member in tar:
            key, ext = member.name.split(".", 1)
            fh = tar.extractfile(member)
            assert fh is not None
            out.setdefault(key, {})[ext] = fh.read()
    return out


def _layout(uri: str) -> dict[str, object]:
    return Manifest.model_validate_json((Path(uri) / MANIFEST_NAME).read_bytes()).layout


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.name != "validation.json"}


def test_every_record_carries_ids_that_decode_to_its_text(tmp_path: Path, corpus: Path) -> None:
    tok = _bpe(corpus)
    shards = build_shards(config(corpus, tmp_path / "out"), tok)
    layout = _layout(shards.uri)
    assert layout["tokenizer_sha256"] == tk.fingerprint(tok)
    assert (layout["token_dtype"], layout["vocab_size"]) == ("<u2", 320)
    records = [s for uri in shards.train_shards + shards.val_shards for s in _samples(uri).values()]
    assert len(records) == 61
    for sample in records:
        assert list(sample) == ["ids", "json", "txt"]  # members in sorted order, as webdataset writes them
        assert tk.decode_ids(tok, sample["ids"]) == sample["txt"]
        assert len(np.frombuffer(sample["ids"], dtype="<u2")) < len(sample["txt"])
    assert any(b"\xf0\x9f\x9a\x80" in s["txt"] for s in records)  # the emoji record went through whole


def test_one_two_and_three_workers_write_the_same_tokenized_set(tmp_path: Path, corpus: Path) -> None:
    tok = _bpe(corpus)
    sets = {w: build_shards(config(corpus, tmp_path / f"out-{w}", workers=w, **SMALL_CHUNKS), tok) for w in (1, 2, 3)}
    assert sets[1].chunks >= 10
    for shards in sets.values():
        assert shards.dataset_digest == sets[1].dataset_digest
        assert _files(Path(shards.uri)) == _files(Path(sets[1].uri))


def test_the_tokenizer_is_part_of_the_digest_and_of_the_listing_key(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "out"
    text_only = build_shards(config(corpus, out))
    first = build_shards(config(corpus, out), _bpe(corpus, 320))
    other = build_shards(config(corpus, out), _bpe(corpus, 300))
    assert len({text_only.dataset_digest, first.dataset_digest, other.dataset_digest}) == 3
    assert not (first.cache_hit or other.cache_hit)
    again = build_shards(config(corpus, out), _bpe(corpus, 320))
    assert (again.cache_hit, again.dataset_digest) == (True, first.dataset_digest)
    assert "tokenizer_sha256" not in _layout(text_only.uri)  # text-only sets are unchanged


def test_records_are_encoded_in_bounded_batches_in_corpus_order(corpus: Path) -> None:
    tok = _bpe(corpus)
    texts = [p.read_bytes() for p in sorted(corpus.rglob("*.txt"))]
    batches: list[int] = []
    encode = tk.batch_encoder(tok.to_str())  # what a data-stage worker builds from the job's tokenizer JSON

    def counted(batch: list[bytes]) -> list[bytes]:
        batches.append(len(batch))
        return encode(batch)

    records = [Record(str(i), t, f"doc{i}") for i, t in enumerate(texts)]
    pairs = list(with_ids(records, counted, max_records=25))
    assert batches == [25, 25, 11]
    one_by_one = list(with_ids(records, counted, max_bytes=1))  # a batch closes once it holds max_bytes
    assert batches[3:] == [1] * 61 and [ids for _, ids in one_by_one] == [ids for _, ids in pairs]
    assert [r.data for r, _ in pairs] == texts
    assert [ids for _, ids in pairs] == tk.encode_records(tok, texts)


def test_a_trained_tokenizer_learns_the_training_split_only_and_is_cached(tmp_path: Path, corpus: Path) -> None:
    cfg, tok_cfg = config(corpus, tmp_path / "out"), tk.TokenizerConfig(kind="train", vocab_size=300)
    first = build_tokenized(cfg, tok_cfg)
    text = build_shards(cfg)
    assert (text.cache_hit, first.text_digest) == (True, text.dataset_digest)
    train_only = tk.train_bpe([data for _, data in iter_texts(text.train_shards)], 300)
    everything = tk.train_bpe([data for _, data in iter_texts(text.train_shards + text.val_shards)], 300)
    assert first.tokenizer_sha256 == tk.fingerprint(train_only) != tk.fingerprint(everything)
    shards = first.shards
    assert (shards.tokenizer_sha256, shards.token_dtype, shards.vocab_size) == (first.tokenizer_sha256, "<u2", 300)
    assert shards.dataset_digest != text.dataset_digest and not first.tokenizer_cache_hit
    again = build_tokenized(cfg, tok_cfg)
    assert (again.tokenizer_cache_hit, again.shards.cache_hit) == (True, True)
    assert (again.shards.dataset_digest, again.tokenizer_path) == (shards.dataset_digest, first.tokenizer_path)


def test_a_tokenizer_file_is_read_before_the_corpus_and_a_bad_one_publishes_nothing(
    tmp_path: Path, corpus: Path
) -> None:
    out = tmp_path / "out"
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": {"type": "Nope"}}', encoding="utf-8")
    with pytest.raises(tk.TokenizerError, match=f"tokenizer.path={bad}: not a tokenizer.json"):
        build_tokenized(config(corpus, out), tk.TokenizerConfig(kind="file", path=str(bad)))
    assert not out.exists()
    good = tmp_path / "good.json"
    good.write_text(_bpe(corpus).to_str(), encoding="utf-8")
    built = build_tokenized(config(corpus, out), tk.TokenizerConfig(kind="file", path=str(good)))
    assert built.shards.tokenizer_sha256 == built.tokenizer_sha256 == tk.fingerprint(_bpe(corpus))
    plain = build_tokenized(config(corpus, out), tk.TokenizerConfig())
    assert (plain.tokenizer_sha256, plain.shards.vocab_size) == ("", 0)
    assert plain.shards.dataset_digest == build_shards(config(corpus, tmp_path / "other")).dataset_digest


def test_token_blocks_cut_the_id_stream_into_shifted_pairs() -> None:
    records = [np.arange(i * 10, i * 10 + 10, dtype="<u4").tobytes() for i in range(5)]  # ids 0..49 in 5 records
    batches = list(token_blocks(records, seq_len=7, batch_size=3, dtype="<u4"))
    assert len(batches) == 2  # 50 ids make two blocks of 3 x 8
    x, y = batches[1]
    assert x.dtype == torch.int64 and x.shape == (3, 7)
    assert x[0].tolist() == list(range(24, 31)) and y[0].tolist() == list(range(25, 32))


def test_a_gpt_over_the_tokenizers_ids_learns_from_a_tokenized_set(tmp_path: Path, corpus: Path) -> None:
    built = build_tokenized(config(corpus, tmp_path / "out"), tk.TokenizerConfig(kind="train", vocab_size=300))
    shards = built.shards
    cfg = TrainConfig(seq_len=32, micro_batch=8, steps=40, seed=0)
    batches = list(train_batches(shards.train_shards, 0, 1, cfg, num_workers=0, token_dtype=shards.token_dtype))
    assert len(batches) == 40 and max(int(x.max()) for x, _ in batches) < shards.vocab_size
    assert any(int(x.max()) >= 256 for x, _ in batches)  # merged tokens, not bytes
    torch.manual_seed(0)
    model = GPT(seq_len=32, n_layer=1, n_head=2, d_model=32, vocab=shards.vocab_size)
    assert model.config()["vocab"] == 300
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0  # ~ln(300) untrained
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5


def test_a_tokenized_set_carries_its_tokenizer_and_is_not_trusted_with_another(tmp_path: Path, corpus: Path) -> None:
    from training.data import DataError
    from training.data.publish import load_shard_set

    tok = _bpe(corpus)
    shards = build_shards(config(corpus, tmp_path / "out"), tok)
    assert shards.tokenizer_uri == str(Path(shards.uri) / "tokenizer.json")
    carried = tk.load(shards.tokenizer_uri)
    assert tk.fingerprint(carried) == shards.tokenizer_sha256 and carried.encode("fox").ids == tok.encode("fox").ids
    assert load_shard_set(shards.uri).tokenizer_uri == shards.tokenizer_uri
    assert build_shards(config(corpus, tmp_path / "out")).tokenizer_uri == ""  # a text set has none

    Path(shards.tokenizer_uri).write_text(_bpe(corpus, 300).to_str(), encoding="utf-8")
    with pytest.raises(DataError, match="tokenizer.json is not the tokenizer the manifest names"):
        load_shard_set(shards.uri)
    rebuilt = build_shards(config(corpus, tmp_path / "out", reuse_unchanged=False), tok)  # republished whole
    assert not rebuilt.cache_hit and tk.fingerprint(tk.load(rebuilt.tokenizer_uri)) == tk.fingerprint(tok)
    Path(shards.tokenizer_uri).unlink()
    with pytest.raises(DataError, match="tokenizer.json missing"):
        load_shard_set(shards.uri)


def test_a_byte_model_and_a_bpe_model_are_scored_on_the_same_held_out_texts(tmp_path: Path, corpus: Path) -> None:
    import math

    from training.evaluate import held_out_bpb

    class Uniform(torch.nn.Module):  # a blind model: every id equally likely, so its bits are known exactly
        def __init__(self, vocab: int) -> None:
            super().__init__()
            self.vocab = vocab

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.zeros(*x.shape, self.vocab)

    shards = build_tokenized(config(corpus, tmp_path / "out"), tk.TokenizerConfig(kind="train", vocab_size=300)).shards
    tok = tk.load(shards.tokenizer_uri)
    texts = [text for _, text in iter_texts(shards.val_shards)]
    encoded = [tk.predicted(tok, text) for text in texts]
    tokens, covered = sum(max(0, len(ids) - 1) for ids, _ in encoded), sum(n for _, n in encoded)
    assert 0.8 * sum(len(t) - 1 for t in texts) < covered < sum(len(t) - 1 for t in texts)  # first tokens aside

    as_bytes = held_out_bpb(Uniform(256), shards.val_shards, shards.num_val, 32, 4, 0)
    as_tokens = held_out_bpb(Uniform(300), shards.val_shards, shards.num_val, 32, 4, 0, tokenizer=tok)
    assert as_bytes == pytest.approx(8.0)
    assert as_tokens == pytest.approx(math.log2(300) * tokens / covered, rel=1e-6)  # the same texts, per byte
    assert as_tokens < as_bytes  # ~3 bytes a token: a blind BPE guess costs fewer bits per byte than a blind byte


def test_a_tokenizer_that_gives_the_same_ids_gets_its_own_set_and_leaves_the_first(
    tmp_path: Path, corpus: Path
) -> None:
    """The ids are read back with the tokenizer a set carries: B's build must not take over A's set."""
    from training.data.publish import load_shard_set

    tok = _bpe(corpus)
    first = build_shards(config(corpus, tmp_path / "out"), tok)
    before = _files(Path(first.uri))
    other = tk.Tokenizer.from_str(tok.to_str())
    other.add_special_tokens(["<|never-seen|>"])  # one more id, never produced by this corpus: the same .ids
    second = build_shards(config(corpus, tmp_path / "out"), other)
    assert second.dataset_digest != first.dataset_digest and not second.cache_hit
    assert second.vocab_size == 321 and tk.fingerprint(tk.load(second.tokenizer_uri)) == tk.fingerprint(other)
    assert _files(Path(first.uri)) == before  # A's set, manifest and tokenizer untouched
    reloaded = load_shard_set(first.uri, verify="sha256")
    assert (reloaded.tokenizer_sha256, reloaded.vocab_size) == (tk.fingerprint(tok), 320)
    again = build_shards(config(corpus, tmp_path / "out"), tok)
    assert (again.cache_hit, again.dataset_digest, again.tokenizer_sha256) == (
        True,
        first.dataset_digest,
        tk.fingerprint(tok),
    )
    same_shards = {name: data for name, data in _files(Path(second.uri)).items() if name.endswith(".tar")}
    assert same_shards == {name: data for name, data in before.items() if name.endswith(".tar")}


def test_a_text_only_digest_is_unchanged_and_a_tokenizer_changes_it() -> None:
    from training.data.shards import ShardEntry, SplitEntry, dataset_digest

    splits = {
        split: SplitEntry(
            num_samples=n, shards=[ShardEntry(name=f"{split}-000000-000000.tar", samples=n, bytes=10240, sha256=c * 64)]
        )
        for split, n, c in (("train", 3, "a"), ("val", 1, "b"))
    }
    assert dataset_digest(splits) == "fdee484d0f1a528564b269b9b1391118"  # what every text set was named before
    assert dataset_digest(splits, "c" * 64) not in (dataset_digest(splits), dataset_digest(splits, "d" * 64))


def test_a_set_published_before_the_tokenizer_joined_the_digest_still_loads(tmp_path: Path, corpus: Path) -> None:
    import json
    import shutil

    from training.data.publish import load_shard_set
    from training.data.shards import dataset_digest

    shards = build_shards(config(corpus, tmp_path / "out"), _bpe(corpus))
    manifest = json.loads(Path(shards.manifest_uri).read_text())
    legacy = dataset_digest(Manifest.model_validate(manifest).splits)
    manifest["dataset_digest"] = legacy
    old = tmp_path / "out" / legacy
    shutil.copytree(shards.uri, old)
    (old / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert load_shard_set(str(old), verify="sha256").tokenizer_sha256 == shards.tokenizer_sha256
