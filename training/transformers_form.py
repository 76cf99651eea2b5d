"""The registered form of a transformers model (`train.hf_config`): MLflow's transformers flavor.

A version is a `text-generation` pipeline of the trained `PreTrainedModel` (its `save_pretrained` files: config.json,
safetensors weights, generation_config.json, in the model's `model/` directory) and a fast tokenizer, so
`mlflow.pyfunc.load_model("models:/NAME@champion").predict(["def main():"], params={"max_new_tokens": 32})` needs
mlflow and transformers, and no code of shardline's. Its params are transformers' own generation settings
(`max_new_tokens`, `do_sample`, `temperature`; greedy by default) and it returns the completion alone
(`return_full_text=False`). Unlike the endpoint and shardline's pyfunc, which keep the last `seq_len` ids, the
pipeline does not slide a window: prompt and completion together must fit the model's positions.

The pipeline's tokenizer is the version's `tokenizer.json` wrapped as a `PreTrainedTokenizerFast` (its special token,
a trained BPE's `<|endoftext|>`, is the end of a completion), or, for a byte model, a byte-level tokenizer whose
ids are the bytes themselves: GPT-2's byte-to-character table as a 256-entry vocabulary with no merges. Ids the
embedding has past the tokenizer's are suppressed in generation (`generation_config.suppress_tokens`), as serving
never samples them.

The endpoint serves the same files: `load_causal_lm_form` rebuilds the CausalLM from the safetensors (tensors only,
no pickle) and decodes with transformers' KV cache. The tokenizer.json the endpoint and lineage use is also logged
byte for byte as `shardline/tokenizer.json` (the wrapped copy gains a post-processor, so its fingerprint differs).
MLflow's model card and license lookups run on the model's hub name, which is kept empty (training.hf_model drops a
config.json's `_name_or_path`, and it is checked here), so huggingface_hub's name check stops them: nothing is
fetched.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from training.chat_template import NO_CHAT, ChatFormat

WEIGHTS_DIR = "model"  # where the transformers flavor writes save_pretrained's files
TOKENIZER_PATH = "shardline/tokenizer.json"  # the version's tokenizer.json as trained, logged beside the flavor
TASK = "text-generation"


def pipeline_tokenizer(tokenizer_json: str) -> Any:
    """The `PreTrainedTokenizerFast` of a version: its tokenizer.json, or bytes when there is none ('')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from training.tokenizer import byte_level_table

    if tokenizer_json:
        tok = Tokenizer.from_str(tokenizer_json)
    else:
        tok = Tokenizer(models.BPE(vocab=byte_level_table(), merges=[]))  # character of byte b -> id b
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
    special = special_contents(tok)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=end_token(special),
        pad_token=special[0] if special else None,
        clean_up_tokenization_spaces=False,
    )


def special_contents(tok: Any) -> list[str]:
    """The special tokens of a `tokenizers.Tokenizer`, in id order."""
    return [t.content for _, t in sorted(tok.get_added_tokens_decoder().items()) if t.special]


def end_token(special: list[str]) -> str | None:
    """The special token that names the end of a text: one spelled like an end (</s>, <|endoftext|>, <eos>), else
    the first. Generation stops at every special token anyway (`_set_generation`)."""
    ends = [t for t in special if "end" in t.lower() or "eos" in t.lower() or t.startswith("</")]
    return (ends or special)[0] if special else None


def _set_generation(lm: Any, tokenizer: Any) -> None:
    """What the pipeline generates with, as the endpoint and the pyfunc do: stop at any of the tokenizer's special
    tokens (none for bytes: a config's default eos id, Llama's 2, would be a byte), pad with one (or byte 0), and
    never pick an id the tokenizer lacks."""
    ids = len(tokenizer)
    rows = int(lm.get_input_embeddings().weight.shape[0])
    added = tokenizer.backend_tokenizer.get_added_tokens_decoder().items()
    stops = sorted(i for i, t in added if t.special)  # every special token, not only the ones named eos and pad
    gen = lm.generation_config
    gen.bos_token_id = None
    gen.eos_token_id = stops or None
    gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    gen.suppress_tokens = list(range(ids, rows)) or None


def log_transformers(
    model: Any,
    name: str,
    metadata: dict,
    signature: Any,
    requirements: list[str],
    tokenizer_json: str = "",
    chat: ChatFormat = NO_CHAT,
) -> str:
    """Log a CausalLM (training.hf_model) as the transformers flavor with `metadata` (the caller's seq_len,
    vocab_size and tokenizer entries; metadata[EAGER_HF] is added here), the pipeline's `signature` and pip
    `requirements` (training/served_forms.py decides both), and return its models:/ URI."""
    import mlflow

    from training.hf_model import EAGER_HF

    if model.lm.name_or_path:  # MLflow would look it up on the hub
        raise ValueError(f"the model names a hub id ({model.lm.name_or_path!r}); a logged model must name none")
    tokenizer = pipeline_tokenizer(tokenizer_json)
    if chat:  # saved with the flavor's tokenizer, as transformers saves it
        tokenizer.chat_template = chat.template
    for key, token in chat.tokens().items():  # training.servable kept the ones the tokenizer has
        setattr(tokenizer, key, token)
    _set_generation(model.lm, tokenizer)
    spec = {"config": model.spec, "weights_dir": WEIGHTS_DIR, "vocab": model.vocab}
    info = mlflow.transformers.log_model(
        {"model": model.lm, "tokenizer": tokenizer},
        name=name,
        task=TASK,
        model_config={"return_full_text": False, "max_new_tokens": 16, "do_sample": False},
        signature=signature,
        metadata={**metadata, EAGER_HF: spec},
        pip_requirements=requirements,
    )
    if tokenizer_json:
        client = mlflow.MlflowClient()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / Path(TOKENIZER_PATH).name
                path.write_text(tokenizer_json, encoding="utf-8")
                client.log_model_artifact(info.model_id, str(path), str(Path(TOKENIZER_PATH).parent))
        except Exception:
            client.delete_logged_model(info.model_id)  # nothing half-logged stays in the run
            raise
    return str(info.model_uri)


def load_causal_lm_form(spec: dict, seq_len: int, weights_dir: str) -> Any:
    """The CausalLM of metadata[EAGER_HF] from the flavor's save_pretrained directory (safetensors), in eval mode."""
    from training.hf_model import VOCAB, CausalLM, load_pretrained

    model = CausalLM(spec["config"], seq_len, spec.get("vocab", VOCAB))
    load_pretrained(model, weights_dir)
    return model.eval()
