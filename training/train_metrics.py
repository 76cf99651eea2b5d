"""What a training run measures and where it goes: rank 0's MLflow logger (a background thread, so training never
waits on the tracking server) and the metrics window (tokens/s, step time, MFU, peak memory). Shared by the built-in
loop (training/loop.py) and the Lightning loop (training/lightning_loop.py)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

CPU_PEAK_TFLOPS = 0.1
GPU_PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class MlflowLogger:
    """Rank 0's metrics and tags, sent to the run in a background thread; `close()` waits for what is queued."""

    def __init__(self, tracking_uri: str, run_id: str) -> None:
        self.run_id = run_id
        self._pool = ThreadPoolExecutor(max_workers=1) if tracking_uri and run_id else None
        self._pending: list[Any] = []
        if self._pool is not None:
            from infra.paths import quiet_telemetry

            quiet_telemetry()
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._pool is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self._pending.append(self._pool.submit(self._client.log_batch, self.run_id, metrics=batch))

    def record(self, tags: dict[str, str], metrics: dict[str, float]) -> None:
        """Tags and step-0 metrics that describe the run rather than a step (e.g. where its ranks ran)."""
        if self._pool is None:
            return
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        self._pending.append(
            self._pool.submit(
                self._client.log_batch,
                self.run_id,
                metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
                tags=[RunTag(k, v) for k, v in tags.items()],
            )
        )

    def close(self) -> None:
        if self._pool is not None:
            for f in self._pending:
                f.result()
            self._pool.shutdown()


class MetricsWindow:
    """Throughput since the last log (tokens/s, step time, MFU) and over the run (the summary's tokens/s).

    The run's clock starts at the end of its first step, which pays for allocation and warm-up.
    """

    def __init__(
        self, tokens_per_step: int, flops_per_token: float, peak_tflops: float, world: int, device: torch.device
    ) -> None:
        self.tokens_per_step, self.flops_per_token, self.peak_tflops = tokens_per_step, flops_per_token, peak_tflops
        self.world, self.device = world, device
        self.loss = float("nan")  # the last logged loss (mean over ranks)
        self._run_t0: float | None = None
        self._timed_steps = 0
        self.start()

    def start(self) -> None:
        """Open a window: steps are timed from now."""
        self._t0, self._steps = time.perf_counter(), 0

    def step_done(self) -> None:
        self._steps += 1
        if self._run_t0 is None:
            self._run_t0 = time.perf_counter()
        else:
            self._timed_steps += 1

    def collect(self, step_loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> dict[str, float]:
        """Collective (the loss is averaged over ranks): this window's metrics; the next window opens."""
        dist.all_reduce(step_loss)  # SUM: gloo has no AVG
        self.loss = step_loss.item() / self.world
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        elapsed = time.perf_counter() - self._t0
        tps = self.tokens_per_step * self._steps / elapsed
        metrics = {
            "loss": self.loss,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens_per_s": tps,
            "step_time_s": elapsed / self._steps,
            "peak_memory_mb": peak_memory_mb(self.device),
            "mfu": self.flops_per_token * tps / (self.peak_tflops * 1e12 * self.world),
        }
        self.start()
        return metrics

    def summary(self, step: int) -> dict[str, float]:
        """What a published checkpoint and the run report: step, last logged loss, mean tokens/s, world size."""
        elapsed = time.perf_counter() - self._run_t0 if self._run_t0 is not None else 0.0
        tps = self.tokens_per_step * self._timed_steps / elapsed if self._timed_steps and elapsed > 0 else 0.0
        return {"step": step, "loss": self.loss, "tokens_per_s": tps, "world_size": self.world}
