"""Learning-rate schedule, the global-batch check, and config import paths."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from training.config import TrainConfig, check_global_batch, load_object
from training.loop import lr_at

CFG = TrainConfig(steps=110, warmup_steps=10, lr=1e-3, min_lr=1e-4)


def test_warmup_is_linear_to_peak():
    assert lr_at(0, CFG) == pytest.approx(1e-4)
    assert lr_at(4, CFG) == pytest.approx(5e-4)
    assert lr_at(9, CFG) == pytest.approx(1e-3)


def test_cosine_decays_from_peak_to_min():
    assert lr_at(10, CFG) == pytest.approx(1e-3)
    assert lr_at(60, CFG) == pytest.approx((1e-3 + 1e-4) / 2)  # half way through the decay
    assert lr_at(35, CFG) == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi / 4)) * 9e-4)
    assert lr_at(110, CFG) == pytest.approx(1e-4)
    assert lr_at(500, CFG) == pytest.approx(1e-4)
    lrs = [lr_at(s, CFG) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_no_warmup_starts_at_peak():
    cfg = CFG.model_copy(update={"warmup_steps": 0})
    assert lr_at(0, cfg) == pytest.approx(1e-3)


def test_global_batch_derived_and_checked():
    cfg = TrainConfig(micro_batch=4, grad_accum=3)
    assert check_global_batch(cfg, 2) == 24
    assert check_global_batch(cfg.model_copy(update={"global_batch": 24}), 2) == 24
    with pytest.raises(ValueError) as err:
        check_global_batch(cfg.model_copy(update={"global_batch": 32}), 2)
    assert str(err.value) == "train.global_batch=32 != micro_batch 4 x grad_accum 3 x workers 2 = 24; set it to 24 or 0"


def test_model_factory_import_path_errors_name_the_field():
    assert callable(load_object("training.model:build_gpt", "train.model_factory"))
    with pytest.raises(ValueError, match=r"train.model_factory='training.model:nope': cannot import"):
        load_object("training.model:nope", "train.model_factory")
    with pytest.raises(ValueError, match="expected 'module:function'"):
        load_object("training.model", "train.model_factory")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"lr": 1e-4}, r"train.min_lr=0.0003 > train.lr=0.0001: the cosine decay would raise the rate past its peak"),
        ({"cpu_offload": True}, r"train.cpu_offload=true needs train.use_gpu=true"),
        ({"cpu_offload": True, "use_gpu": True, "parallelism": "ddp"}, r"train.cpu_offload is FSDP2's"),
        ({"powersgd_rank": 2}, r"train.powersgd_rank=2 compresses DDP's gradients; set train.parallelism='ddp'"),
    ],
)
def test_settings_the_workers_would_refuse_or_ignore_are_refused_at_load(fields, message):
    """Each of these failed (or did nothing) only once the workers parallelized the model or the rate decayed."""
    with pytest.raises(ValidationError, match=f"Value error, {message}"):
        TrainConfig(**fields)
    TrainConfig(lr=1e-4, min_lr=1e-5)  # a fine-tune's lower peak with its own floor
    TrainConfig(cpu_offload=True, use_gpu=True)
    TrainConfig(powersgd_rank=2, parallelism="ddp")
