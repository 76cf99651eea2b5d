"""A Hugging Face `transformers` causal LM as a shardline model (`train.hf_config`), byte-level.

The model is built from its config with `AutoModelForCausalLM.from_config`: nothing is fetched from a model hub,
ever. Its config is given inline in the TOML (a `[train.hf_config]` table with `model_type`) or as a config.json
path (local, s3://, az://), which config loading reads once and keeps inline (`resolve_hf_config`), so workers,
Prefect parameters and the registered model carry the config itself and never go back to the file.

Token ids are bytes (the default tokenizer) or a tokenizer's ids (train.vocab_size, set from the shard set by
trainer.fit_vocabulary): the config's `vocab_size` must hold them, and a larger embedding (a Llama config padded to a
multiple) trains and serves only the logits of those ids. FSDP2 shards each decoder layer, found as the model
declares it (`_no_split_modules`, as Accelerate and torchtitan find it; training.parallelize), and activation
checkpointing, mixed precision and exact resume work as they do for the built-in GPT.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infra.redact import first_line

VOCAB = 256  # byte tokens (training.model.VOCAB; not imported: training.config imports this module)
HF_FACTORY = "training.hf_model:build_hf_model"
# The logged model's metadata key naming a transformers model's config and weights: {"config", "weights_dir" (the
# transformers flavor's save_pretrained files), "vocab"}, or {"config", "weights" (a state dict file), "vocab"} in a
# version logged as a pt2 program before the flavor. Serving rebuilds the model from them to decode with
# transformers' KV cache (deployments.kv_cache_hf).
EAGER_HF = "eager_hf"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # save_pretrained's index when it splits the weights


def _transformers_config(spec: dict[str, Any]) -> Any:
    """The transformers config of an inline spec (a dict with model_type).

    Raises:
        ValueError: one line: no model_type, a model_type transformers does not know, a model that is not a causal
            LM, or settings the config class refuses.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    kind = spec.get("model_type")
    if not isinstance(kind, str) or not kind:
        raise ValueError("needs model_type (e.g. 'llama'), the architecture transformers builds")
    # parameters stay fp32 (train.mixed_precision decides the compute dtype): a save_pretrained config's dtype is
    # what its weights were stored in, and from_config would otherwise build the model in it
    # and a config.json's `_name_or_path` (a hub id it was once saved from) is dropped: MLflow's transformers flavor
    # looks a non-empty model name up on the hub when it logs the model
    dropped = ("model_type", "dtype", "torch_dtype", "_name_or_path", "name_or_path")
    settings = {k: v for k, v in spec.items() if k not in dropped}
    try:
        config = AutoConfig.for_model(kind, **settings)
    except Exception as e:  # noqa: BLE001 - a config class refuses settings its own way (strict fields, a division)
        if "Unrecognized model identifier" in str(e):
            raise ValueError(f"model_type {kind!r} is not an architecture transformers knows") from None
        cause = " ".join(str(e).split())[:200] or type(e).__name__  # its message may span lines
        raise ValueError(f"model_type {kind!r}: {type(e).__name__}: {cause}") from None
    if type(config) not in AutoModelForCausalLM._model_mapping:  # transformers' own registry of causal LMs
        raise ValueError(f"model_type {kind!r} is not a causal language model (AutoModelForCausalLM cannot build it)")
    if int(getattr(config, "vocab_size", 0) or 0) < VOCAB:
        raise ValueError(
            f"vocab_size {getattr(config, 'vocab_size', None)} is smaller than the {VOCAB} byte tokens it must embed"
        )
    return config


def embedding_rows(spec: dict[str, Any]) -> int:
    """The token ids a transformers spec embeds, as transformers fills them in (a Llama without vocab_size: 32000)."""
    return int(getattr(_transformers_config(spec), "vocab_size", 0) or 0)


def resolve_hf_config(value: dict[str, Any] | str, seq_len: int) -> dict[str, Any]:
    """The inline config of `train.hf_config` (a dict, or a config.json path or URI, read now), checked against
    transformers and `seq_len`.

    Raises:
        ValueError: one line naming the file or the problem (unreadable, not JSON, unknown architecture, ...).
    """
    if isinstance(value, str):
        from infra import storage

        local = Path(value).expanduser() if "://" not in value else None
        if local is not None and local.exists() and not local.is_file():
            raise ValueError(f"{value}: not a regular file (a config.json is one)")
        try:
            raw = storage.read_bytes(value)
        except Exception as e:  # noqa: BLE001 - any read failure is this field's problem, said in one line
            raise ValueError(f"{value}: cannot read it ({first_line(e, 200)})") from None
        try:
            spec = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{value}: not a JSON config ({e})") from None
        if not isinstance(spec, dict):
            raise ValueError(f"{value}: a config.json holds a JSON object, not {type(spec).__name__}")
    else:
        spec = dict(value)
    config = _transformers_config(spec)
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and int(positions) < seq_len:
        raise ValueError(f"max_position_embeddings {positions} is shorter than train.seq_len {seq_len}")
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv_heads, int) and (kv_heads < 1 or heads % kv_heads):
        # grouped-query attention shares each key/value head among heads/kv_heads query heads; transformers does
        # not check it, and the first forward pass fails with a shape error that names no setting
        raise ValueError(f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
    return spec


def weight_files(directory: str) -> list[str]:
    """The safetensors files of a `save_pretrained` directory (local, s3://, az://), checked at config load.

    Raises:
        ValueError: one line: the directory holds no config.json, no safetensors weights (pickled
            `pytorch_model.bin` weights are never loaded), or an index naming files that are not there.
    """
    import posixpath

    from infra import storage

    try:
        loc = storage.parse(directory)
        base = storage.join(f"{loc.scheme}://{loc.bucket}", posixpath.normpath(loc.key)) if loc.bucket else ""
        base = base or str(Path(loc.key).resolve())
        names = {e.uri.removeprefix(base.rstrip("/") + "/") for e in storage.list_prefix(base)}
    except Exception as e:  # noqa: BLE001 - a bad URI or an unreachable store is this field's problem, in one line
        raise ValueError(f"{directory}: cannot list it ({first_line(e)})") from None
    if not names:
        raise ValueError(f"{directory}: no such directory, or it is empty")
    if "config.json" not in names:
        raise ValueError(f"{directory}: missing config.json (save_pretrained writes it beside the weights)")
    if WEIGHTS in names:
        return [storage.join(base, WEIGHTS)]
    if WEIGHTS_INDEX in names:
        files = _indexed_files(storage.read_bytes(storage.join(base, WEIGHTS_INDEX)), f"{directory}/{WEIGHTS_INDEX}")
        missing = [f for f in files if f not in names]
        if not files or missing:
            raise ValueError(f"{directory}: {WEIGHTS_INDEX} names files that are not there: {missing or 'none'}")
        return [storage.join(base, f) for f in files]
    pickled = " (pytorch_model.bin is pickle, never loaded: save with safe_serialization=True)" * (
        "pytorch_model.bin" in names
    )
    raise ValueError(f"{directory}: missing {WEIGHTS}{pickled}")


def _indexed_files(raw: bytes, where: str) -> list[str]:
    """The weight files a safetensors index names (`{"weight_map": {tensor: file}}`), or ValueError naming the
    index when it is not one."""
    try:
        index = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f'{where}: not a safetensors index (expected {{"weight_map": {{tensor: file name}}}})')
    return sorted(set(weight_map.values()))


def load_pretrained(model: nn.Module, directory: str) -> None:
    """`train.hf_weights`: the directory's safetensors weights into the plain CausalLM (before FSDP wraps it).
    Tied output heads may be absent from the files; any other missing, unexpected or misshapen tensor is an error.

    Raises:
        ValueError: naming the directory and the tensors that do not fit.
    """
    from safetensors.torch import load as load_safetensors

    from infra import storage

    if not isinstance(model, CausalLM):
        raise ValueError("train.hf_weights needs train.hf_config's model (a transformers causal LM)")
    state: dict[str, torch.Tensor] = {}
    for uri in weight_files(directory):
        state.update(load_safetensors(storage.read_bytes(uri)))  # tensors only: safetensors runs no code
    try:
        missing, unexpected = model.lm.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes that do not fit the config
        raise ValueError(f"train.hf_weights={directory}: {str(e).strip().splitlines()[-1].strip()[:300]}") from None
    tied = {"lm_head.weight"} if getattr(model.lm.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"train.hf_weights={directory}: weights do not fit the model: missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )


class CausalLM(nn.Module):
    """A transformers causal LM behind the built-in GPT's interface: forward(idx int64 [B, T]) -> logits
    [B, T, vocab], `vocab` the token ids it is trained on (256 bytes by default).

    The transformers model is `self.lm`; its state dict keys are `lm.<transformers' own keys>`."""

    def __init__(self, spec: dict[str, Any], seq_len: int, vocab: int = VOCAB) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.seq_len, self.spec, self.vocab = seq_len, dict(spec), vocab
        self.lm = AutoModelForCausalLM.from_config(_transformers_config(spec))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # no cache: training and the served program run whole windows (the engine recomputes them)
        return self.lm(input_ids=idx, use_cache=False).logits[..., : self.vocab]

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, PaLM appendix B: 6N + 12 * L * d * T, N the parameters a token's matmuls use
        (every parameter but the input embedding; the output head counts even when tied to it)."""
        config = self.lm.config
        embed = self.lm.get_input_embeddings().weight
        n = sum(p.numel() for p in self.parameters() if p is not embed)
        if getattr(config, "tie_word_embeddings", False):
            n += embed.numel()  # the head's matmul, whose weight is the embedding's
        layers, width = int(config.num_hidden_layers), int(config.hidden_size)
        return 6.0 * n + 12.0 * layers * width * seq_len


def load_causal_lm(spec: dict[str, Any], seq_len: int, weights_path: str, vocab: int = VOCAB) -> CausalLM:
    """A CausalLM from its inline config and a state dict file (tensors only, `weights_only=True`), in eval mode."""
    model = CausalLM(spec, seq_len, vocab)
    model.load_state_dict(torch.load(weights_path, map_location="cpu", weights_only=True))
    return model.eval()


def build_hf_model(cfg: Any) -> CausalLM:
    """The `train.model_factory` of `train.hf_config` (set by TrainConfig when hf_config is; `cfg` is that
    TrainConfig): the transformers
    model built from the config, randomly initialised (seeded by the loop, so every rank starts equal)."""
    if not isinstance(cfg.hf_config, dict) or not cfg.hf_config:
        raise ValueError("train.hf_config: empty; build_hf_model needs the model's config")
    return CausalLM(cfg.hf_config, cfg.seq_len, cfg.vocab_size or VOCAB)
