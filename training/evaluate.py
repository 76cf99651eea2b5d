"""Held-out evaluation in bits per byte, and the validation stage's result and gate error."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel
from torch import nn

if TYPE_CHECKING:
    from tokenizers import Tokenizer

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
    chat_template_sha256: str = ""  # the chat template the logged model carries ('' for none)
    chat_tokens: dict[str, str] = {}  # the tokens a chat template renders with (training.servable.served_chat)


def bits_per_byte(
    model: nn.Module,
    texts: Iterable[bytes],
    seq_len: int,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
    tokenizer: Tokenizer | None = None,
) -> float:
    """Cross-entropy of the next byte in bits per byte over every text (8.0 is a uniform guess).

    The model maps int64 [B, T] byte values to logits [B, T, 256]; the windows are training.bpb's, the same
    the canary and the live endpoint score with. With a `tokenizer`, the model maps its ids to logits over them,
    and the bits of every token but a text's first are divided by the UTF-8 bytes those tokens cover
    (training.tokenizer.predicted): the same texts, on the same scale as a byte model.

    Raises:
        ValueError: no text had two bytes, so nothing was predicted.
    """
    from training.bpb import corpus_bits

    was_training = getattr(model, "training", False)
    _mode(model, "eval")
    try:
        encode = None
        if tokenizer is not None:
            from training.tokenizer import predicted

            encode = functools.partial(predicted, tokenizer)
        bits, nbytes, _ = corpus_bits(model, texts, seq_len, batch_size, device, encode)
    finally:
        if was_training:
            _mode(model, "train")
    if nbytes == 0:
        unit = "tokens" if tokenizer is not None else "bytes"
        raise ValueError(f"bits_per_byte: no held-out text with at least 2 {unit}")
    return bits / nbytes


def _mode(model: object, mode: str) -> None:
    try:
        getattr(model, mode)()
    except (NotImplementedError, RuntimeError, AttributeError):
        pass  # torch.export modules refuse .eval() and .train(); their graph is already in inference form


def sample_texts(texts: Iterable[bytes], total: int, max_texts: int) -> Iterator[bytes]:
    """Every text when max_texts is 0 (or covers them all), else exactly max_texts of the `total`, spread evenly over
    all of them from the first: text i where i * max_texts // total steps up (a whole-number stride took 500 of 1,000
    for max_texts = 600, and the run logged 600)."""
    if not max_texts or max_texts >= total:
        yield from texts
        return
    for i, text in enumerate(texts):
        if (i * max_texts) % total < max_texts:
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
    model: nn.Module,
    val_shards: list[str],
    num_val: int,
    seq_len: int,
    batch_size: int,
    max_texts: int,
    tokenizer: Tokenizer | None = None,
) -> float:
    """Bits per byte of `model` on the held-out split (all of it, or the documented sample of max_texts). The texts
    are the records' .txt whether or not the set is tokenized, so a byte model and a `tokenizer`'s model are scored
    on the same held-out texts."""
    from training.data.loader import iter_texts

    texts = sample_texts((text for _, text in iter_texts(val_shards)), num_val, max_texts)
    return bits_per_byte(model, texts, seq_len, batch_size=batch_size, tokenizer=tokenizer)
