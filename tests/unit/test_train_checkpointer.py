"""The Checkpointer's state machine on one gloo rank: cadence, one async save in flight, publish order, restore."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist

from training import checkpoint as ck
from training.checkpointer import Checkpointer, LocalHooks
from training.config import TrainConfig
from training.loop import build_optimizer
from training.model import build_gpt
from training.parallelize import parallelize
from training.train_metrics import MetricsWindow

CFG = TrainConfig(
    workers=1,
    steps=5,
    checkpoint_every=2,
    keep_checkpoints=2,
    grad_accum=3,
    seq_len=16,
    n_layer=2,
    n_head=2,
    d_model=16,
    lr=1e-2,
    warmup_steps=0,
)
CPU = torch.device("cpu")


@pytest.fixture()
def pg():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class RecordingHooks(LocalHooks):
    """The torchrun hooks (real directories, real pruning), recording what was published, in order."""

    def __init__(self, root, keep: int) -> None:
        super().__init__(str(root), keep)
        self.published: list[tuple[int, str, dict[str, float]]] = []

    def publish(self, directory: str, step: int, metrics: dict[str, float], rank: int) -> None:
        self.published.append((step, directory, metrics))
        super().publish(directory, step, metrics, rank)


def _setup(root, async_save: bool, seed: int = 0):
    torch.manual_seed(seed)
    model = parallelize(build_gpt(CFG), CFG, CPU, 1)
    optimizer = build_optimizer(model, CFG, CPU)
    hooks = RecordingHooks(root, CFG.keep_checkpoints)

    def report(step: int) -> dict:
        return {"step": float(step)}

    return model, optimizer, hooks, Checkpointer(hooks, model, optimizer, CFG, 0, 1, CPU, report, async_save)


def _train(model, optimizer) -> None:
    x = torch.randint(0, 256, (2, 17))
    model(x[:, :-1]).float().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(model) -> dict[str, torch.Tensor]:
    return {
        k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone() for k, v in model.state_dict().items()
    }


def test_async_saves_are_published_in_order_one_in_flight_and_the_last_synchronously(pg, tmp_path):
    root = tmp_path / "ck"
    model, optimizer, hooks, cp = _setup(root, async_save=True)
    assert cp.restore() == (0, 0)
    cp.save(1)
    assert cp.pending is None and hooks.published == [] and not root.exists()  # not a checkpoint step

    _train(model, optimizer)
    cp.save(2)
    assert cp.pending is not None and cp.pending.step == 2 and hooks.published == []
    deadline = time.monotonic() + 60
    while cp.pending is not None and time.monotonic() < deadline:  # what the loop does after every step
        cp.publish_finished()
        time.sleep(0.01)
    assert [(s, m) for s, _, m in hooks.published] == [(2, {"step": 2.0})]
    assert ck.latest_complete([hooks.published[0][1]]) == (2, hooks.published[0][1])

    cp.save(3)
    _train(model, optimizer)
    cp.save(4)
    assert cp.pending is not None and cp.pending.step == 4
    cp.save(5, last_step=True)  # waits for step 4's save and publishes it first; the last save is synchronous
    assert cp.pending is None
    assert [s for s, _, _ in hooks.published] == [2, 4, 5]
    cp.close()
    assert [s for s, _, _ in hooks.published] == [2, 4, 5]  # nothing in flight: close publishes nothing
    # LocalHooks keeps the newest keep_checkpoints (2) directories
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_00000004", "checkpoint_00000005"]
    manifest = json.loads((root / "checkpoint_00000005" / ck.manifest_name(0)).read_text())
    assert (manifest["step"], manifest["resumed_from"]) == (5, 0)


def test_restore_loads_the_newest_complete_checkpoint_and_is_recorded_as_resumed_from(pg, tmp_path):
    model, optimizer, _, cp = _setup(tmp_path, async_save=False)
    snapshots = {}
    for step in range(1, 5):
        _train(model, optimizer)
        snapshots[step] = _full(model)
        cp.save(step, last_step=step == 4)

    fresh, _, _, restored = _setup(tmp_path, async_save=False, seed=1)
    assert restored.restore() == (4, 4 * CFG.grad_accum)  # the data position: micro batches consumed
    assert restored.resumed_from == 4
    assert all(torch.equal(snapshots[4][k], v) for k, v in _full(fresh).items())

    # the newest checkpoint loses its manifest (a rank killed mid-save): resume from the one before
    (tmp_path / "checkpoint_00000004" / ck.manifest_name(0)).unlink()
    fresh, _, _, restored = _setup(tmp_path, async_save=False, seed=1)
    assert restored.restore() == (2, 2 * CFG.grad_accum)
    assert all(torch.equal(snapshots[2][k], v) for k, v in _full(fresh).items())
    restored.save(5, last_step=True)
    manifest = json.loads((tmp_path / "checkpoint_00000005" / ck.manifest_name(0)).read_text())
    assert (manifest["step"], manifest["resumed_from"]) == (5, 2)


def test_metrics_window_averages_the_loss_and_times_the_run_from_its_first_step(pg):
    window = MetricsWindow(tokens_per_step=100, flops_per_token=1e6, peak_tflops=1.0, world=1, device=CPU)
    assert window.summary(0)["tokens_per_s"] == 0.0 and window.summary(0)["loss"] != window.summary(0)["loss"]
    window.step_done()
    assert window.summary(1)["tokens_per_s"] == 0.0  # the first step (warm-up) is not timed
    time.sleep(0.01)
    window.step_done()
    metrics = window.collect(torch.tensor(2.5), torch.tensor(0.5), 1e-3)
    assert metrics["loss"] == 2.5 and metrics["lr"] == 1e-3 and metrics["grad_norm"] == 0.5
    assert metrics["step_time_s"] > 0 and metrics["tokens_per_s"] == pytest.approx(200 / (2 * metrics["step_time_s"]))
    assert metrics["mfu"] == pytest.approx(1e6 * metrics["tokens_per_s"] / 1e12)
    summary = window.summary(2)
    assert summary["loss"] == 2.5 and summary["step"] == 2 and 0 < summary["tokens_per_s"]
