"""MLflow models-from-code entry of every model shardline registers: text in, generated text out, from any Python
process, `mlflow.pyfunc.load_model("models:/NAME@champion").predict(["def main():"], params={"max_tokens": 32})`.

MLflow runs this file to load the model, so nothing is unpickled, and it imports nothing of shardline's:
- a model torch.export captured (the built-in GPT, a transformers model, most plug-ins) is its pt2 program, logged
  as an `mlflow.pytorch` model in the artifact `program` and loaded by `mlflow.pytorch.load_model` with
  MLFLOW_ALLOW_PICKLE_DESERIALIZATION false for the call (MLflow's default allows pickle), so it refuses a program
  with pickled payloads;
- a model export cannot capture is rebuilt by its `train.model_factory` from its weights (`weights_only=True`) and
  TrainConfig; the code that needs, shardline's `training` and `infra` packages and the factory's own package,
  travels inside the model as MLflow `code_paths`.

The text is encoded with the model's `tokenizer.json` (the `tokenizers` library) when it has one, else as UTF-8
bytes, and the completion decoded the same way. Generation here is the reference form: each new token reruns the
context (the last `seq_len` ids), greedy at temperature 0 (the default) or sampled with `seed`, and stops at
`max_tokens` or a special token. The endpoint serves the same weights with a KV cache and continuous batching.

Input: a string, a list of strings, or a one-column DataFrame of strings. Output: one completion per prompt.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import mlflow
from mlflow.pyfunc import PythonModel

_PICKLE_LOCK = threading.RLock()


def prompts_of(model_input: Any) -> list[str]:
    """The prompts in what MLflow hands `predict`: a string, a list of strings, or a DataFrame's first column.

    Raises:
        ValueError: a prompt is not a string, or is empty (naming its index).
    """
    if isinstance(model_input, str):
        values: list[Any] = [model_input]
    elif hasattr(model_input, "iloc"):  # a pandas DataFrame (what a column signature makes of any input)
        values = list(model_input.iloc[:, 0]) if getattr(model_input, "ndim", 1) == 2 else list(model_input)
    else:
        values = list(model_input)
    for i, v in enumerate(values):
        if not isinstance(v, str) or not v:
            raise ValueError(f"prompt {i} must be a non-empty string, got {type(v).__name__} {str(v)[:40]!r}")
    return values


class TextCodec:
    """Text <-> ids for one model: its tokenizer's (special tokens end a completion), or UTF-8 bytes."""

    def __init__(self, tokenizer_path: str | None) -> None:
        self.tokenizer = None
        self.vocab, self.stop_ids = 256, set()
        if tokenizer_path:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(tokenizer_path)
            # its largest id + 1 (a tokenizer.json may leave ids unused), as training.tokenizer.id_count counts
            self.vocab = max(self.tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
            self.stop_ids = {i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


def generate(forward: Any, ids: list[int], codec: TextCodec, seq_len: int, params: dict) -> list[int]:
    """New ids after `ids`: `forward` (int64 [1, T] -> logits [1, T, V]) over the last `seq_len` ids each step."""
    import torch

    max_tokens, temperature = int(params.get("max_tokens", 16)), float(params.get("temperature", 0.0))
    if max_tokens < 0 or temperature < 0:
        raise ValueError(f"max_tokens and temperature must be >= 0, got {max_tokens} and {temperature}")
    gen = torch.Generator().manual_seed(int(params.get("seed", 0)))
    context, out = list(ids), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = forward(torch.tensor([context[-seq_len:]], dtype=torch.long))[0, -1, : codec.vocab].float()
            if temperature == 0:
                token = int(torch.argmax(logits))
            else:
                token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
            if token in codec.stop_ids:
                break
            context.append(token)
            out.append(token)
    return out


with warnings.catch_warnings():
    # MLflow asks for type hints on predict; the logged column signature already describes the input
    warnings.simplefilter("ignore", UserWarning)

    class TextModel(PythonModel):
        def load_context(self, context: Any) -> None:
            config = dict(context.model_config)
            self.seq_len = int(config["seq_len"])
            self.codec = TextCodec(context.artifacts.get("tokenizer"))
            if "program" in context.artifacts:
                # MLflow unpickles unless told not to (its default allows it): a program is tensors, loaded with
                # the check on, and a store someone rewrote cannot run code here (served_forms.refusing_pickle)
                # (loads take turns: one thread's restore never lifts the refusal under another's load)
                with _PICKLE_LOCK:
                    before = os.environ.get("MLFLOW_ALLOW_PICKLE_DESERIALIZATION")
                    os.environ["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"] = "false"
                    try:
                        self.model = mlflow.pytorch.load_model(context.artifacts["program"], map_location="cpu")
                    finally:
                        if before is None:
                            os.environ.pop("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", None)
                        else:
                            os.environ["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"] = before
            else:  # the eager form: its code came with the model (code_paths)
                from training.servable import build_eager

                self.model = build_eager(config["eager"], context.artifacts["weights"])

        # no hints: MLflow would validate and convert the input by them
        def predict(self, context, model_input, params=None):
            params = params or {}
            completions = []
            for prompt in prompts_of(model_input):
                ids = self.codec.encode(prompt)
                completions.append(self.codec.decode(generate(self.model, ids, self.codec, self.seq_len, params)))
            return completions


mlflow.models.set_model(TextModel())
