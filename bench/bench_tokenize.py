"""Tokenizer benchmark on the default corpus (the interpreter's standard-library .py files, ~4.7 MB):
- training a byte-level BPE (training.tokenizer.train_bpe) and its bytes per token;
- training.tokenizer.encode_records, the encoding the data stage is to call per chunk (ids stored as uint16),
  vs the `tokenizers` library's own batch encode of the same texts (target >= 0.5x), and vs its offset-free
  encode_batch_fast;
- the data stage itself (training.data.build_shards of the same corpus, 1 and 2 workers, fresh outputs) with the
  tokenizer vs without: what tokenizing adds, as throughput, vs the library's batch encode (target >= 0.5x);
- decoding stored ids back to the exact text.
Every figure is the best of --repeats alternating runs. Run: .venv/bin/python bench/bench_tokenize.py
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training import tokenizer as tk


def _best(fns: list, repeats: int) -> list[float]:
    """Seconds per call of each of `fns`, timed alternately so that a change in the machine's load hits all."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [min(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (the best is kept)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args()

    texts = [f.read_bytes() for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))]
    texts = [t for t in texts if t]
    mb = sum(map(len, texts)) / 1e6
    (train_s,) = _best([lambda: tk.train_bpe(texts, args.vocab_size)], args.repeats)
    tok = tk.train_bpe(texts, args.vocab_size)
    strings = [t.decode("utf-8") for t in texts]
    ours, batch, fast = _best(
        [
            lambda: tk.encode_records(tok, texts),
            lambda: tok.encode_batch(strings, add_special_tokens=False),
            lambda: tok.encode_batch_fast(strings, add_special_tokens=False),
        ],
        args.repeats,
    )
    stored = tk.encode_records(tok, texts)
    (decode_s,) = _best([lambda: [tk.decode_ids(tok, s) for s in stored]], args.repeats)
    assert [tk.decode_ids(tok, s) for s in stored] == texts, "decode is not the inverse of encode"
    tokens = sum(len(s) // 2 for s in stored)
    print(f"corpus: {len(texts)} files, {mb:.2f} MB; BPE vocab {args.vocab_size}: {mb * 1e6 / tokens:.2f} bytes/token")
    print(f"train_bpe: {train_s:.2f} s ({mb / train_s:.1f} MB/s)")
    print(f"encode_records: {ours:.3f} s ({mb / ours:.1f} MB/s, {tokens / ours / 1e6:.2f} M tokens/s)")
    print(f"  vs tokenizers encode_batch ({batch:.3f} s): {batch / ours:.2f}x (target >= 0.5x)")
    print(f"  vs tokenizers encode_batch_fast ({fast:.3f} s): {fast / ours:.2f}x")
    print(f"decode_ids, every record: {decode_s:.3f} s ({mb / decode_s:.1f} MB/s)")
    _data_stage(tok, batch, mb, args.repeats)


def _data_stage(tok, batch_s: float, mb: float, repeats: int) -> None:
    """build_shards of the stdlib corpus with and without the tokenizer, each into a fresh output (no cache hit)."""
    os.environ["SHARDLINE_HOME"] = tempfile.mkdtemp(prefix="bench-tokenize-")
    from training.data import build_shards
    from training.data.config import DataConfig

    def build(workers: int, tokenizer) -> None:
        out = tempfile.mkdtemp(prefix="out-", dir=os.environ["SHARDLINE_HOME"])
        build_shards(DataConfig(output=out, workers=workers, chunk_bytes=1 << 20, reuse_unchanged=False), tokenizer)

    build(1, None)  # imports and Great Expectations' first context outside the timings
    for workers in (1, 2):
        plain, tokenized = _best([lambda w=workers: build(w, None), lambda w=workers: build(w, tok)], repeats)
        added = tokenized - plain
        print(
            f"data stage, {workers} worker(s), 1 MB chunks: {plain:.2f} s text only, {tokenized:.2f} s tokenized; "
            f"tokenizing adds {added:.2f} s = {mb / added:.1f} MB/s, {batch_s / added:.2f}x encode_batch"
        )


if __name__ == "__main__":
    main()
