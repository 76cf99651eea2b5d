"""Small corpora for the data-stage tests."""

from __future__ import annotations

import json
from pathlib import Path

from training.data.config import DataConfig


def make_corpus(root: Path, n: int = 60, prefix: str = "doc") -> Path:
    """n text files in two sub-directories, each a few hundred bytes of distinct text."""
    for i in range(n):
        sub = root / ("a" if i % 2 else "b")
        sub.mkdir(parents=True, exist_ok=True)
        body = "".join(f"{prefix} {i} line {j}: the quick brown fox {i * j}\n" for j in range(10 + i % 7))
        (sub / f"{prefix}{i:03d}.txt").write_text(body, encoding="utf-8")
    return root


def make_jsonl(path: Path, n: int = 40) -> Path:
    lines = [json.dumps({"id": f"r{i}", "body": f"record {i} " * (5 + i % 4)}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def config(source: Path | str, output: Path | str, **kw) -> DataConfig:
    base = {"val_fraction": 0.25, "split_tolerance": 0.2, "max_samples_per_shard": 8}
    return DataConfig(source=str(source), output=str(output), **{**base, **kw})
