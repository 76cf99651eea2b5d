"""Any model that trains must serve: validation logs the pt2 program, or the eager form when export cannot serve the
model, loads it back as serving will and runs it at serving shapes."""

from __future__ import annotations

import os

import pytest
import torch
from mlflow.exceptions import MlflowException
from support.train_support import build_byte_gru
from torch import nn

from training.chat_template import ChatFormat
from training.evaluate import NotServable
from training.servable import check_servable, eager_spec, load_served_model, log_servable_model, serving_shapes
from training.served_forms import mlflow_pytorch


class Causal(nn.Module):
    """A tiny causal byte model whose exported program keeps batch and time dynamic."""

    def __init__(self, vocab: int = 256) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


class SpecialisesOnLength(Causal):
    """Reshapes with the example's length as a constant: export bakes T=16 in, as a careless plug-in model might."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x)).reshape(x.shape[0], 16, 256)


def build_specialised(cfg) -> nn.Module:
    return SpecialisesOnLength()


def _logged(model: nn.Module, seq_len: int, factory: str = "", train_config: dict | None = None) -> str:
    import mlflow

    # the mlflow_store fixture's experiment: its artifacts go to the test's tmp dir, not ./mlruns
    with mlflow.start_run(experiment_id=mlflow.get_experiment_by_name("shardline-test").experiment_id):
        return log_servable_model(model.eval(), seq_len, factory=factory, train_config=train_config)


def _logged_models() -> list:
    import mlflow

    experiment = mlflow.get_experiment_by_name("shardline-test").experiment_id
    return mlflow.search_logged_models(experiment_ids=[experiment], output_format="list")


def test_serving_shapes_cover_one_token_to_a_full_batch():
    shapes = serving_shapes(32)
    assert (1, 1) in shapes and (1, 32) in shapes and (8, 32) in shapes and max(t for _, t in shapes) == 32


def test_a_servable_model_passes(mlflow_store):
    model = Causal()
    check_servable(_logged(model, 32), model, 32, "tests:Causal")


def test_a_model_that_cannot_serve_every_shape_is_rejected_before_registration(mlflow_store):
    """Neither form serves it (its own forward fails at T != 16): rejected, naming the shape, and neither logged
    model is left in the run."""
    from training.config import TrainConfig

    model, factory = SpecialisesOnLength(), f"{__name__}:build_specialised"
    with pytest.raises(NotServable, match=rf"train.model_factory='{factory}': the eagerly .*serving shape \[1, 1\]"):
        _logged(model, 32, factory, TrainConfig(seq_len=32).model_dump(mode="json"))
    assert _logged_models() == []
    with pytest.raises(NotServable, match=r"^the exported model fails at serving shape \[1, 1\]"):
        _logged(model, 32)  # no factory: the pt2 form only
    assert _logged_models() == []


def test_a_model_export_cannot_capture_is_served_eagerly_from_its_factory_and_weights(mlflow_store):
    """A byte-level GRU: torch.export specialises T to the example's 16, so the pt2 program fails at [1, 1]. It is
    logged eagerly instead (weights + TrainConfig), and that form answers at every serving shape: through
    load_served_model (validation, the champion comparison), the engine's backend (the endpoint) and
    mlflow.pyfunc."""
    import mlflow

    from deployments.engine import Recompute
    from deployments.model_server import load_backend, score_many
    from training.config import TrainConfig
    from training.servable import load_served_model

    cfg = TrainConfig(seq_len=32, d_model=16, model_factory="support.train_support:build_byte_gru")
    model = build_byte_gru(cfg).eval().requires_grad_(False)  # the served forms run without autograd too
    uri = _logged(model, 32, cfg.model_factory, cfg.model_dump(mode="json"))

    spec = eager_spec(uri)
    assert spec is not None and spec["factory"] == "support.train_support:build_byte_gru"
    assert spec["why"].startswith("the exported model fails at serving shape [1, 1]")
    assert [m.model_id for m in _logged_models()] == [uri.removeprefix("models:/")]  # the pt2 attempt is gone
    assert mlflow.models.get_model_info(uri).metadata["seq_len"] == 32

    x = torch.randint(0, 256, (3, 5))
    served = load_served_model(uri)
    assert torch.equal(served(x), model(x))

    backend = load_backend(uri, slots=2)
    assert isinstance(backend, Recompute)
    first = backend.prefill(0, list(b"def f"))
    assert torch.allclose(first[-1], model(torch.tensor([list(b"def f")]))[0, -1])
    step = backend.decode([0], [ord("(")])
    assert torch.allclose(step[0], model(torch.tensor([list(b"def f(")]))[0, -1])
    ((bits, n),) = score_many(backend.model, [b"import os\n"], 32)
    assert n == 9 and 0 < bits / n < 16

    # the registered pyfunc generates text: greedy, the model's own argmax byte after byte
    context = list(b"def f")
    for _ in range(4):
        context.append(int(model(torch.tensor([context]))[0, -1].argmax()))
    want = bytes(context[5:]).decode("utf-8", errors="replace")
    assert mlflow.pyfunc.load_model(uri).predict(["def f"], params={"max_tokens": 4}) == [want]


def test_validation_scores_the_champions_exported_program_like_the_eager_model(mlflow_store):
    """The champion is compared as served (a torch.export program refuses .eval()/.train()): same numbers."""
    from training.evaluate import bits_per_byte

    model = Causal()
    from training.servable import load_served_model

    exported = load_served_model(_logged(model, 32))
    assert eager_spec(_logged(model, 32)) is None  # export captures it: the pt2 program is what serves
    texts = [b"def main():\n    return 0\n" * 5, b"import os"]
    assert bits_per_byte(exported, texts, 32) == pytest.approx(bits_per_byte(model, texts, 32), rel=1e-5)


def test_a_model_over_a_tokenizers_ids_carries_its_tokenizer_in_either_form(mlflow_store):
    """The pt2 program and the eager form both carry the tokenizer their ids come from, fingerprinted, and its chat
    template; a byte model carries neither."""
    import mlflow

    from training import tokenizer as tk
    from training.chat_template import tokens_tag
    from training.config import TrainConfig
    from training.servable import served_chat, served_chat_format, served_chat_template, served_tokenizer

    tok = tk.train_bpe([b"def main():\n    return 0\n" * 20, b"import os\nimport sys\n" * 20], 270)
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    program = _logged_with(Causal(tok.get_vocab_size()), tok.to_str(), chat_template=template)
    cfg = TrainConfig(seq_len=32, d_model=16, vocab_size=300, model_factory="support.train_support:build_byte_gru")
    gru = build_byte_gru(cfg).eval().requires_grad_(False)
    eager = _logged_with(gru, tok.to_str(), cfg.model_factory, cfg.model_dump(mode="json"), template)
    assert eager_spec(program) is None and eager_spec(eager) is not None
    for uri in (program, eager):
        assert served_chat_template(uri) == template
        # the eos_token nobody named is the one the transformers flavor's tokenizer names: its end of text
        assert served_chat_format(uri) == ChatFormat(template, eos_token="<|endoftext|>")
        assert served_tokenizer(uri).to_str() == tok.to_str()
        meta = mlflow.models.get_model_info(uri).metadata["tokenizer"]
        assert meta["sha256"] == tk.fingerprint(tok) and meta["file"].endswith("/tokenizer.json")
    # named tokens the tokenizer has are kept; one it lacks is not (transformers would add it as a new id)
    named = ChatFormat(template, bos_token="<s>", eos_token=tk.END_OF_TEXT)
    logged = served_chat_format(_logged_with(Causal(tok.get_vocab_size()), tok.to_str(), chat_template=named))
    assert logged == ChatFormat(template, eos_token=tk.END_OF_TEXT)
    # what validation tags (shardline.chat_tokens) is what the version carries, without reading the model back
    assert served_chat(named, tok.to_str()) == logged and served_chat(named, "") == ChatFormat(template)
    assert tokens_tag(logged.tokens()) == '{"eos_token": "<|endoftext|>"}' and tokens_tag({}) == ""
    # no template: the tokens still travel, for serve.chat_template to render this version's chat with
    untemplated = served_chat_format(_logged_with(Causal(tok.get_vocab_size()), tok.to_str()))
    assert not untemplated and untemplated.tokens() == {"eos_token": tk.END_OF_TEXT}
    plain = _logged(Causal(), 32)
    assert served_tokenizer(plain) is None and served_chat_template(plain) == ""
    with pytest.raises(NotServable, match=r"^the tokenizer has 270 ids but the model predicts 256$"):
        _logged_with(Causal(), tok.to_str())  # an id the model has no logit for could never be scored or sampled


def _logged_with(
    model: nn.Module,
    tokenizer_json: str,
    factory: str = "",
    train_config: dict | None = None,
    chat_template: str | ChatFormat = "",
) -> str:
    import mlflow

    with mlflow.start_run(experiment_id=mlflow.get_experiment_by_name("shardline-test").experiment_id):
        return log_servable_model(
            model.eval(),
            32,
            factory=factory,
            train_config=train_config,
            tokenizer_json=tokenizer_json,
            chat_template=chat_template,
        )


class _Payload:
    """What a pickle can carry: a call run at load time (here it only records that it ran)."""

    ran: list[str] = []

    def __reduce__(self):
        return (_Payload.ran.append, ("the payload ran",))


def test_a_model_in_pickle_format_is_refused_and_runs_nothing(tmp_path, monkeypatch):
    """MLflow 3 unpickles a pickle-format `mlflow.pytorch` model unless MLFLOW_ALLOW_PICKLE_DESERIALIZATION is false
    (its default is true): a store someone could rewrite would run their code in a replica. The served form loads
    with it false, and leaves the variable as it was."""
    monkeypatch.delenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", raising=False)
    mlflow_pytorch().save_model(torch.nn.Linear(2, 2), tmp_path / "m", serialization_format="pickle")
    torch.save(_Payload(), tmp_path / "m" / "data" / "model.pth")
    with pytest.raises(MlflowException, match="Deserializing model using pickle is disallowed"):
        load_served_model(str(tmp_path / "m"))
    assert _Payload.ran == [] and "MLFLOW_ALLOW_PICKLE_DESERIALIZATION" not in os.environ


def test_a_model_that_names_code_is_refused_before_anything_of_it_is_on_sys_path(tmp_path):
    """Loading an `mlflow.pytorch` model puts its `code` folder first on sys.path for good; shardline logs none,
    so a model that names some was changed after it was logged."""
    import sys

    shadow = tmp_path / "json.py"  # would shadow a module imported after the load
    shadow.write_text("raise SystemExit('the shadowing module ran')\n")
    mlflow_pytorch().save_model(
        torch.nn.Linear(2, 2), tmp_path / "m", serialization_format="pickle", code_paths=[str(shadow)]
    )
    before = list(sys.path)
    with pytest.raises(ValueError, match=r"names code \('code'\) that loading would put on sys.path"):
        load_served_model(str(tmp_path / "m"))
    assert sys.path == before
