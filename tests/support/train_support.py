"""Helpers of the training tests: a tiny shard set, plug-in models, a rank killed mid-run (no fakes).

Ray workers import this module by name (`support.train_support:...` in train.model_factory), so the tests put
the tests directory (TESTS, the parent of the `support` package) on the workers' PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import torch
from torch import nn

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
RECORD_DIR_ENV = "SHARDLINE_TEST_RECORD_DIR"


def corpus(n_bytes: int = 60_000) -> list[bytes]:
    """Real text: the start of the interpreter's standard-library sources, ~2 KB records."""
    out, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_bytes()[:2048]
        out.append(text)
        total += len(text)
        if total >= n_bytes:
            break
    return out


def make_shards(root: Path, n_train: int = 4, n_val: int = 1, n_bytes: int = 60_000) -> tuple[list[str], list[str]]:
    """Write WebDataset shards of `.txt` records with webdataset.ShardWriter; return (train, val) shard paths."""
    import webdataset as wds

    records = corpus(n_bytes)
    val, train = records[: max(1, len(records) // 10)], records[max(1, len(records) // 10) :]
    root.mkdir(parents=True, exist_ok=True)

    def write(prefix: str, recs: list[bytes], shards: int) -> list[str]:
        per = max(1, -(-len(recs) // shards))
        with wds.ShardWriter(str(root / f"{prefix}-%06d.tar"), maxcount=per, verbose=0) as sink:
            for i, rec in enumerate(recs):
                sink.write({"__key__": f"{prefix}{i:05d}", "txt": rec})
        return sorted(str(p) for p in root.glob(f"{prefix}-*.tar"))

    return write("train", train, n_train), write("val", val, n_val)


def shard_set(root: Path, **kw: int):
    """A ShardSet over make_shards' files, as the data stage would hand it to training."""
    from training.data import ShardSet

    train, val = make_shards(root, **kw)
    return ShardSet(
        dataset_digest="0" * 32,
        uri=str(root),
        manifest_uri=str(root / "manifest.json"),
        train_shards=train,
        val_shards=val,
        num_train=len(train),
        num_val=len(val),
        total_bytes=sum(os.path.getsize(p) for p in train + val),
        cache_hit=False,
        data_run_id="",
    )


def ray_runtime_env(**env: str) -> dict:
    """Runtime env that lets Ray workers import this module. The repository comes right after the tests folder:
    tests/flows (no __init__) would otherwise pass for the `flows` package."""
    path = os.pathsep.join(filter(None, [str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]))
    return {"env_vars": {"PYTHONPATH": path, **env}}


def report_worker_env() -> None:
    """A Ray Train loop that reports the network variables its worker sees (tests/integration/test_network_env_ray).

    Here, not in the test module: workers import it by module name, and only tests/ is on their PYTHONPATH."""
    import tempfile

    import ray.train

    seen = {
        k: os.environ.get(k, "<unset>")
        for k in ("NCCL_IB_DISABLE", "NCCL_NET", "UCX_TLS", "NCCL_SOCKET_IFNAME", "SHARDLINE_PROBE")
    }
    with tempfile.TemporaryDirectory() as tmp:  # Train V2 keeps only metrics reported with a checkpoint
        ray.train.report(seen, checkpoint=ray.train.Checkpoint.from_directory(tmp))


# ------------------------------------------------------------------------------------------ plug-in models


# A transformers Llama small enough for CPU tests (train.hf_config): ~40k parameters, 2 decoder layers.
TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
}


class ByteGRU(nn.Module):
    """A byte-level GRU: causal, but torch.export specialises its sequence length to the example's, so it is
    served eagerly (training.servable)."""

    def __init__(self, d: int, vocab: int = 256) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(idx))
        return self.head(out)


def build_byte_gru(cfg) -> nn.Module:
    return ByteGRU(cfg.d_model, cfg.vocab_size or 256)  # a factory reads train.vocab_size: a tokenizer's ids


def reversed_blocks(records, seq_len: int, batch_size: int):
    """A different batch format: each record's bytes reversed, then cut like the default byte_blocks."""
    from training.data.loader import byte_blocks

    return byte_blocks((bytes(reversed(r)) for r in records), seq_len, batch_size)


def recording_gpt(cfg) -> nn.Module:
    """The default GPT, but first record this worker's rank, pid and Ray node id under $SHARDLINE_TEST_RECORD_DIR."""
    from training.model import build_gpt

    out = os.environ.get(RECORD_DIR_ENV)
    if out:
        node = ""
        try:
            import ray

            node = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - not in Ray
            pass
        rank = int(os.environ.get("RANK", "0"))
        rec = {"rank": rank, "pid": os.getpid(), "node_id": node}
        Path(out, f"rank{rank}-pid{os.getpid()}.json").write_text(json.dumps(rec))
    return build_gpt(cfg)


def worker_records(directory: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("rank*-pid*.json"))]


def train_and_kill_rank(cfg, shards, uri: str, run_id: str, name: str, records: Path, at_step: int, budget_s=300):
    """run_training in a thread; SIGKILL rank 1 once rank 0 has logged step `at_step` (read from MLflow).

    Returns (the run's TrainResult, the last logged step the kill saw; 0 if the run ended or stalled first).
    """
    import signal
    import threading
    import time

    from mlflow import MlflowClient

    from training.trainer import run_training

    client = MlflowClient(uri)
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=run_training(cfg, shards, uri, run_id, name)))
    thread.start()
    killed_at = 0
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline and thread.is_alive():
        steps = [m.step for m in client.get_metric_history(run_id, "loss")]
        if steps and max(steps) >= at_step:
            killed_at = max(steps)
            victim = next(r for r in worker_records(records) if r["rank"] == 1)
            os.kill(victim["pid"], signal.SIGKILL)
            break
        time.sleep(0.1)
    thread.join(timeout=budget_s)
    return outcome.get("result"), killed_at
