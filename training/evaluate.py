"""Held-out evaluation in bits per byte, and the validation stage's result and gate error."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel
from torch import nn

if TYPE_CHECKING:
    from training.config import TrainConfig


class GateFailed(RuntimeError):
    """The quality gate failed (e.g. bits per byte above the configured maximum); retrying will not help."""


class NotServable(GateFailed):
    """The model cannot be exported or run at the shapes serving uses: rejected before it is registered."""


class ValidationResult(BaseModel):
    """What validate_checkpoint produced: the model it logged and the numbers behind the gate decision.

    A result exists only for a checkpoint that passed every gate; a failed gate raises GateFailed instead.
    """

    validation_run_id: str
    checkpoint_uri: str
    val_bits_per_byte: float
    champion_val_bits_per_byte: float | None = None
    champion_version: str | None = None
    model_uri: str
    seq_len: int


def bits_per_byte(
    model: nn.Module,
    texts: Iterable[bytes],
    seq_len: int,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
) -> float:
    """Cross-entropy of the next byte in bits per byte over every text (8.0 is a uniform guess).

    The model maps int64 [B, T] byte values to logits [B, T, 256]; the windows are training.bpb's, the same
    the canary and the live endpoint score with.

    Raises:
        ValueError: no text had two bytes, so nothing was predicted.
    """
    from training.bpb import corpus_bits

    was_training = getattr(model, "training", False)
    _mode(model, "eval")
    try:
        bits, nbytes, _ = corpus_bits(model, texts, seq_len, batch_size, device)
    finally:
        if was_training:
            _mode(model, "train")
    if nbytes == 0:
        raise ValueError("bits_per_byte: no held-out text with at least 2 bytes")
    return bits / nbytes


def _mode(model: object, mode: str) -> None:
    try:
        getattr(model, mode)()
    except (NotImplementedError, RuntimeError, AttributeError):
        pass  # torch.export modules refuse .eval() and .train(); their graph is already in inference form


def sample_texts(texts: Iterable[bytes], total: int, max_texts: int) -> Iterator[bytes]:
    """Every text when max_texts is 0 (or covers them all), else a systematic sample spread over all of them."""
    stride = 1 if not max_texts or max_texts >= total else math.ceil(total / max_texts)
    for i, text in enumerate(texts):
        if i % stride == 0:
            yield text


def load_checkpoint_model(checkpoint_uri: str, train_cfg: TrainConfig) -> nn.Module:
    """The DCP checkpoint loaded into a plain model (no process group), in eval mode.

    Raises:
        training.checkpoint.CheckpointError: the checkpoint is incomplete, corrupt or has non-finite values.
    """
    from training.checkpoint import load_unsharded, local_copy
    from training.config import load_object

    model = load_object(train_cfg.model_factory, "train.model_factory")(train_cfg)
    with local_copy(checkpoint_uri) as directory:
        load_unsharded(model, directory)
    return model.eval()


def held_out_bpb(
    model: object, val_shards: list[str], num_val: int, seq_len: int, batch_size: int, max_texts: int
) -> float:
    """Bits per byte of `model` on the held-out split (all of it, or the documented sample of max_texts)."""
    from training.data.loader import iter_texts

    texts = sample_texts((text for _, text in iter_texts(val_shards)), num_val, max_texts)
    return bits_per_byte(model, texts, seq_len, batch_size=batch_size)  # type: ignore[arg-type]


def log_servable_model(model: nn.Module, seq_len: int, name: str = "model") -> str:
    """Log `model` to the active MLflow run in the format serving expects; return its models:/ URI.

    Saved as "pt2" (torch.export; loading it unpickles nothing) with batch and time dimensions dynamic:
    input int64 [B, T] byte values with T <= seq_len, output float32 logits [B, T, 256]. The logged model's
    metadata records seq_len. The built-in GPT also gets its weights as an extra file (tensors only, see
    training.model.save_weights) and metadata[EAGER_METADATA] = {"config", "weights"}: an exported program cannot
    carry a KV cache, so serving rebuilds the eager GPT from them and decodes incrementally. A plugged-in model
    factory's model is served from the pt2 program alone.
    """
    import tempfile
    from pathlib import Path

    import mlflow
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    signature = ModelSignature(
        inputs=Schema([TensorSpec(np.dtype("int64"), (-1, -1))]),
        outputs=Schema([TensorSpec(np.dtype("float32"), (-1, -1, 256))]),
    )
    # B and T > 1 in the example, so torch.export keeps both dimensions dynamic.
    text = b"def main():\n    return 0\n"[: min(16, seq_len)] * 2
    example = np.frombuffer(text, dtype=np.uint8).astype(np.int64).reshape(2, -1)
    from training.model import EAGER_METADATA, EAGER_WEIGHTS_FILE, GPT, save_weights

    metadata: dict = {"seq_len": seq_len}
    with tempfile.TemporaryDirectory() as tmp:
        extra_files = None
        if type(model) is GPT:  # exactly the built-in class: a subclass may decode differently
            save_weights(model, str(Path(tmp) / EAGER_WEIGHTS_FILE))
            extra_files = [str(Path(tmp) / EAGER_WEIGHTS_FILE)]
            # mlflow copies extra files to extra_files/<name> inside the logged model
            metadata[EAGER_METADATA] = {"config": model.config(), "weights": f"extra_files/{EAGER_WEIGHTS_FILE}"}
        info = mlflow.pytorch.log_model(
            model.eval(),
            name=name,
            serialization_format="pt2",
            signature=signature,
            input_example=example,
            metadata=metadata,
            extra_files=extra_files,
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}", "numpy"],
        )
    return info.model_uri


def serving_shapes(seq_len: int) -> list[tuple[int, int]]:
    """[B, T] shapes the endpoint calls a model with: one token, a completion's growing context, scoring batches."""
    return sorted({(1, 1), (1, 2), (1, max(1, seq_len // 2) + 1), (1, seq_len), (3, 2), (8, seq_len)})


def check_servable(model_uri: str, eager: nn.Module, seq_len: int, factory: str = "") -> None:
    """Load the logged model back as serving will and run it at every serving shape against the eager model.

    Raises:
        NotServable: naming the model factory, the shape and the cause (a failed guard, different logits).
    """
    import mlflow

    loaded = mlflow.pytorch.load_model(model_uri, map_location="cpu")
    gen = torch.Generator().manual_seed(0)
    who = f"train.model_factory={factory!r}: " if factory else ""
    for b, t in serving_shapes(seq_len):
        x = torch.randint(0, 256, (b, t), generator=gen)
        try:
            with torch.no_grad():
                got, want = loaded(x), eager(x)
        except Exception as e:  # noqa: BLE001 - any failure here means the endpoint would fail the same way
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise NotServable(f"{who}the exported model fails at serving shape [{b}, {t}]: {first}") from None
        if tuple(got.shape) != (b, t, 256) or not torch.allclose(got.float(), want.float(), atol=1e-3, rtol=1e-3):
            raise NotServable(
                f"{who}the exported model's logits at shape [{b}, {t}] differ from the trained model's "
                f"(shape {tuple(got.shape)})"
            )
