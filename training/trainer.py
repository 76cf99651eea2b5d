"""Ray Train glue: run `training.loop.train_func` on N workers with TorchTrainer, restarts and checkpoints."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from infra.cluster import ClusterError
from infra.environ import overridden
from infra.paths import shardline_home
from training.config import TrainConfig

if TYPE_CHECKING:
    from training.data import ShardSet


class PlacementTimeout(ClusterError):
    """train.placement_timeout_s passed before the cluster could place every training worker (an expected failure:
    one line, no traceback)."""


class TrainResult(BaseModel):
    """The training stage's product: the latest complete checkpoint and the run's headline numbers."""

    train_run_id: str
    checkpoint_uri: str
    step: int
    final_loss: float
    tokens_per_s: float
    world_size: int


def storage_root(cfg: TrainConfig) -> str:
    """Where Ray Train keeps checkpoints: train.storage_path, else $SHARDLINE_HOME/checkpoints."""
    return cfg.storage_path or str(shardline_home() / "checkpoints")


def checkpoint_uri(storage: str, checkpoint_path: str) -> str:
    """A Ray checkpoint's path as a URI: Ray strips the scheme (s3://b/k -> b/k); put it back."""
    if "://" in storage and "://" not in checkpoint_path:
        return f"{storage.split('://', 1)[0]}://{checkpoint_path.lstrip('/')}"
    return checkpoint_path


def worker_resources(cfg: TrainConfig) -> dict[str, float]:
    """What each Ray Train worker reserves: train.resources_per_worker, else one GPU or one CPU.

    Ray Train waits until the cluster can place every worker (it retries the worker group's start without a limit),
    so on an autoscaling cluster a demand no running node can meet makes the autoscaler add nodes that can.

    Raises:
        ValueError: use_gpu without a GPU in resources_per_worker, or a negative amount (names the field).
    """
    if not cfg.resources_per_worker:
        return {"GPU": 1.0} if cfg.use_gpu else {"CPU": 1.0}
    wanted = dict(cfg.resources_per_worker)
    bad = {k: v for k, v in wanted.items() if v < 0}
    if bad:
        raise ValueError(f"train.resources_per_worker={wanted}: amounts must not be negative ({bad})")
    if cfg.use_gpu and wanted.get("GPU", 0) <= 0:
        raise ValueError(f"train.resources_per_worker={wanted}: train.use_gpu needs a GPU per worker, e.g. 'GPU': 1")
    return wanted


def failure_policy(cfg: TrainConfig) -> Any:
    """Ray Train's FailureConfig: train.max_failures worker-group restarts; with train.placement_timeout_s, the
    first start of the worker group that times out ends the run (Ray's default retries starts without a limit)."""
    from ray.train import FailureConfig

    # Ray Train V2's FailureConfig (the installed stubs describe V1's, without controller_failure_limit)
    return FailureConfig(
        max_failures=cfg.max_failures,  # type: ignore[call-arg]
        controller_failure_limit=0 if cfg.placement_timeout_s else -1,
    )


def fit_vocabulary(cfg: TrainConfig, shards: ShardSet) -> TrainConfig:
    """The TrainConfig with train.vocab_size set for the shard set's ids (256 bytes, or its tokenizer's
    vocabulary) when it is 0; ValueError (one line) when the model's embedding is too small for them.

    The built-in GPT embeds cfg.vocab_size ids, and a plug-in factory or LightningModule should read it too. A
    transformers model's embedding is its config's vocab_size (as transformers fills it in), checked here; its
    logits are those of the cfg.vocab_size ids (a padded embedding's extra rows are never predicted).
    """
    from training.model import VOCAB  # torch: only where training runs

    ids = shards.vocab_size or VOCAB
    source = f"the shard set's tokenizer has {ids} ids" if shards.vocab_size else "the shard set is bytes (256 ids)"
    if cfg.hf_config:
        from training.hf_model import embedding_rows

        embeds = embedding_rows(cfg.hf_config) if isinstance(cfg.hf_config, dict) else 0  # inline once loaded
        if embeds < ids:
            raise ValueError(f"train.hf_config vocab_size={embeds}: {source}; the embedding needs at least {ids} rows")
        return cfg.model_copy(update={"vocab_size": ids})
    if cfg.vocab_size and cfg.vocab_size < ids:
        raise ValueError(f"train.vocab_size={cfg.vocab_size}: {source}; set it to 0 or at least {ids}")
    return cfg if cfg.vocab_size else cfg.model_copy(update={"vocab_size": ids})


def worker_config(
    cfg: TrainConfig,
    train_shards: list[str],
    tracking_uri: str,
    train_run_id: str,
    init_checkpoint: str = "",
    token_dtype: str = "",
) -> dict[str, Any]:
    """The `config` dict train_func receives (plain data: it crosses into the Ray workers)."""
    return {
        "train": cfg.model_dump(),
        "train_shards": list(train_shards),
        "token_dtype": token_dtype,
        "tracking_uri": tracking_uri,
        "run_id": train_run_id,
        "init_checkpoint": init_checkpoint,
    }


def run_config(
    cfg: TrainConfig, run_name: str, storage: str, arrow: Any = None, worker_env: dict[str, str] | None = None
) -> Any:
    """Ray Train's RunConfig: the run's name and storage, failure and checkpoint policy, and `worker_env` (the
    network profile's NCCL/UCX variables) in every training worker's environment, set before the worker's
    process group exists, as NCCL reads them when it starts."""
    from ray.train import CheckpointConfig, RunConfig

    return RunConfig(
        name=run_name,
        storage_path=arrow[1] if arrow else storage,
        storage_filesystem=arrow[0] if arrow else None,
        failure_config=failure_policy(cfg),
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
        # a Ray Train V2 field (the installed stubs describe V1's RunConfig)
        worker_runtime_env={"env_vars": dict(worker_env)} if worker_env else None,  # type: ignore[call-arg]
    )


def run_training(
    cfg: TrainConfig,
    shards: ShardSet,
    tracking_uri: str,
    train_run_id: str,
    run_name: str,
    init_checkpoint: str = "",
    worker_env: dict[str, str] | None = None,
) -> TrainResult:
    """Train with Ray Train on the running Ray cluster (ray.init was called); resume when `run_name` has checkpoints.

    The same `run_name` and storage resume the run from its latest complete checkpoint (a retried task, or a
    rerun of the same training after the process died, continues; a finished run returns at once). Ray restarts
    the worker group up to train.max_failures times. `init_checkpoint` (train.init_from resolved) gives the
    model weights a fresh run starts from. Object-store storage gets a pyarrow filesystem built from the same
    credentials as the shard store (environment or Secret block); az:// works although pyarrow calls it abfs.
    `worker_env` reaches every training worker's environment (the cluster's network profile).

    Raises:
        ValueError: a config problem (global batch, import paths) found before any worker starts.
        ray.train.TrainingFailedError: the workers failed more often than train.max_failures allows.
        PlacementTimeout: train.placement_timeout_s passed before every worker was placed.
    """
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    from training.config import check_global_batch, load_object
    from training.loop import train_func

    if cfg.loop == "lightning":  # the user's LightningModule under Ray's Lightning integration
        from training.lightning_loop import train_func

    check_global_batch(cfg, cfg.workers)
    cfg = fit_vocabulary(cfg, shards)
    resources = worker_resources(cfg)
    load_object(cfg.model_factory, "train.model_factory")
    load_object(cfg.batch_format, "train.batch_format")
    if not shards.train_shards:
        raise ValueError(f"{shards.manifest_uri}: the shard set has no training shards")
    from infra.credentials import arrow_filesystem

    storage = storage_root(cfg)
    arrow = arrow_filesystem(storage)
    if arrow is None:
        Path(storage).mkdir(parents=True, exist_ok=True)
    trainer = TorchTrainer(
        train_func,  # type: ignore[arg-type]  # returns its metrics for torchrun; Ray ignores the value
        train_loop_config=worker_config(
            cfg, shards.train_shards, tracking_uri, train_run_id, init_checkpoint, shards.token_dtype
        ),
        scaling_config=ScalingConfig(num_workers=cfg.workers, use_gpu=cfg.use_gpu, resources_per_worker=resources),
        run_config=run_config(cfg, run_name, storage, arrow, worker_env),
    )
    with _start_timeout(cfg.placement_timeout_s):
        try:
            result = trainer.fit()
        except Exception as e:
            if type(getattr(e, "controller_failure", None)).__name__ == "WorkerGroupStartupTimeoutError":
                raise PlacementTimeout(
                    f"train.placement_timeout_s={cfg.placement_timeout_s:g}: the cluster did not place "
                    f"{cfg.workers} workers x {resources} in time (it has {_cluster_resources()})"
                ) from None
            raise
    return summarise(result, storage, train_run_id, cfg.workers)


@contextlib.contextmanager
def _start_timeout(seconds: float) -> Iterator[None]:
    """Ray Train's worker-group start timeout for the fit() inside: it reads the variable from the driver's
    environment when fit() creates the controller and hands it on to it. 0 leaves Ray's default (60 s)."""
    if not seconds:
        yield
        return
    with overridden("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", str(seconds)):
        yield


def _cluster_resources() -> dict[str, float]:
    """The cluster's logical resources, less Ray's per-node markers, for a placement error."""
    import ray

    return {
        k: v
        for k, v in ray.cluster_resources().items()
        if not k.startswith("node:") and k not in ("memory", "object_store_memory")
    }


def summarise(result: Any, storage: str, train_run_id: str, world_size: int) -> TrainResult:
    """TrainResult from a Ray Result: its newest checkpoint that verifies (local storage) and that one's metrics."""
    from training.checkpoint import CheckpointError, verify_checkpoint

    candidates = sorted(result.best_checkpoints or [], key=lambda cm: cm[1].get("step", -1), reverse=True)
    if result.checkpoint is not None and not candidates:
        candidates = [(result.checkpoint, result.metrics or {})]
    for checkpoint, metrics in candidates:
        uri = checkpoint_uri(storage, checkpoint.path)
        if "://" not in uri:
            try:
                verify_checkpoint(uri)
            except CheckpointError:
                continue
        return TrainResult(
            train_run_id=train_run_id,
            checkpoint_uri=uri,
            step=int(metrics.get("step", 0)),
            final_loss=float(metrics.get("loss", float("nan"))),
            tokens_per_s=float(metrics.get("tokens_per_s", 0.0)),
            world_size=int(metrics.get("world_size", world_size)),
        )
    raise RuntimeError(f"training run {result.path}: no complete checkpoint was reported")


def logged_step(tracking_uri: str, run_id: str) -> int:
    """The latest optimizer step rank 0 has logged to the training run (0 before the first log)."""
    from mlflow import MlflowClient

    history = MlflowClient(tracking_uri).get_metric_history(run_id, "loss")
    return max((m.step for m in history), default=0)


def loss_curve_png(tracking_uri: str, run_id: str, path: str | Path) -> Path:
    """Plot the run's logged loss against step into a PNG at `path`; a resumed run's repeated steps overlap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow import MlflowClient

    history = sorted(MlflowClient(tracking_uri).get_metric_history(run_id, "loss"), key=lambda m: (m.timestamp, m.step))
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([m.step for m in history], [m.value for m in history], marker=".", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
