"""MLflow models-from-code entry of an eagerly served model (training.servable): MLflow runs this file to load the
model, so nothing is unpickled. The model is rebuilt by its `train.model_factory` from the logged TrainConfig and
gets the logged weights (`weights_only=True`); that factory's module, and shardline's `training` package, must be
importable where it loads.

`predict` takes int64 token ids [B, T] (bytes for a byte-level model) and returns float32 logits [B, T, 256].
"""

from __future__ import annotations

import warnings
from typing import Any

import mlflow
from mlflow.pyfunc import PythonModel

with warnings.catch_warnings():
    # MLflow asks for type hints on predict; the logged tensor signature already describes the input
    warnings.simplefilter("ignore", UserWarning)

    class EagerModel(PythonModel):
        def load_context(self, context: Any) -> None:
            from training.servable import build_eager

            self.model = build_eager(dict(context.model_config), context.artifacts["weights"])

        # no hints: MLflow would validate and convert the input by them
        def predict(self, context, model_input, params=None):
            import numpy as np
            import torch

            with torch.no_grad():
                x = torch.as_tensor(np.asarray(model_input, dtype=np.int64))
                return self.model(x).float().numpy()


mlflow.models.set_model(EagerModel())
