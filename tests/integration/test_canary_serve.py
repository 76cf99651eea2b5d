"""The real canary: logged models, MLflow registry, Ray Serve over HTTP; one promotion, one rollback.

The tests share one registry and one Ray session and tell one story in file order: v1 (weak) is the first
champion, v2 (good) is promoted over it, v3 (bad) is rolled back, then a champion moved mid-canary is respected.
"""
from __future__ import annotations

import math
import os
import sysconfig
import time
from collections import Counter
from pathlib import Path

import pytest

from deployments.canary import run_canary
from deployments.config import CanaryConfig
from deployments.registry import (
    TAG_REJECTED, apply_promotion, client_for, decide_promotion, read_aliases, register_version,
)
from infra.tracking import TAG_TRAIN_RUN_ID, setup_tracking

NAME = "tiny-bytes"
SEQ_LEN = 32


def _corpus() -> tuple[list[bytes], list[bytes]]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:80]
    texts = [f.read_bytes()[:4096] for f in files]
    return texts[40:], texts[:40]  # (fit, held out)


def _bigram_logits(texts: list[bytes], smoothing: float):
    """log P(next | current) with add-`smoothing` counts: a small, honest byte-level language model."""
    import torch

    counts = torch.full((256, 256), smoothing)
    pairs = Counter((a, b) for t in texts for a, b in zip(t, t[1:]))
    for (a, b), c in pairs.items():
        counts[a, b] += c
    return torch.log(counts / counts.sum(dim=1, keepdim=True))


def _log_model(table, run_name: str, exp: str, client) -> tuple[str, str]:
    """Log an embedding+linear model (logits [B, T, 256]) the way the validation stage does; return
    (training run id, model URI)."""
    import mlflow
    import numpy as np
    import torch
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    class ByteModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(256, 256)
            self.head = torch.nn.Linear(256, 256)

        def forward(self, x):
            return self.head(self.emb(x))

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
        info = mlflow.pytorch.log_model(
            model, name="model", signature=signature, input_example=np.zeros((2, SEQ_LEN), dtype=np.int64),
            serialization_format="pt2", metadata={"seq_len": SEQ_LEN}, pip_requirements=["torch"],
        )
    return train_run, info.model_uri


def _register(client, train_run: str, model_uri: str):
    version = register_version(client, NAME, model_uri, train_run, {TAG_TRAIN_RUN_ID: train_run})
    return apply_promotion(client, decide_promotion(NAME, version, read_aliases(client, NAME)))


def _heldout_bpb(table, texts: list[bytes]) -> float:
    import torch

    bits = n = 0.0
    for t in texts:
        x, y = torch.tensor(list(t[:-1])), torch.tensor(list(t[1:]))
        bits -= float(torch.log_softmax(table[x], -1)[torch.arange(len(y)), y].sum()) / math.log(2)
        n += len(y)
    return bits / n


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One MLflow store with champion v1 (a weak model), one Ray session for every canary of this module."""
    import ray

    home = tmp_path_factory.mktemp("home")
    old_home = os.environ.get("SHARDLINE_HOME")
    os.environ["SHARDLINE_HOME"] = str(home)
    uri = f"sqlite:///{home / 'mlflow.db'}"
    exp = setup_tracking(uri, "canary-it")
    client = client_for(uri)
    fit, heldout = _corpus()
    tables = {
        "weak": _bigram_logits(fit, smoothing=50.0),  # nearly a unigram: the champion to beat
        "good": _bigram_logits(fit, smoothing=0.05),
    }
    tables["bad"] = -tables["good"]  # confidently wrong: far above 8 bits per byte
    first = _register(client, *_log_model(tables["weak"], "weak", exp, client))
    assert first.decision == "first-champion"
    ray.init(address="local", num_cpus=4, include_dashboard=False)  # never join a cluster `ray start` left running
    try:
        yield {"uri": uri, "exp": exp, "client": client, "tables": tables, "heldout": heldout}
    finally:
        ray.shutdown()
        if old_home is None:
            os.environ.pop("SHARDLINE_HOME", None)
        else:
            os.environ["SHARDLINE_HOME"] = old_home


CFG = CanaryConfig(steps=[10, 50, 100], requests_per_step=16, seed=3, max_request_bytes=1024)


def test_a_better_challenger_is_promoted_over_http(world):
    client, tables, heldout = world["client"], world["tables"], world["heldout"]
    promoted = _register(client, *_log_model(tables["good"], "good", world["exp"], client))
    assert (promoted.decision, promoted.version, promoted.champion_version) == ("challenger", "2", "1")

    t0 = time.perf_counter()
    result = run_canary(CFG, NAME, "1", "2", heldout, world["uri"])
    print(f"\npromote canary: {time.perf_counter() - t0:.1f}s", result.model_dump_json(indent=1))

    assert result.decision == "promoted", result.reason
    assert result.champion_version == "2" and result.final_challenger_percent == 100
    assert read_aliases(client, NAME) == {"champion": "2", "challenger": "2"}
    assert [s["percent"] for s in result.steps] == [10, 50, 100]
    assert all(s["requests"] == CFG.requests_per_step for s in result.steps)
    last = result.steps[-1]
    # at 100% every request went to the challenger and was shadow-scored by the champion
    assert last["challenger"]["n"] == last["paired"] == CFG.requests_per_step
    assert last["challenger"]["error_rate"] == 0.0 and last["champion"]["error_rate"] == 0.0
    # the served numbers are the models' real bits per byte on held-out text
    assert last["challenger"]["bpb"] < last["champion"]["bpb"] - 0.3
    assert _heldout_bpb(tables["good"], heldout) < _heldout_bpb(tables["weak"], heldout)
    assert 1.0 < last["challenger"]["bpb"] < 6.0


def test_a_worse_challenger_is_rolled_back_and_tagged(world):
    client, tables = world["client"], world["tables"]
    promoted = _register(client, *_log_model(tables["bad"], "bad", world["exp"], client))
    assert (promoted.version, promoted.champion_version) == ("3", "2")

    result = run_canary(CFG, NAME, "2", "3", world["heldout"], world["uri"])
    print(f"\nreject canary:", result.model_dump_json(indent=1))

    assert result.decision == "rejected"
    assert "bits/byte" in result.reason
    assert result.final_challenger_percent == 0  # the router sends everything to the champion again
    assert result.champion_version == "2"
    assert read_aliases(client, NAME)["champion"] == "2"
    assert client.get_model_version(NAME, "3").tags[TAG_REJECTED] == result.reason
    failed = result.steps[-1]
    assert failed["failures"] and failed["bpb_regression"] > CFG.max_bpb_regression
    assert failed["challenger"]["bpb"] > 8.0
    assert len(result.steps) < len(CFG.steps) or failed["percent"] == 100  # the ramp stopped at the failure


def test_the_router_weights_shadows_and_exposes_metrics(world):
    """The Serve app itself: seeded weights, shadow scoring, bad input, Prometheus metrics; on 127.0.0.1."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from deployments.serve_app import start_canary_app, stop_canary_app

    app = start_canary_app(NAME, "1", "1", world["uri"], seed=7, max_request_bytes=256)
    try:
        assert app.url.startswith("http://127.0.0.1:")
        text = world["heldout"][0]
        with httpx.Client(timeout=60) as http:
            def roles(n):
                return [http.post(app.url, content=text).json()["served"]["role"] for _ in range(n)]

            assert app.challenger_percent() == 0 and set(roles(4)) == {"champion"}
            assert app.set_challenger_percent(50) == 50
            first = roles(8)
            app.set_challenger_percent(50)  # routing restarts from the seed: same sequence
            assert roles(8) == first and set(first) == {"champion", "challenger"}
            app.set_challenger_percent(100)
            answer = http.post(app.url, content=text).json()
            assert answer["served"]["role"] == "challenger" and answer["shadow"]["role"] == "champion"
            # the same model on the same (truncated) text: shadow and served agree to the bit
            assert answer["served"]["bytes"] == 255
            assert answer["served"]["bpb"] == pytest.approx(answer["shadow"]["bpb"], rel=1e-6)
            assert http.post(app.url, content=b"").status_code == 400
            metrics = http.get(app.metrics_url)
        with pytest.raises(Exception, match="challenger percent must be in"):
            app.set_challenger_percent(101)
        assert app.challenger_percent() == 100

        assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(metrics.text) for s in fam.samples}
        n_challenger = first.count("challenger") * 2 + 1
        assert samples[("shardline_canary_challenger_percent", ())] == 100
        assert samples[("shardline_canary_requests_total", (("role", "challenger"), ("version", "1")))] \
            == n_challenger
        assert samples[("shardline_canary_requests_total", (("role", "champion"), ("version", "1")))] \
            == 4 + 16 - n_challenger + 1
        assert samples[("shardline_canary_model_calls_total",
                        (("kind", "shadow"), ("outcome", "ok"), ("version", "1")))] == n_challenger
        bits = samples[("shardline_canary_bits_total", (("version", "1"),))]
        nbytes = samples[("shardline_canary_bytes_total", (("version", "1"),))]
        assert nbytes == 255 * (4 + 16 + 1 + n_challenger)
        assert bits / nbytes == pytest.approx(answer["served"]["bpb"], rel=1e-3)
    finally:
        stop_canary_app()


def test_a_champion_moved_during_the_canary_is_not_overwritten(world):
    """Compare-and-set at the end of a real canary: another writer moves `champion` while traffic ramps."""
    from deployments.canary import CanaryDecided

    client = world["client"]
    assert read_aliases(client, NAME)["champion"] == "2"  # after the two canaries above
    lenient = CanaryConfig(steps=[100], requests_per_step=4, max_bpb_regression=10.0, latency_floor_ms=1000.0)

    def concurrent_writer(i, step):  # after the last step's traffic, before the decision is applied
        assert step.paired == 4
        client.set_registered_model_alias(NAME, "champion", "3")

    logged = []
    with pytest.raises(CanaryDecided, match="alias 'champion' is at version 3, the decision expected 2"):
        run_canary(lenient, NAME, "2", "1", world["heldout"], world["uri"], on_step=concurrent_writer,
                   log=logged.append)
    assert [(d.verdict, d.baseline, d.candidate) for d in logged] == [("promoted", "2", "1")]
    assert read_aliases(client, NAME)["champion"] == "3"  # the other writer's move stands
    from ray import serve

    assert serve.status().applications == {}  # the app came down although applying failed
