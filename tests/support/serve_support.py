"""Small, honest byte-level models for serving tests: bigram tables logged and registered as the validation stage
does (pt2, seq_len metadata), plus test model factories of known quality, speed and failure."""

from __future__ import annotations

import math
import sysconfig
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from deployments.registry import apply_promotion, decide_promotion, read_aliases, register_version
from infra.names import TAG_TRAIN_RUN_ID

NAME = "tiny-bytes"
SEQ_LEN = 32


def corpus() -> tuple[list[bytes], list[bytes]]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:80]
    texts = [f.read_bytes()[:4096] for f in files]
    return texts[40:], texts[:40]  # (fit, held out)


def bigram_logits(texts: list[bytes], smoothing: float):
    """log P(next | current) with add-`smoothing` counts: a small, honest byte-level language model."""
    import torch

    counts = torch.full((256, 256), smoothing)
    pairs = Counter((a, b) for t in texts for a, b in zip(t, t[1:], strict=False))
    for (a, b), c in pairs.items():
        counts[a, b] += c
    return torch.log(counts / counts.sum(dim=1, keepdim=True))


def log_model(
    table, run_name: str, exp: str, client, behaviour: str = "plain", chat_template: str = ""
) -> tuple[str, str]:
    """Log an embedding+linear model (logits [B, T, 256]) the way the validation stage does; return
    (training run id, model URI). `chat_template`: the template its tokenizer carries (metadata["chat_template"]).

    behaviour: "plain"; "slow" (the same logits after 200 extra 256x256 matmuls per position: several times the
    plain model's latency even on a quiet machine); "erroring"
    (non-finite logits whenever the input holds a byte >= 120, e.g. 'x', 'y', '{': on almost any real text but
    not on the replica's warm-up, so the replica starts and then fails live requests)."""
    import mlflow
    import numpy as np
    import torch
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    from training.served_forms import mlflow_pytorch

    class ByteModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(256, 256)
            self.head = torch.nn.Linear(256, 256)

        def forward(self, x):
            h = self.emb(x)
            if behaviour == "slow":
                w = torch.eye(256) * 1.0
                for _ in range(200):
                    h = h @ w
            out = self.head(h)
            if behaviour == "erroring":
                out = out + torch.where(x >= 120, float("nan"), 0.0).unsqueeze(-1)
            return out

    model = ByteModel()
    with torch.no_grad():
        model.emb.weight.copy_(table)
        model.head.weight.copy_(torch.eye(256))
        model.head.bias.zero_()
    signature = ModelSignature(
        inputs=Schema([TensorSpec(np.dtype("int64"), (-1, -1))]),
        outputs=Schema([TensorSpec(np.dtype("float32"), (-1, -1, 256))]),
    )
    train_run = client.create_run(exp, run_name=f"train-{run_name}").info.run_id
    with mlflow.start_run(experiment_id=exp, run_name=f"validate-{run_name}"):
        info = mlflow_pytorch().log_model(
            model,
            name="model",
            signature=signature,
            input_example=np.zeros((2, SEQ_LEN), dtype=np.int64),
            serialization_format="pt2",
            metadata={"seq_len": SEQ_LEN, **({"chat_template": chat_template} if chat_template else {})},
            pip_requirements=["torch"],
        )
    return train_run, info.model_uri


def register(client, train_run: str, model_uri: str, name: str = NAME):
    version = register_version(client, name, model_uri, train_run, {TAG_TRAIN_RUN_ID: train_run})
    return apply_promotion(client, decide_promotion(name, version, read_aliases(client, name)))


def heldout_bpb(table, texts: list[bytes]) -> float:
    import torch

    bits = n = 0.0
    for t in texts:
        x, y = torch.tensor(list(t[:-1])), torch.tensor(list(t[1:]))
        bits -= float(torch.log_softmax(table[x], -1)[torch.arange(len(y)), y].sum()) / math.log(2)
        n += len(y)
    return bits / n


@contextmanager
def serving_world(home: Path, experiment: str, tables: dict, names: tuple[str, ...] = (NAME,)) -> Iterator[dict]:
    """A registry under `home` where each of `names` has tables["weak"] as its first champion (v1), a local Ray of
    this process's own and a Serve config on a free port; afterwards the models' applications are removed, Ray is
    shut down and $SHARDLINE_HOME is put back.

    Yields:
        {"uri", "exp", "client", "tables", "heldout", "serve", "texts"}.
    """
    import os

    import ray

    from deployments import endpoint
    from deployments.config import ServeConfig
    from deployments.registry import client_for
    from infra.cluster import free_port, teardown
    from infra.tracking import setup_tracking

    old_home = os.environ.get("SHARDLINE_HOME")
    os.environ["SHARDLINE_HOME"] = str(home)
    uri = f"sqlite:///{home / 'mlflow.db'}"
    exp = setup_tracking(uri, experiment)
    client = client_for(uri)
    _, heldout = corpus()
    for name in names:
        assert register(client, *log_model(tables["weak"], f"{name}-weak", exp, client), name).decision == (
            "first-champion"
        )
    teardown(None)  # a driver an earlier module left connected, its Serve handles stopped first
    ray.init(address="local", num_cpus=4, include_dashboard=False)  # never join a cluster `ray start` left running
    serve = ServeConfig(port=free_port())
    try:
        yield {
            "uri": uri,
            "exp": exp,
            "client": client,
            "tables": tables,
            "heldout": heldout,
            "serve": serve,
            "texts": [t.decode("utf-8", "ignore")[:600] for t in heldout],
        }
    finally:
        for name in names:
            endpoint.remove(serve, name)
        teardown(None)  # this process's Serve handles first: their threads would connect the process again
        if old_home is None:
            os.environ.pop("SHARDLINE_HOME", None)
        else:
            os.environ["SHARDLINE_HOME"] = old_home
