"""Loader over tokenized shards vs what training consumes (issue 16: the loader delivers at least 10x).

Builds the stdlib corpus (~4.7 MB) into a tokenized shard set with a byte-level BPE of --vocab-size trained on its
training split (training.data.tokenized.build_tokenized), then measures, in one run:
- the loader: tokens/s of train_batches(token_dtype=...) for one rank, one DataLoader worker (as each training
  rank runs it), micro batches of the demo config (8 x 128);
- training: tokens/s of one forward + backward + AdamW step of the demo-size GPT (4 layers, d_model 128) over the
  BPE's ids on one torch thread, a rank's share of the 2-core machine.
Run: .venv/bin/python bench/bench_token_loader.py [--batches 400] [--vocab-size 4096]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=400, help="micro batches the loader delivers")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps (after 3 warm-up steps)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args()

    os.environ["SHARDLINE_HOME"] = tempfile.mkdtemp(prefix="bench-token-loader-")
    import torch

    from training.config import TrainConfig
    from training.data.config import DataConfig
    from training.data.loader import train_batches
    from training.data.tokenized import build_tokenized
    from training.model import GPT
    from training.tokenizer import TokenizerConfig

    built = build_tokenized(DataConfig(), TokenizerConfig(kind="train", vocab_size=args.vocab_size))
    shards = built.shards
    cfg = TrainConfig(seq_len=128, micro_batch=8, n_layer=4, n_head=4, d_model=128, steps=args.batches)
    tokens_per_batch = cfg.micro_batch * cfg.seq_len

    t0 = time.perf_counter()
    n = sum(1 for _ in train_batches(shards.train_shards, 0, 1, cfg, num_workers=1, token_dtype=shards.token_dtype))
    loader_tps = n * tokens_per_batch / (time.perf_counter() - t0)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(cfg.seq_len, cfg.n_layer, cfg.n_head, cfg.d_model, vocab=shards.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stream = train_batches(shards.train_shards, 0, 1, cfg, num_workers=0, token_dtype=shards.token_dtype)
    batches = [next(stream) for _ in range(args.steps + 3)]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for x, y in batches[:3]:
        step(x, y)
    t0 = time.perf_counter()
    for x, y in batches[3:]:
        step(x, y)
    train_tps = args.steps * tokens_per_batch / (time.perf_counter() - t0)

    print(f"tokenized set {shards.dataset_digest}: vocab {shards.vocab_size}, ids {shards.token_dtype}")
    print(f"loader, 1 rank, 1 DataLoader worker: {loader_tps:,.0f} tokens/s ({n} batches of {tokens_per_batch})")
    print(f"training, demo-size GPT, 1 torch thread: {train_tps:,.0f} tokens/s")
    print(f"loader / training: {loader_tps / train_tps:.1f}x (target >= 10x)")


if __name__ == "__main__":
    main()
