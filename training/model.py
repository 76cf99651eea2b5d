"""The default model: a byte-level GPT (vocab 256, nanoGPT style) and its FLOPs per token for MFU."""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from training.config import TrainConfig

VOCAB = 256  # bytes
# The logged model's metadata key naming the GPT's constructor config and its weights file (serving's KV cache).
EAGER_METADATA = "eager_gpt"
EAGER_WEIGHTS_FILE = "gpt_state_dict.pt"


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        # [B, T, C] -> [B, H, T, C/H]
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.c_proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block; the unit FSDP shards and activation checkpointing wraps."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT-style GPT over `vocab` token ids: 256 bytes by default, or a tokenizer's ids (training/tokenizer.py).
    forward(idx: int64 [B, T], T <= seq_len) -> logits float [B, T, vocab]."""

    def __init__(
        self, seq_len: int, n_layer: int, n_head: int, d_model: int, dropout: float = 0.0, vocab: int = VOCAB
    ) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model {d_model} is not divisible by n_head {n_head}")
        self.seq_len = seq_len
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def config(self) -> dict[str, int]:
        """The constructor arguments that rebuild this model's shapes (dropout aside: serving runs in eval)."""
        first = cast(Block, self.blocks[0])
        return {
            "seq_len": self.seq_len,
            "n_layer": len(self.blocks),
            "n_head": first.attn.n_head,
            "d_model": self.wte.embedding_dim,
            "vocab": self.wte.num_embeddings,
        }

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_gpt(cfg: TrainConfig) -> GPT:
    """The default `train.model_factory`: a GPT sized by `cfg` (seq_len, n_layer, n_head, d_model, dropout) over
    cfg.vocab_size ids (0: the 256 bytes; the training stage sets it from the shard set, trainer.fit_vocabulary)."""
    return GPT(cfg.seq_len, cfg.n_layer, cfg.n_head, cfg.d_model, cfg.dropout, vocab=cfg.vocab_size or VOCAB)


def save_weights(model: nn.Module, path: str) -> None:
    """The state dict as plain tensors (torch.save of a dict of tensors; `load_gpt` reads it with
    weights_only=True, so loading unpickles no objects)."""
    torch.save({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, path)


def load_gpt(config: dict[str, int], path: str) -> GPT:
    """A GPT built from `config` (GPT.config()) with the weights `save_weights` wrote, in eval mode.

    Raises:
        RuntimeError: the weights do not fit the config (missing, unexpected or differently shaped tensors).
    """
    model = GPT(
        **{k: int(config[k]) for k in ("seq_len", "n_layer", "n_head", "d_model")}, vocab=config.get("vocab", VOCAB)
    )
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval()


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12 * L * d * T.

    N counts the matmul weights a token passes through (everything but the embedding lookups). For a
    model that is not a GPT (a plugged-in factory) the attention term is left out: 6N. A model with its own
    `flops_per_token(seq_len)` (training.hf_model.CausalLM) is asked.
    """
    own = getattr(model, "flops_per_token", None)
    if callable(own):
        return float(own(seq_len))
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("wte.", "wpe.")))
    attn = 0.0
    blocks = getattr(model, "blocks", None)
    wte = getattr(model, "wte", None)
    if isinstance(model, GPT) and blocks is not None and wte is not None:
        attn = 12.0 * len(blocks) * wte.embedding_dim * seq_len
    return 6.0 * n + attn
