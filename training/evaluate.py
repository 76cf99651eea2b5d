"""Held-out evaluation in bits per byte, and the validation stage's result and gate error."""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pydantic import BaseModel
from torch import nn

if TYPE_CHECKING:
    from training.config import TrainConfig


class GateFailed(RuntimeError):
    """The quality gate failed (e.g. bits per byte above the configured maximum); retrying will not help."""


class ValidationResult(BaseModel):
    """What validate_checkpoint produced: the model it logged and the number behind the gate decision."""

    validation_run_id: str
    checkpoint_uri: str
    val_bits_per_byte: float
    model_uri: str
    seq_len: int
    passed: bool


def _windows(texts: Iterable[bytes], seq_len: int) -> Iterator[torch.Tensor]:
    """Each text cut into windows of at most seq_len + 1 bytes; every byte after a window's first is predicted."""
    for text in texts:
        for start in range(0, max(0, len(text) - 1), seq_len):
            window = text[start:start + seq_len + 1]
            if len(window) >= 2:
                yield torch.frombuffer(bytearray(window), dtype=torch.uint8).long()


@torch.no_grad()
def bits_per_byte(
    model: nn.Module,
    texts: Iterable[bytes],
    seq_len: int,
    batch_size: int = 8,
    max_batches: int | None = None,
    device: torch.device | str = "cpu",
) -> float:
    """Cross-entropy of the next byte in bits per byte (nats / ln 2 per predicted byte); 8.0 is a uniform guess.

    The model maps int64 [B, T] byte values to logits [B, T, 256]. Texts are cut into windows of seq_len + 1
    bytes; windows of equal length are batched together; at most max_batches batches are evaluated.

    Raises:
        ValueError: no text had two bytes, so nothing was predicted.
    """
    was_training = model.training
    model.eval()
    total_nats, total_bytes, batches = 0.0, 0, 0
    full: list[torch.Tensor] = []

    def run(batch: list[torch.Tensor]) -> None:
        nonlocal total_nats, total_bytes, batches
        seqs = torch.stack(batch).to(device)
        logits = model(seqs[:, :-1]).float()
        total_nats += F.cross_entropy(logits.reshape(-1, logits.size(-1)), seqs[:, 1:].reshape(-1),
                                      reduction="sum").item()
        total_bytes += seqs[:, 1:].numel()
        batches += 1

    try:
        for window in _windows(texts, seq_len):
            if max_batches is not None and batches >= max_batches:
                break
            if len(window) == seq_len + 1:
                full.append(window)
                if len(full) == batch_size:
                    run(full)
                    full = []
            else:  # a text's short tail: its own batch of one
                run([window])
        if full and (max_batches is None or batches < max_batches):
            run(full)
    finally:
        model.train(was_training)
    if total_bytes == 0:
        raise ValueError("bits_per_byte: no held-out text with at least 2 bytes")
    return total_nats / math.log(2) / total_bytes


def evaluate_checkpoint(checkpoint_uri: str, train_cfg: "TrainConfig", val_shards: list[str], batch_size: int,
                        max_batches: int) -> tuple[nn.Module, float]:
    """Load a DCP checkpoint into a plain model (no process group) and measure held-out bits per byte.

    Returns:
        The unsharded model in eval mode, and its validation bits per byte.

    Raises:
        training.checkpoint.CheckpointError: the checkpoint is incomplete, corrupt or has non-finite values.
    """
    from training.checkpoint import load_unsharded, local_copy
    from training.data.loader import iter_texts
    from training.config import load_object

    model = load_object(train_cfg.model_factory, "train.model_factory")(train_cfg)
    with local_copy(checkpoint_uri) as directory:
        load_unsharded(model, directory)
    model.eval()
    texts = (text for _, text in iter_texts(val_shards))
    return model, bits_per_byte(model, texts, train_cfg.seq_len, batch_size=batch_size, max_batches=max_batches)


def log_servable_model(model: nn.Module, seq_len: int, name: str = "model") -> str:
    """Log `model` to the active MLflow run in the format serving expects; return its models:/ URI.

    Saved as "pt2" (torch.export; loading it unpickles nothing) with batch and time dimensions dynamic:
    input int64 [B, T] byte values with T <= seq_len, output float32 logits [B, T, 256]. The logged model's
    metadata records seq_len.
    """
    import mlflow
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    signature = ModelSignature(
        inputs=Schema([TensorSpec(np.dtype("int64"), (-1, -1))]),
        outputs=Schema([TensorSpec(np.dtype("float32"), (-1, -1, 256))]),
    )
    # B and T > 1 in the example, so torch.export keeps both dimensions dynamic.
    example = np.frombuffer(b"def main():\n    return 0\n"[: min(16, seq_len)] * 2, dtype=np.uint8)
    example = example.astype(np.int64).reshape(2, -1)
    info = mlflow.pytorch.log_model(
        model.eval(), name=name, serialization_format="pt2", signature=signature, input_example=example,
        metadata={"seq_len": seq_len},
        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}", "numpy"],
    )
    return info.model_uri
