"""`train.hf_config`: a transformers causal LM built from its config (never from a hub), sharded per declared
decoder layer, served in the form validation proves, and every bad config refused in one line at config load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.train_support import TINY_LLAMA

from flows.config import ConfigError, load_config
from training.config import TrainConfig, load_object
from training.hf_model import HF_FACTORY
from training.model import flops_per_token
from training.parallelize import _blocks, apply_ac


def _model(spec: dict = TINY_LLAMA, seq_len: int = 32):
    cfg = TrainConfig(seq_len=seq_len, hf_config=spec)
    torch.manual_seed(0)
    return cfg, load_object(cfg.model_factory, "train.model_factory")(cfg)


def test_an_inline_config_builds_the_transformers_model_behind_the_byte_interface():
    cfg, model = _model()
    assert cfg.model_factory == HF_FACTORY and type(model.lm).__name__ == "LlamaForCausalLM"
    logits = model(torch.randint(0, 256, (3, 7)))
    assert logits.shape == (3, 7, 256)
    # FSDP2 and activation checkpointing find the layers the model declares (_no_split_modules), wrapped or not
    layers = _blocks(model)
    assert layers is model.lm.model.layers and [type(x).__name__ for x in layers] == ["LlamaDecoderLayer"] * 2
    apply_ac(model)
    assert _blocks(model) is model.lm.model.layers and type(layers[0]).__name__ == "CheckpointWrapper"
    # MFU's formula: 6N + 12 L d T, N without the input embedding (the untied head counts)
    n = sum(p.numel() for p in model.parameters()) - 256 * 32
    assert flops_per_token(model, 32) == 6.0 * n + 12.0 * 2 * 32 * 32


def test_a_config_json_is_read_once_and_kept_inline(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    (tmp_path / "run.toml").write_text(f'[train]\nseq_len = 32\nhf_config = "{path}"\n')
    cfg = load_config(tmp_path / "run.toml").train
    assert cfg.hf_config == TINY_LLAMA and cfg.model_factory == HF_FACTORY
    path.unlink()  # workers, parameters and the registered model carry the config, not the file
    assert TrainConfig.model_validate(cfg.model_dump()).hf_config == TINY_LLAMA


@pytest.mark.parametrize(
    ("hf_config", "message"),
    [
        ('{ model_type = "nonesuch" }', "model_type 'nonesuch' is not an architecture transformers knows"),
        ('{ model_type = "vit" }', "model_type 'vit' is not a causal language model"),
        ("{ vocab_size = 256 }", "needs model_type"),
        ('{ model_type = "llama", vocab_size = 100 }', "vocab_size 100 is smaller than the 256 byte tokens"),
        (
            '{ model_type = "llama", max_position_embeddings = 16 }',
            "max_position_embeddings 16 is shorter than train.seq_len 32",
        ),
        ('"CONFIG"', "not a JSON config"),
        ('"MISSING"', "MISSING: cannot read it"),
    ],
)
def test_a_bad_hf_config_is_one_line_at_config_load(tmp_path, hf_config, message):
    (tmp_path / "bad.json").write_text('{"model_type": "llama",')  # cut short: does not parse
    hf_config = hf_config.replace("CONFIG", str(tmp_path / "bad.json")).replace("MISSING", str(tmp_path / "no.json"))
    (tmp_path / "run.toml").write_text(f"[train]\nseq_len = 32\nhf_config = {hf_config}\n")
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "run.toml")
    text = str(err.value)
    assert len(text.splitlines()) == 1 and "train.hf_config" in text and message.replace("MISSING", "") in text


def test_hf_config_and_another_model_factory_are_refused_together(tmp_path):
    (tmp_path / "run.toml").write_text(
        '[train]\nseq_len = 32\nmodel_factory = "training.model:build_gpt_x"\n'
        'hf_config = { model_type = "llama", max_position_embeddings = 64 }\n'
    )
    with pytest.raises(ConfigError, match="both name the model; set one"):
        load_config(tmp_path / "run.toml")


def test_the_transformers_model_serves_in_the_form_validation_proves(mlflow_store):
    """Logged as validation logs it (a pt2 program when torch.export captures it, else the eager form); loaded back
    as the endpoint loads it, it gives the trained model's logits. Its chat template is the endpoint's and the
    flavor's tokenizer's."""
    import mlflow

    from training.servable import load_served_model, log_servable_model, model_file, served_chat_template

    cfg, model = _model()
    model.eval().requires_grad_(False)
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    with mlflow.start_run(experiment_id=mlflow_store[1]):
        uri = log_servable_model(
            model, 32, factory=cfg.model_factory, train_config=cfg.model_dump(mode="json"), chat_template=template
        )
    x = torch.randint(0, 256, (2, 9))
    assert torch.allclose(load_served_model(uri)(x), model(x), atol=1e-4)
    assert served_chat_template(uri) == template
    # transformers saves it as chat_template.jinja beside the tokenizer (where training.chat_template looks first)
    assert Path(model_file(uri, "components/tokenizer/chat_template.jinja")).read_text() == template


def test_the_flavors_tokenizer_renders_chat_as_the_endpoint_does(mlflow_store):
    """A template with bos_token and eos_token, over a trained BPE: transformers' apply_chat_template on the
    tokenizer the flavor saved gives the prompt the endpoint renders (training.chat_template with the version's
    tokens). A named token the tokenizer lacks is dropped on both sides; the unnamed eos is the flavor's."""
    import mlflow
    from transformers import AutoTokenizer

    from training import tokenizer as tk
    from training.chat_template import ChatFormat, render
    from training.servable import log_servable_model, model_file, served_chat_format

    bpe = tk.train_bpe([b"def main():\n    return 0\n" * 20, b"import os\nimport sys\n" * 20], 270)
    cfg = TrainConfig(seq_len=32, hf_config={**TINY_LLAMA, "vocab_size": 272}, vocab_size=272)
    model = load_object(cfg.model_factory, "train.model_factory")(cfg).eval().requires_grad_(False)
    template = "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}\n{% endfor %}"
    with mlflow.start_run(experiment_id=mlflow_store[1]):
        uri = log_servable_model(
            model,
            32,
            factory=cfg.model_factory,
            train_config=cfg.model_dump(mode="json"),
            tokenizer_json=bpe.to_str(),
            chat_template=ChatFormat(template, bos_token="<s>"),
        )
    carried = served_chat_format(uri)
    assert carried == ChatFormat(template, eos_token=tk.END_OF_TEXT)
    messages = [{"role": "user", "content": "def"}, {"role": "assistant", "content": "main"}]
    flavor = AutoTokenizer.from_pretrained(model_file(uri, "components/tokenizer"))  # a local directory
    assert flavor.apply_chat_template(messages, tokenize=False) == render(carried, messages)
    assert render(carried, messages) == f"user: def{tk.END_OF_TEXT}\nassistant: main{tk.END_OF_TEXT}\n"


def _saved(tmp_path, spec: dict = TINY_LLAMA):
    """A tiny Llama written by transformers' own save_pretrained (config.json + model.safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kind = spec["model_type"]
    torch.manual_seed(7)
    config = AutoConfig.for_model(kind, **{k: v for k, v in spec.items() if k != "model_type"})
    lm = AutoModelForCausalLM.from_config(config)
    lm.save_pretrained(tmp_path / "pretrained")
    return tmp_path / "pretrained", lm.state_dict()


def test_hf_weights_start_the_model_from_a_save_pretrained_directory(tmp_path):
    from training.hf_model import load_pretrained

    directory, saved = _saved(tmp_path)
    cfg = TrainConfig(seq_len=32, hf_weights=str(directory))
    assert cfg.hf_config["hidden_size"] == 32 and cfg.model_factory == HF_FACTORY  # the directory's config.json
    model = load_object(cfg.model_factory, "train.model_factory")(cfg)
    assert not torch.equal(model.lm.state_dict()["model.embed_tokens.weight"], saved["model.embed_tokens.weight"])
    load_pretrained(model, cfg.hf_weights)
    assert all(torch.equal(model.lm.state_dict()[k], v) for k, v in saved.items())
    # weights of another shape than the config: one line naming the directory
    wider = TrainConfig(seq_len=32, hf_weights=str(directory), hf_config={**TINY_LLAMA, "intermediate_size": 96})
    with pytest.raises(ValueError, match=rf"^train.hf_weights={directory}: .*size mismatch"):
        load_pretrained(load_object(wider.model_factory, "f")(wider), str(directory))


def test_a_weights_directory_missing_files_is_one_line_at_config_load(tmp_path):
    directory, _ = _saved(tmp_path)
    (directory / "model.safetensors").rename(directory / "pytorch_model.bin")  # as if saved with pickle
    (tmp_path / "run.toml").write_text(f'[train]\nseq_len = 32\nhf_weights = "{directory}"\n')
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "run.toml")
    assert len(str(err.value).splitlines()) == 1
    assert "train.hf_weights" in str(err.value) and "missing model.safetensors (pytorch_model.bin is pickle" in str(
        err.value
    )
    (directory / "config.json").unlink()
    with pytest.raises(ConfigError, match="missing config.json"):
        load_config(tmp_path / "run.toml")


@pytest.mark.parametrize(
    ("index", "why"),
    [
        ('{"weight_map": null}', "not a safetensors index"),
        ("[]", "not a safetensors index"),
        ('{"weight_map": {"a": {"x": 1}}}', "not a safetensors index"),
        ("{nope", "not JSON (Expecting property name"),
    ],
)
def test_a_broken_safetensors_index_is_one_line_naming_it_at_config_load(tmp_path, index, why):
    directory, _ = _saved(tmp_path)
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ConfigError) as err:
        load_config(None, [f'train.hf_weights="{directory}"', "train.seq_len=32"])
    (line,) = str(err.value).splitlines()
    assert f"{directory}/model.safetensors.index.json: {why}" in line


def test_a_transformers_model_decodes_with_its_kv_cache_as_it_recomputes(mlflow_store):
    """Validation logs a transformers model as MLflow's transformers flavor; the endpoint's backend is the KV-cached
    model rebuilt from its safetensors. Greedy completions through the engine equal recomputing the window while they
    fit in it."""
    import asyncio
    from contextlib import aclosing

    import mlflow

    from deployments.engine import Engine
    from deployments.generation import Completion, generate, merge_logprobs
    from deployments.kv_cache_hf import CachedCausalLM
    from deployments.model_server import load_backend
    from training.servable import log_servable_model

    cfg, model = _model()
    model.eval().requires_grad_(False)
    with torch.no_grad():
        model.lm.lm_head.weight.mul_(30.0)  # sharper logits: greedy choices are not near-ties
    with mlflow.start_run(experiment_id=mlflow_store[1]):
        uri = log_servable_model(model, 32, factory=cfg.model_factory, train_config=cfg.model_dump(mode="json"))
    info = mlflow.models.get_model_info(uri)
    assert "transformers" in info.flavors and info.flavors["python_function"]["loader_module"] == "mlflow.transformers"
    version = mlflow.register_model(uri, "tiny-llama").version
    backend = load_backend(f"models:/tiny-llama/{version}", slots=2)
    assert isinstance(backend, CachedCausalLM)

    async def greedy(prompt: bytes, n: int) -> list[str]:
        async with aclosing(Engine(backend).stream(prompt, Completion(n, temperature=0.0, logprobs=0))) as events:
            out = [e async for e in events]
        return merge_logprobs([e["logprobs"] for e in out if "text" in e])["tokens"]

    def recomputed(prompt: bytes, n: int) -> list[str]:
        events = list(generate(model, prompt, 32, n, temperature=0.0, logprobs=0))
        return merge_logprobs([e["logprobs"] for e in events if "text" in e])["tokens"]

    prompt = b"def main():"
    assert asyncio.run(greedy(prompt, 32 - len(prompt) + 1)) == recomputed(prompt, 32 - len(prompt) + 1)
    # one-token steps of the cache give the logits of the whole window at its last position
    first = backend.prefill(0, list(b"import o"))
    assert torch.allclose(first, model(torch.tensor([list(b"import o")]))[0], atol=1e-4)
    step = backend.decode([0], [ord("s")])
    assert torch.allclose(step[0], model(torch.tensor([list(b"import os")]))[0, -1], atol=1e-4)


def test_a_transformers_model_on_a_tokenizers_ids_trains_and_serves_every_id(mlflow_store):
    """With a tokenizer's 300 ids (train.vocab_size, as fit_vocabulary sets it) and an embedding padded to 320, the
    model trains on ids past the 256 bytes, and validation logs, and the endpoint serves, all 300 logits."""
    import mlflow

    from deployments.kv_cache_hf import CachedCausalLM
    from deployments.model_server import check_backend, load_backend
    from training.servable import load_served_model, log_servable_model

    cfg = TrainConfig(seq_len=32, hf_config={**TINY_LLAMA, "vocab_size": 320}, vocab_size=300)
    torch.manual_seed(0)
    model = load_object(cfg.model_factory, "train.model_factory")(cfg)
    ids = torch.randint(256, 300, (2, 9))  # only ids a byte model never sees
    logits = model(ids[:, :-1])
    assert logits.shape == (2, 8, 300)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), ids[:, 1:].reshape(-1))
    loss.backward()
    assert torch.isfinite(loss) and model.lm.get_input_embeddings().weight.grad[256:300].abs().sum() > 0
    model.eval().requires_grad_(False)
    with mlflow.start_run(experiment_id=mlflow_store[1]):
        uri = log_servable_model(model, 32, factory=cfg.model_factory, train_config=cfg.model_dump(mode="json"))
    info = mlflow.models.get_model_info(uri)
    assert info.metadata["vocab_size"] == 300 and load_served_model(uri)(ids[:, :-1]).shape == (2, 8, 300)
    version = mlflow.register_model(uri, "tiny-llama-bpe").version
    backend = load_backend(f"models:/tiny-llama-bpe/{version}", slots=1)
    assert isinstance(backend, CachedCausalLM)
    check_backend(f"models:/tiny-llama-bpe/{version}", model, 32)  # cached decoding of ids up to 299 = forward
    assert backend.prefill(0, [299, 257, 3]).shape == (3, 300) and backend.decode([0], [298]).shape == (1, 300)


def test_the_flavors_tokenizer_reads_the_ids_the_model_was_trained_on():
    """The transformers flavor's pipeline tokenizer: for a byte model every byte is its own id and decodes back; for
    a tokenizer.json the same ids as `tokenizers` itself, its special token the end of a text; and generation never
    picks an embedding row past the tokenizer's ids, nor stops at a config's default eos id (Llama's 2 is a byte)."""
    from training import tokenizer as tk
    from training.transformers_form import _set_generation, pipeline_tokenizer

    text = "héllo\n\t\x00\x02 wörld ✓"
    bytes_tok = pipeline_tokenizer("")
    ids = bytes_tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8")) and len(bytes_tok) == 256
    assert bytes_tok.decode(ids) == text and bytes_tok.decode(list(range(256))).encode("utf-8", "replace")

    bpe = tk.train_bpe([b"def main():\n    return 0\n" * 30, b"import os\nimport sys\n" * 30], 300)
    wrapped = pipeline_tokenizer(bpe.to_str())
    code = "def main():\n    import os\n"
    assert wrapped(code, add_special_tokens=False)["input_ids"] == bpe.encode(code, add_special_tokens=False).ids
    assert wrapped.eos_token == tk.END_OF_TEXT and wrapped.eos_token_id == bpe.token_to_id(tk.END_OF_TEXT) == 0

    _, model = _model({**TINY_LLAMA, "vocab_size": 320})
    _set_generation(model.lm, wrapped)
    gen = model.lm.generation_config
    ids = bpe.get_vocab_size()  # under 300 when the texts have fewer merges to learn
    assert gen.eos_token_id == [0] and gen.pad_token_id == 0 and gen.suppress_tokens == list(range(ids, 320))
    # a user's tokenizer with more special tokens: every one of them ends a completion, not only the named eos
    extra = tk.Tokenizer.from_str(bpe.to_str())
    extra.add_special_tokens(["<|im_start|>"])
    wrapped = pipeline_tokenizer(extra.to_str())
    _set_generation(model.lm, wrapped)
    assert wrapped.eos_token == tk.END_OF_TEXT
    assert model.lm.generation_config.eos_token_id == [0, extra.token_to_id("<|im_start|>")]
    # a config.json saved from a hub model names it: dropped, or MLflow would look it up on the hub when logging
    _, named = _model({**TINY_LLAMA, "_name_or_path": "meta-llama/Llama-3.2-1B"})
    assert named.lm.name_or_path == ""
    _, byte_model = _model()
    _set_generation(byte_model.lm, bytes_tok)
    assert byte_model.lm.generation_config.eos_token_id is None
    assert byte_model.lm.generation_config.suppress_tokens is None
