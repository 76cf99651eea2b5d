"""Training's live numbers (loss, tokens/s, MFU, step time, step) as Prometheus gauges while a run trains on Ray.

Under Ray Train, `ray.util.metrics` gauges go to the node's metrics agent, which exports them on the node's
metrics port with Ray's `ray_` prefix; the stack's Prometheus finds that port through Ray's service-discovery file
(flows/stack/prometheus.py). Under torchrun there is no agent, and `export` does nothing.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

RAY_PREFIX = "ray_"  # Ray's metrics agent exports every application metric as ray_<name>
TAG_KEYS = ("run_id",)
# key of the training loop's metrics dict ("step" is the logged step itself) -> (gauge name, description)
GAUGES = {
    "loss": ("shardline_train_loss", "Training loss (mean over ranks) of the last logged optimizer step."),
    "tokens_per_s": ("shardline_train_tokens_per_second", "Tokens per second over the last logging window."),
    "mfu": ("shardline_train_mfu", "Model FLOPs utilisation over the last logging window (0..1)."),
    "step_time_s": ("shardline_train_step_seconds", "Mean optimizer step time over the last logging window."),
    "step": ("shardline_train_step", "Last optimizer step logged."),
}


def exported_names() -> set[str]:
    """The series names Prometheus sees (what the Grafana dashboard queries)."""
    return {RAY_PREFIX + name for name, _ in GAUGES.values()}


@functools.lru_cache(maxsize=1)
def _ray_gauges() -> dict[str, Any] | None:
    """The gauges of this process, or None when it is not a Ray worker (torchrun, tests): Ray is not imported here
    unless it already is, so the torchrun path never loads it."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    from ray.util.metrics import Gauge

    return {key: Gauge(name, description=text, tag_keys=TAG_KEYS) for key, (name, text) in GAUGES.items()}


def export(metrics: dict[str, float], step: int, run_id: str) -> None:
    """Set the gauges from one logging window of the training loop (rank 0); a no-op outside Ray."""
    gauges = _ray_gauges()
    if gauges is None:
        return
    values = {**metrics, "step": step}
    tags = {"run_id": run_id or "none"}
    for key, gauge in gauges.items():
        if key in values:
            gauge.set(float(values[key]), tags=tags)
