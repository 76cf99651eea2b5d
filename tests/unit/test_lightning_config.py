"""train.loop = "lightning" at config load: the module path resolves to a LightningModule, the model the stage
serves is the module's `.model`, and every conflicting or broken setting is one line (the CLI's exit 2)."""

from __future__ import annotations

import pytest
import torch

from flows.config import ConfigError, load_config
from training.config import LIGHTNING_FACTORY, load_object
from training.model import GPT

LIGHTNING = 'loop = "lightning"\nlightning_module = "training.lightning_example:ByteGPTModule"\nparallelism = "ddp"\n'


def _load(tmp_path, train: str):
    (tmp_path / "run.toml").write_text(f"[train]\nseq_len = 32\nn_layer = 1\nd_model = 32\n{train}")
    return load_config(tmp_path / "run.toml").train


def test_the_module_model_is_what_validation_and_serving_build(tmp_path):
    cfg = _load(tmp_path, LIGHTNING)
    assert cfg.model_factory == LIGHTNING_FACTORY
    model = load_object(cfg.model_factory, "train.model_factory")(cfg)
    assert isinstance(model, GPT) and model(torch.randint(0, 256, (2, 32))).shape == (2, 32, 256)


def test_fsdp_is_the_default_for_a_module_that_shards_itself(tmp_path):
    cfg = _load(tmp_path, LIGHTNING.replace('parallelism = "ddp"\n', ""))
    assert (cfg.parallelism, cfg.model_factory) == ("fsdp", LIGHTNING_FACTORY)


@pytest.mark.parametrize(
    ("train", "message"),
    [
        (
            LIGHTNING.replace("training.lightning_example:ByteGPTModule", "training.no_such:Module"),
            "train.lightning_module='training.no_such:Module': cannot import",
        ),
        (
            LIGHTNING.replace("training.lightning_example:ByteGPTModule", "training.model:GPT"),
            "is not a lightning.pytorch.LightningModule class",
        ),
        ('loop = "lightning"\nparallelism = "ddp"\n', "train.loop='lightning' needs train.lightning_module"),
        (
            'lightning_module = "training.lightning_example:ByteGPTModule"\n',
            "needs train.loop='lightning'",
        ),
        (
            LIGHTNING.replace('parallelism = "ddp"\n', "").replace(
                "training.lightning_example:ByteGPTModule", "support.lightning_support:UnshardedByteGPT"
            ),
            "the module must shard its model in configure_model() (call training.lightning_loop.shard_model",
        ),
        (LIGHTNING + 'model_factory = "training.model:build_gpt2"\n', "both name the model; set one"),
        (LIGHTNING + '[train.hf_config]\nmodel_type = "llama"\n', "train.hf_config and train.lightning_module"),
        (LIGHTNING + "activation_checkpointing = true\n", "with train.loop='lightning' the module decides"),
        (LIGHTNING + "cpu_offload = true\n", "train.cpu_offload are the built-in loop's"),
    ],
)
def test_a_broken_lightning_setting_is_one_line_at_config_load(tmp_path, train, message):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, train)
    text = str(err.value)
    assert len(text.splitlines()) == 1 and message in text, text


def test_a_module_without_a_model_attribute_is_named(tmp_path):
    from training.lightning_loop import lightning_model

    cfg = _load(
        tmp_path, LIGHTNING.replace("training.lightning_example:ByteGPTModule", "support.lightning_support:NoModel")
    )
    with pytest.raises(ValueError, match="its `model` attribute must be the nn.Module to serve, got NoneType"):
        lightning_model(cfg)
    # a constructor that does not take the TrainConfig: one line naming the module, from the stage
    bare = cfg.model_copy(update={"lightning_module": "lightning.pytorch:LightningModule"})
    with pytest.raises(ValueError) as err:
        lightning_model(bare)
    assert len(str(err.value).splitlines()) == 1
    assert "train.lightning_module='lightning.pytorch:LightningModule': LightningModule(cfg) failed: TypeError" in str(
        err.value
    )


def test_a_module_the_checkpoint_cannot_restore_is_refused_before_the_first_batch(tmp_path):
    import lightning.pytorch as pl

    from training.lightning_example import ByteGPTModule
    from training.lightning_loop import check_module

    cfg = _load(tmp_path, LIGHTNING)

    class Check(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            check_module(trainer, pl_module, cfg)

    class WithScheduler(ByteGPTModule):
        def configure_optimizers(self):
            opt = super().configure_optimizers()
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}

    class ExtraParameters(ByteGPTModule):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.head = torch.nn.Linear(2, 2)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    class Manual(ByteGPTModule):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.automatic_optimization = False

    batch = (torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32)))
    for module, message in (
        (WithScheduler(cfg), "returns a learning-rate scheduler"),
        (ExtraParameters(cfg), "updates 2 parameters outside `model`"),
        (Manual(cfg), "manual optimization is not supported"),
    ):
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=1,
            callbacks=[Check()],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with pytest.raises(ValueError, match=message):
            trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch], batch_size=None))
