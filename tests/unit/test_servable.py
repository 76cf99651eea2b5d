"""Any model that trains must serve: validation loads the logged pt2 model back and runs it at serving shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from training.evaluate import NotServable, check_servable, log_servable_model, serving_shapes


class Causal(nn.Module):
    """A tiny causal byte model whose exported program keeps batch and time dynamic."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 16)
        self.head = nn.Linear(16, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


class SpecialisesOnLength(Causal):
    """Reshapes with the example's length as a constant: export bakes T=16 in, as a careless plug-in model might."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x)).reshape(x.shape[0], 16, 256)


def _logged(model: nn.Module, seq_len: int) -> str:
    import mlflow

    with mlflow.start_run():
        return log_servable_model(model.eval(), seq_len)


def test_serving_shapes_cover_one_token_to_a_full_batch():
    shapes = serving_shapes(32)
    assert (1, 1) in shapes and (1, 32) in shapes and (8, 32) in shapes and max(t for _, t in shapes) == 32


def test_a_servable_model_passes(mlflow_store):
    model = Causal()
    check_servable(_logged(model, 32), model, 32, "tests:Causal")


def test_a_model_that_cannot_serve_every_shape_is_rejected_before_registration(mlflow_store):
    model = SpecialisesOnLength()
    uri = _logged(model, 32)
    with pytest.raises(NotServable, match=r"train.model_factory='tests:Specialises'.*serving shape \[1, 1\]"):
        check_servable(uri, model, 32, "tests:Specialises")


def test_validation_scores_the_champions_exported_program_like_the_eager_model(mlflow_store):
    """The champion is compared as served (a torch.export program refuses .eval()/.train()): same numbers."""
    import mlflow

    from training.evaluate import bits_per_byte

    model = Causal()
    exported = mlflow.pytorch.load_model(_logged(model, 32), map_location="cpu")
    texts = [b"def main():\n    return 0\n" * 5, b"import os"]
    assert bits_per_byte(exported, texts, 32) == pytest.approx(bits_per_byte(model, texts, 32), rel=1e-5)
