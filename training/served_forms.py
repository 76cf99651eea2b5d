"""What a registered version holds (training/servable.py decides which form, and proves it): for a transformers
model, MLflow's transformers flavor (training/transformers_form.py); for any other, the MLflow pyfunc from code of
training/text_pyfunc.py over either the model's pt2 program (an `mlflow.pytorch` model in the artifact
metadata["program"] names) or its eager weights with the code that rebuilds it; each with its tokenizer.json and the
metadata every consumer reads (seq_len, vocab_size, tokenizer, chat_template, the eager specs) and the paths it
names."""

from __future__ import annotations

import importlib
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from infra.environ import overridden
from training.chat_template import NO_CHAT, ChatFormat

# metadata[EAGER_FACTORY] of an eagerly served model: {"factory", "train_config", "weights", "why"}
EAGER_FACTORY = "eager_factory"
# metadata[TOKENIZER] of a model over a tokenizer's ids: {"file": its tokenizer.json in the model, "sha256"}
TOKENIZER = "tokenizer"
TOKENIZER_FILE = "tokenizer.json"
# metadata[CHAT_TEMPLATE] of a model whose tokenizer has a chat template: its Jinja text (training.chat_template)
CHAT_TEMPLATE = "chat_template"
# metadata[CHAT_TOKENS] beside it: the special tokens the template sees ({"bos_token", "eos_token"}, those named)
CHAT_TOKENS = "chat_tokens"
EAGER_STATE_FILE = "state_dict.pt"
TEXT_CODE = Path(__file__).with_name("text_pyfunc.py")
# metadata[PROGRAM] of a model export captured: the `mlflow.pytorch` pt2 model inside it
PROGRAM = "program"
PROGRAM_DIR = "program"
# TrainConfig keys an eager form leaves out: where the first weights came from does not rebuild the model
NOT_FOR_REBUILD = ("hf_weights", "init_from")


_LIGHTNING_AUTOLOG = "mlflow.pytorch._lightning_autolog"
_ALLOW_PICKLE = "MLFLOW_ALLOW_PICKLE_DESERIALIZATION"
_PICKLE_LOCK = threading.RLock()


def mlflow_pytorch() -> ModuleType:
    """`mlflow.pytorch`, imported without its Lightning autologging.

    Importing `mlflow.pytorch` imports `pytorch_lightning` (with torchmetrics) whenever it is installed, as it is
    here for `train.loop = "lightning"`, only to offer `MlflowModelCheckpointCallback`: about 2.3 s of a
    validation stage and 2.4 s of a model replica's cold start on 2 cores, for a module shardline never uses. The
    first import here sees that submodule as absent (a None in sys.modules, which makes its `from ... import` an
    ImportError mlflow catches), and the entry is removed at once, so `mlflow.pytorch.autolog()` still imports it
    when someone calls it. Everything else of `mlflow.pytorch` is the same module."""
    if "mlflow.pytorch" in sys.modules:
        return sys.modules["mlflow.pytorch"]
    sys.modules[_LIGHTNING_AUTOLOG] = None  # type: ignore[assignment]  # None in sys.modules: "not importable"
    try:
        return importlib.import_module("mlflow.pytorch")
    finally:
        del sys.modules[_LIGHTNING_AUTOLOG]


@contextmanager
def refusing_pickle() -> Iterator[None]:
    """`mlflow.pytorch.load_model` with pickle refused: MLflow 3 unpickles a model saved in pickle format, and does
    not check a pt2 archive for pickled payloads, unless MLFLOW_ALLOW_PICKLE_DESERIALIZATION is false (its default
    is true), so a registry entry or artifact store someone could write would run their code in a replica or a
    validation. shardline's programs are pt2 archives of tensors, which load with the check on. The variable is set
    for the call and restored after it (a user's own setting elsewhere in the process is theirs); such loads take
    turns (a lock), so one thread's restore never lifts the refusal under another's load."""
    with _PICKLE_LOCK, overridden(_ALLOW_PICKLE, "false"):
        yield


def example_ids(seq_len: int) -> torch.Tensor:
    """The input example a logged model carries: [2, T] ids of real text, B and T > 1 so that torch.export keeps
    both dimensions dynamic."""
    text = b"def main():\n    return 0\n"[: min(16, seq_len)] * 2
    return torch.tensor(list(text), dtype=torch.long).reshape(2, -1)


def _signature(vocab: int) -> Any:
    """The pt2 program's signature: int64 ids [B, T] in, float32 logits [B, T, vocab] out."""
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    return ModelSignature(
        inputs=Schema([TensorSpec(np.dtype("int64"), (-1, -1))]),
        outputs=Schema([TensorSpec(np.dtype("float32"), (-1, -1, vocab))]),
    )


# the generation params each registered form takes: training/text_pyfunc.py's, and the transformers pipeline's
TEXT_PARAMS = (("max_tokens", "long", 16), ("temperature", "double", 0.0), ("seed", "long", 0))
PIPELINE_PARAMS = (("max_new_tokens", "long", 16), ("do_sample", "boolean", False), ("temperature", "double", 1.0))


def _text_signature(params: tuple[tuple[str, str, Any], ...] = TEXT_PARAMS) -> Any:
    """A registered model's signature: prompts in, completions out, and its generation params (name, type, default)."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string")]),
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema([ParamSpec(name, kind, default) for name, kind, default in params]),
    )


def _requirements(tokenizer_json: str = "", *modules: str) -> list[str]:
    """pip pins of a registered form: torch and mlflow, tokenizers with a tokenizer, and `modules` as installed."""
    import importlib

    import mlflow

    pins = [f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}", "numpy", "pandas"]
    for module in (*(("tokenizers",) if tokenizer_json else ()), *modules):
        pins.append(f"{module}=={importlib.import_module(module).__version__}")
    return pins


def _tokenizer_file(tmp: str, tokenizer_json: str) -> dict[str, str]:
    """{"tokenizer": the tokenizer written where a logged model's files are gathered}, or {} without one."""
    if not tokenizer_json:
        return {}
    path = Path(tmp) / TOKENIZER_FILE
    path.write_text(tokenizer_json, encoding="utf-8")
    return {"tokenizer": str(path)}


def _tokenizer_metadata(
    tokenizer_json: str, chat: ChatFormat = NO_CHAT, file: str = f"artifacts/{TOKENIZER_FILE}"
) -> dict:
    """metadata[TOKENIZER] ({"file": where the form logs it, "sha256"}), metadata[CHAT_TEMPLATE] and
    metadata[CHAT_TOKENS], each only when there is one (tokens also without a template)."""
    from training.tokenizer import fingerprint_json

    out: dict = {CHAT_TEMPLATE: chat.template} if chat else {}
    if chat.tokens():  # also without a template: serve.chat_template renders a version's chat with them
        out[CHAT_TOKENS] = chat.tokens()
    if tokenizer_json:
        out[TOKENIZER] = {"file": file, "sha256": fingerprint_json(tokenizer_json)}
    return out


def _log_text_pyfunc(name: str, artifacts: dict[str, str], metadata: dict, config: dict, **kwargs: Any) -> str:
    """Log the registered form: training/text_pyfunc.py over `artifacts` (pyfunc artifacts land in artifacts/<file
    name>, which is what `metadata`'s paths name)."""
    import mlflow

    info = mlflow.pyfunc.log_model(
        name=name,
        python_model=str(TEXT_CODE),
        artifacts=artifacts,
        model_config=config,
        signature=_text_signature(),
        input_example=["def main():"],
        metadata=metadata,
        **kwargs,
    )
    return info.model_uri


def log_pt2(
    model: nn.Module, seq_len: int, name: str, vocab: int, tokenizer_json: str = "", chat: ChatFormat = NO_CHAT
) -> str:
    """The model as a pt2 program (batch and time dynamic), an `mlflow.pytorch` model in the artifact `program`
    (metadata["program"]). The built-in GPT also gets its weights as an extra file and metadata[EAGER_METADATA] =
    {"config", "weights"}: a program cannot carry a KV cache, so serving rebuilds the eager model from them and
    decodes incrementally."""
    from training.model import EAGER_METADATA, EAGER_WEIGHTS_FILE, GPT, save_weights

    metadata: dict = {"seq_len": seq_len, "vocab_size": vocab, PROGRAM: f"artifacts/{PROGRAM_DIR}"}
    with tempfile.TemporaryDirectory() as tmp:
        program = str(Path(tmp) / PROGRAM_DIR)
        mlflow_pytorch().save_model(
            model.eval(),
            program,
            serialization_format="pt2",
            signature=_signature(vocab),
            input_example=example_ids(seq_len).numpy(),
            pip_requirements=_requirements(),
        )
        artifacts = {PROGRAM_DIR: program, **_tokenizer_file(tmp, tokenizer_json)}
        metadata |= _tokenizer_metadata(tokenizer_json, chat)
        if type(model) is GPT:  # exactly the built-in class: a subclass may decode differently
            save_weights(model, str(Path(tmp) / EAGER_WEIGHTS_FILE))
            artifacts["eager_weights"] = str(Path(tmp) / EAGER_WEIGHTS_FILE)
            metadata[EAGER_METADATA] = {"config": model.config(), "weights": f"artifacts/{EAGER_WEIGHTS_FILE}"}
        return _log_text_pyfunc(
            name, artifacts, metadata, {"seq_len": seq_len}, pip_requirements=_requirements(tokenizer_json)
        )


def log_hf(
    model: nn.Module, seq_len: int, name: str, vocab: int, tokenizer_json: str = "", chat: ChatFormat = NO_CHAT
) -> str:
    """A transformers model (training.hf_model.CausalLM) as MLflow's transformers flavor
    (training/transformers_form.py), its tokenizer.json logged as it was trained for the endpoint and lineage; a
    chat template is also the flavor's tokenizer's, so `apply_chat_template` works on the loaded pipeline."""
    from training.transformers_form import TOKENIZER_PATH, log_transformers

    metadata = {
        "seq_len": seq_len,
        "vocab_size": vocab,
        **_tokenizer_metadata(tokenizer_json, chat, file=TOKENIZER_PATH),
    }
    pins = _requirements("", "tokenizers", "transformers")  # the pipeline's fast tokenizer, bytes included
    signature = _text_signature(PIPELINE_PARAMS)
    return log_transformers(model, name, metadata, signature, pins, tokenizer_json, chat)


def _code_paths(factory: str) -> list[str]:
    """What rebuilds an eager model outside the checkout: shardline's `training` and `infra` packages and the
    factory's top-level package or module (when it is neither)."""
    import importlib.util

    root = Path(__file__).resolve().parent
    paths = [str(root), str(root.parent / "infra")]
    top = factory.split(":", 1)[0].split(".", 1)[0]
    if top not in ("training", "infra"):
        spec = importlib.util.find_spec(top)
        if spec is not None and spec.submodule_search_locations:
            paths.append(str(list(spec.submodule_search_locations)[0]))
        elif spec is not None and spec.origin:
            paths.append(spec.origin)
    return paths


def log_eager(
    model: nn.Module,
    seq_len: int,
    name: str,
    factory: str,
    train_config: dict,
    why: str,
    vocab: int,
    tokenizer_json: str = "",
    chat: ChatFormat = NO_CHAT,
) -> str:
    """The model as its weights plus what rebuilds it (factory and TrainConfig), with the code that does so."""
    train_config = {k: v for k, v in train_config.items() if k not in NOT_FOR_REBUILD}
    spec = {"factory": factory, "train_config": train_config, "weights": f"artifacts/{EAGER_STATE_FILE}", "why": why}
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / EAGER_STATE_FILE
        torch.save({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, weights)
        metadata = {
            "seq_len": seq_len,
            "vocab_size": vocab,
            EAGER_FACTORY: spec,
            **_tokenizer_metadata(tokenizer_json, chat),
        }
        return _log_text_pyfunc(
            name,
            {"weights": str(weights), **_tokenizer_file(tmp, tokenizer_json)},
            metadata,
            {"seq_len": seq_len, "eager": spec},
            pip_requirements=[*_requirements(tokenizer_json), "pydantic"],
            code_paths=_code_paths(factory),
        )
