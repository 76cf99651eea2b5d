"""The served form of a trained model: logged to MLflow the way the endpoint loads it, and proven at serving shapes.

Every version predicts text from any Python process, `mlflow.pyfunc.load_model(uri).predict(texts)`, with the
model's tokenizer (metadata["tokenizer"]) inside it. What it carries is chosen per model by what works, never by
configuration:
- **transformers** (a `train.hf_config` model): MLflow's transformers flavor, a text-generation pipeline of the
  model's save_pretrained files and its tokenizer (training/transformers_form.py); loading it needs mlflow and
  transformers, nothing of shardline's. The endpoint rebuilds the model from its safetensors.
- every other model is one MLflow pyfunc from code (training/text_pyfunc.py: nothing pickled, nothing of
  shardline's imported for a captured model) over one of

  - **pt2** (the first choice): the model as a `torch.export` program with batch and time dynamic, an
    `mlflow.pytorch` model in the artifact named by metadata["program"]. Loading it unpickles nothing and needs
    none of the model's code.
  - **eager** (the fallback, for a transformers model too): when export fails, or its program does not answer at
    every serving shape (export specialised a dimension, as it does for an `nn.GRU`'s sequence length), the model
    is logged as its weights (plain tensors, read back with `weights_only=True`) and the TrainConfig its
    `train.model_factory` rebuilds it from. The factory's code reaches the Serve replicas the way the rest of the
    code does (the runtime env's PYTHONPATH or working_dir); a plain process gets it, with shardline's `training`
    and `infra`, from the model's code_paths.

What each form holds is training/served_forms.py. Either way validation loads the logged form back exactly as
serving will (`load_served_model`) and runs it at every serving shape against the trained model before anything is
registered; a model neither form can serve is `NotServable`, and nothing it logged is left behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from infra.redact import first_line
from training.chat_template import ChatFormat
from training.evaluate import NotServable
from training.hf_model import EAGER_HF, CausalLM
from training.served_forms import (
    CHAT_TEMPLATE,
    CHAT_TOKENS,
    EAGER_FACTORY,
    PROGRAM,
    TOKENIZER,
    example_ids,
    log_eager,
    log_hf,
    log_pt2,
    mlflow_pytorch,
    refusing_pickle,
)
from training.transformers_form import end_token, load_causal_lm_form, special_contents


def served_chat(chat_template: str | ChatFormat, tokenizer_json: str) -> ChatFormat:
    """The chat format a version logged with `tokenizer_json` carries (metadata["chat_template"] and
    metadata["chat_tokens"]; validation tags it too). The special tokens its template sees are special tokens the
    tokenizer has: transformers would add a missing one as a new id, and make an ordinary one special. An eos_token
    nobody named is the one the flavor's tokenizer names (training.transformers_form.end_token), so the endpoint
    and `apply_chat_template` on the flavor render alike. Bytes have no special tokens."""
    chat = ChatFormat.given(chat_template)
    if not tokenizer_json:
        return ChatFormat(chat.template)
    from training.tokenizer import Tokenizer

    special = special_contents(Tokenizer.from_str(tokenizer_json))
    known = {k: t for k, t in chat.tokens().items() if t in special}
    return ChatFormat.of(chat.template, {"eos_token": end_token(special) or "", **known})


def serving_shapes(seq_len: int) -> list[tuple[int, int]]:
    """[B, T] shapes the endpoint calls a model with: one token, a completion's growing context, scoring batches."""
    return sorted({(1, 1), (1, 2), (1, max(1, seq_len // 2) + 1), (1, seq_len), (3, 2), (8, seq_len)})


def vocab_of(model: nn.Module, seq_len: int) -> int:
    """The token ids `model` scores: the width of its logits on the example input (256 bytes, or a tokenizer's
    ids). Served inputs are ids below it, and the served form must answer with as many logits."""
    with torch.no_grad():
        return int(model(example_ids(seq_len)).shape[-1])


def _discard(model_uri: str) -> None:
    """Delete a logged model validation will not use (models:/m-<id>), so nothing rejected stays in the run."""
    import mlflow

    model_id = model_uri.removeprefix("models:/")
    if model_id.startswith("m-"):
        mlflow.MlflowClient().delete_logged_model(model_id)


def log_servable_model(
    model: nn.Module,
    seq_len: int,
    name: str = "model",
    factory: str = "",
    train_config: dict | None = None,
    tokenizer_json: str = "",
    chat_template: ChatFormat | str = "",
) -> str:
    """Log `model` (eval mode, plain: no FSDP) to the active MLflow run in a form serving loads, prove that form at
    every serving shape, and return its models:/ URI: the transformers flavor for a transformers model, else the pt2
    program when it serves; failing those, the eager form (module docstring). Input int64 [B, T] token ids (bytes,
    or a tokenizer's) with T <= seq_len, output float32 logits [B, T, vocab]; metadata["seq_len"] and
    metadata["vocab_size"] record both.

    Args:
        factory, train_config: `train.model_factory` and the TrainConfig (as JSON) that rebuild the model; without
            them only the first form (the transformers flavor or pt2) is tried.
        tokenizer_json: the tokenizer whose ids the model predicts ('' for bytes): logged inside the model, with
            metadata["tokenizer"] naming the file and its fingerprint, so a version carries what decodes it
            (`served_tokenizer`).
        chat_template: the tokenizer's chat format, or a bare template ('' for none): metadata["chat_template"]
            and metadata["chat_tokens"], what the endpoint renders chat requests to this version with
            (`served_chat_format`). Only special tokens the tokenizer has are kept (none for bytes), so the
            endpoint and transformers' `apply_chat_template` on the flavor render alike.

    Raises:
        NotServable: neither form answers at every serving shape (naming the factory, the shape and the cause).
    """
    who = f"train.model_factory={factory!r}: " if factory else ""
    try:
        vocab = vocab_of(model, seq_len)
    except Exception as e:  # noqa: BLE001 - a model that fails on the example cannot serve in any form
        shape = tuple(example_ids(seq_len).shape)
        raise NotServable(f"{who}the model fails on the example input {list(shape)}: {first_line(e)}") from None
    if tokenizer_json:
        from training.tokenizer import Tokenizer, id_count

        ids = id_count(Tokenizer.from_str(tokenizer_json))
        if ids > vocab:
            raise NotServable(f"{who}the tokenizer has {ids} ids but the model predicts {vocab}")
    chat = served_chat(chat_template, tokenizer_json)
    first = log_hf if type(model) is CausalLM else log_pt2
    try:
        uri = first(model, seq_len, name, vocab, tokenizer_json, chat)
    except Exception as e:  # noqa: BLE001 - any failure of the first form: the eager form is tried next
        what = "torch.export" if first is log_pt2 else "the transformers flavor"
        why = f"{what} failed: {first_line(e)}"
    else:
        try:
            check_servable(uri, model, seq_len, factory)
            return uri
        except NotServable as e:
            _discard(uri)
            why = str(e).removeprefix(who)
    if not factory or train_config is None:
        raise NotServable(f"{who}{why}")
    uri = log_eager(model, seq_len, name, factory, train_config, why, vocab, tokenizer_json, chat)
    try:
        check_servable(uri, model, seq_len, factory)
    except NotServable:
        _discard(uri)
        raise
    return uri


def build_eager(spec: dict, weights_path: str) -> nn.Module:
    """The model of an eager spec (metadata[EAGER_FACTORY]): its factory called with its TrainConfig, then its
    weights loaded (tensors only), in eval mode and without autograd (a served model never trains, and a GRU takes
    a different kernel when its weights require grad, whose logits differ from the validated ones in the last bits).

    Raises:
        ValueError: the factory does not import (naming it); RuntimeError: the weights do not fit the model.
    """
    from training.config import TrainConfig, load_object

    model = load_object(spec["factory"], "train.model_factory")(TrainConfig(**spec["train_config"]))
    model.load_state_dict(torch.load(weights_path, map_location="cpu", weights_only=True))
    return model.eval().requires_grad_(False)


def eager_spec(model_uri: str) -> dict | None:
    """metadata[EAGER_FACTORY] of a logged model, or None for a pt2 program."""
    import mlflow

    return (mlflow.models.get_model_info(model_uri).metadata or {}).get(EAGER_FACTORY)


def model_file(model_uri: str, relative: str) -> str:
    """A local copy of one file of a logged model (`models:/NAME/VERSION`, `models:/NAME@alias` or `models:/m-<id>`),
    by way of the store the model's artifacts are in."""
    import mlflow
    from mlflow.store.artifact.models_artifact_repo import ModelsArtifactRepository

    root = ModelsArtifactRepository.get_underlying_uri(model_uri)
    return str(mlflow.artifacts.download_artifacts(artifact_uri=f"{root.rstrip('/')}/{relative}"))


def served_tokenizer(model_uri: str) -> Any:
    """The tokenizer a logged model predicts the ids of (a `tokenizers.Tokenizer`), or None for a byte model.

    Raises:
        ValueError: the file in the model is not the tokenizer its metadata fingerprints (one line).
    """
    import mlflow

    spec = (mlflow.models.get_model_info(model_uri).metadata or {}).get(TOKENIZER)
    if not spec:
        return None
    from training.tokenizer import fingerprint_json, load

    path = model_file(model_uri, spec["file"])
    if fingerprint_json(Path(path).read_text(encoding="utf-8")) != spec["sha256"]:
        raise ValueError(f"{model_uri}: {spec['file']} is not the tokenizer sha256 {spec['sha256'][:12]} it names")
    return load(path)


def served_chat_format(model_uri: str) -> ChatFormat:
    """The chat format a logged model's tokenizer carries (metadata["chat_template"] with metadata["chat_tokens"]),
    false for none."""
    import mlflow

    metadata = mlflow.models.get_model_info(model_uri).metadata or {}
    return ChatFormat.of(str(metadata.get(CHAT_TEMPLATE) or ""), metadata.get(CHAT_TOKENS))


def served_chat_template(model_uri: str) -> str:
    """The chat template a logged model's tokenizer carries (metadata["chat_template"]), or ''."""
    return served_chat_format(model_uri).template


def load_served_model(model_uri: str) -> Any:
    """The logged model as the endpoint runs it, a callable int64 [B, T] -> logits [B, T, vocab]: a transformers
    model from its flavor's safetensors, the pt2 program, or the eager model rebuilt by the installed factory from its
    weights file alone (the code logged with the pyfunc is never run here: a store that could rewrite it could make
    MLflow unpickle instead)."""
    import mlflow

    metadata = mlflow.models.get_model_info(model_uri).metadata or {}
    if spec := metadata.get(EAGER_FACTORY):
        return build_eager(spec, model_file(model_uri, spec["weights"]))
    if (hf := metadata.get(EAGER_HF)) and "weights_dir" in hf:  # the transformers flavor
        return load_causal_lm_form(hf, int(metadata["seq_len"]), model_file(model_uri, hf["weights_dir"]))
    if program := metadata.get(PROGRAM):
        local = model_file(model_uri, program)
    else:  # registered before the text form: the model is the pt2 program itself
        local = str(mlflow.artifacts.download_artifacts(artifact_uri=model_uri))
    with refusing_pickle():
        return mlflow_pytorch().load_model(code_free(local), map_location="cpu")


def code_free(local_dir: str) -> str:
    """`local_dir`, an `mlflow.pytorch` model, when its MLmodel names no code: loading puts a model's `code`
    folder first on sys.path for the rest of the process, where it would shadow modules imported after it.
    shardline never logs a pt2 program with code; a store that was rewritten to add some is refused (ValueError)."""
    from mlflow.models import Model

    code = Model.load(local_dir).flavors.get("pytorch", {}).get("code")
    if code:
        raise ValueError(
            f"{local_dir}: its pytorch flavor names code ({code!r}) that loading would put on sys.path; shardline "
            "logs none, so this model was changed after it was logged: refusing to load it"
        )
    return local_dir


def check_servable(model_uri: str, eager: nn.Module, seq_len: int, factory: str = "") -> None:
    """Load the logged model back as serving will and run it at every serving shape against the trained model.

    Raises:
        NotServable: naming the model factory, the form, the shape and the cause (a failed guard, other logits).
    """
    import mlflow

    metadata = mlflow.models.get_model_info(model_uri).metadata or {}
    form = (
        "the eagerly served model"
        if EAGER_FACTORY in metadata
        else "the transformers model"
        if "weights_dir" in (metadata.get(EAGER_HF) or {})
        else "the exported model"
    )
    who = f"train.model_factory={factory!r}: " if factory else ""
    try:
        loaded = load_served_model(model_uri)
    except Exception as e:  # noqa: BLE001 - a form that does not load cannot serve
        raise NotServable(f"{who}{form} does not load: {first_line(e)}") from None
    gen, vocab = torch.Generator().manual_seed(0), vocab_of(eager, seq_len)
    for b, t in serving_shapes(seq_len):
        x = torch.randint(0, vocab, (b, t), generator=gen)
        try:
            with torch.no_grad():
                got, want = loaded(x), eager(x)
        except Exception as e:  # noqa: BLE001 - any failure here means the endpoint would fail the same way
            raise NotServable(f"{who}{form} fails at serving shape [{b}, {t}]: {first_line(e)}") from None
        if tuple(got.shape) != (b, t, vocab) or not torch.allclose(got.float(), want.float(), atol=1e-3, rtol=1e-3):
            raise NotServable(
                f"{who}{form}'s logits at shape [{b}, {t}] differ from the trained model's (shape {tuple(got.shape)})"
            )
