"""Incremental decoding of the built-in GPT (training.model.GPT) with a key/value cache, for serving.

Reuses the GPT's own parameters (embeddings, each block's layer norms, attention projections and MLP, the head);
training's `GPT.forward` is not touched. The cache is a pool of `slots`, one per in-flight request (KVCache).
`prefill` runs one request's context at once (causal attention, as training does) and fills its slot; `decode`
feeds one new token for each of several slots in ONE batched forward: every row attends to its own slot's first
`length + 1` positions (a boolean mask over the longest row's keys pads the shorter ones), at its own position
embedding.

Positions are learned (`wpe` has seq_len rows), so a slot holds at most seq_len tokens; `CachedGPT` slides a
full one by re-prefilling the last seq_len // 2 bytes of its context (see there).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from training.model import GPT, VOCAB, Block


class KVCache:
    """Keys and values of `slots` sequences of up to model.seq_len tokens, and each slot's length.

    One tensor per layer [slots, seq_len, 2, n_head, head_dim]: a token's key and value sit side by side as the
    attention projection produces them, so a decode step writes both with one indexed copy and reads a slot's
    keys and values as views.
    """

    def __init__(self, model: GPT, slots: int) -> None:
        attn = _blocks(model)[0].attn
        d_model = model.wte.embedding_dim
        shape = (len(model.blocks), slots, model.seq_len, 2, attn.n_head, d_model // attn.n_head)
        self.kv = torch.zeros(shape, dtype=model.wte.weight.dtype, device=model.wte.weight.device)
        self.lengths = [0] * slots


def _blocks(model: GPT) -> list[Block]:
    return cast(list[Block], list(model.blocks))


# The blocks' parameters are called through torch.nn.functional, not through the modules: the same ops as
# Block.forward in eval mode (dropout is the identity), without nn.Module's call overhead, which at one token per
# step costs as much as the arithmetic.
def _ln(x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _lin(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    return F.linear(x, linear.weight, linear.bias)


def _mlp(block: Block, x: torch.Tensor) -> torch.Tensor:
    return _lin(F.gelu(_lin(_ln(x, block.ln_2), block.mlp.c_fc)), block.mlp.c_proj)


@torch.no_grad()
def prefill(model: GPT, cache: KVCache, slot: int, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [T, 256] at every position of `tokens` (int64 [T], 1 <= T <= seq_len), whose keys and values
    become `slot`'s whole cache."""
    t = tokens.numel()
    if not 1 <= t <= model.seq_len:
        raise ValueError(f"prefill of {t} tokens: the model takes 1..{model.seq_len}")
    c = model.wte.embedding_dim
    x = F.embedding(tokens[None], model.wte.weight) + F.embedding(
        torch.arange(t, device=tokens.device), model.wpe.weight
    )
    for i, block in enumerate(_blocks(model)):
        h = block.attn.n_head
        qkv = _lin(_ln(x, block.ln_1), block.attn.c_attn)  # [1, T, 3C]
        cache.kv[i, slot, :t] = qkv[0, :, c:].view(t, 2, h, c // h)
        q, k, v = (z.view(1, t, h, c // h).transpose(1, 2) for z in qkv.split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(1, t, c)
        x = x + _lin(y, block.attn.c_proj)
        x = x + _mlp(block, x)
    cache.lengths[slot] = t
    return F.linear(_ln(x, model.ln_f), model.lm_head.weight)[0]


@torch.no_grad()
def decode(model: GPT, cache: KVCache, slots: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits [B, 256] after appending tokens[b] to slot slots[b], for every b in one forward.

    Raises:
        ValueError: a slot is already full (seq_len tokens): slide it first.
    """
    device = model.wte.weight.device
    b, c = len(slots), model.wte.embedding_dim
    at = [cache.lengths[s] for s in slots]
    span = max(at) + 1  # keys beyond the longest row are never read
    if span > model.seq_len:
        raise ValueError(f"decode: a slot already holds seq_len={model.seq_len} tokens")
    pos = torch.tensor(at, device=device)
    # rows shorter than the longest must not see the keys past their own length (stale or another request's)
    mask = None if min(at) == span - 1 else (torch.arange(span, device=device) <= pos[:, None])[:, None, None, :]
    # the engine allocates low slots first and steps them in slot order: usually a contiguous run of slots, read
    # as a view of the pool; any other set is gathered (a copy of every row's keys and values, per layer)
    contiguous = slots == list(range(slots[0], slots[0] + b))
    rows = torch.arange(b, device=device) if contiguous else torch.tensor(slots, device=device)
    x = F.embedding(torch.tensor(tokens, device=device), model.wte.weight) + F.embedding(pos, model.wpe.weight)
    x = x[:, None, :]  # [B, 1, C]
    for i, block in enumerate(_blocks(model)):
        h = block.attn.n_head
        qkv = _lin(_ln(x, block.ln_1), block.attn.c_attn)  # [B, 1, 3C]
        new = qkv[:, 0, c:].view(b, 2, h, c // h)
        layer = cache.kv[i, slots[0] : slots[0] + b] if contiguous else cache.kv[i]
        layer[rows, pos] = new
        kv = layer[:, :span] if contiguous else layer[rows, :span]  # [B, span, 2, H, C/H]
        q = qkv[..., :c].view(b, 1, h, c // h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2), attn_mask=mask)
        x = x + _lin(y.transpose(1, 2).reshape(b, 1, c), block.attn.c_proj)
        x = x + _mlp(block, x)
    for s in slots:
        cache.lengths[s] += 1
    return F.linear(_ln(x[:, 0], model.ln_f), model.lm_head.weight)


class CachedGPT:
    """A GPT served with a KV cache: deployments.engine's backend for the built-in model.

    Sliding: a slot that holds seq_len tokens when its next token arrives is rebuilt from the last
    `seq_len // 2` bytes of its context (that token included) in one prefill, after which decoding goes on
    incrementally. A byte is therefore always predicted from at least half a window of context, at the cost of
    one prefill per seq_len // 2 generated bytes; recompute (generation.generate) instead predicts every byte
    from the last seq_len bytes. The two agree exactly while prompt + completion stay within seq_len bytes.
    """

    def __init__(self, model: GPT, slots: int) -> None:
        self.model = model.eval()
        self.seq_len = model.seq_len
        self.slots = slots
        self.cache = KVCache(model, slots)
        self.context: list[list[int]] = [[] for _ in range(slots)]  # each slot's last seq_len tokens

    def prefill(self, slot: int, tokens: list[int]) -> torch.Tensor:
        """Logits [T, 256] at every position of the last seq_len `tokens`; `slot` now holds them."""
        window = tokens[-self.seq_len :]
        self.context[slot] = list(window)
        return prefill(self.model, self.cache, slot, torch.tensor(window, dtype=torch.long))

    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """Next-token logits [B, 256] once tokens[b] is appended to slots[b] (full slots slide first)."""
        full = {b for b, s in enumerate(slots) if self.cache.lengths[s] >= self.seq_len}
        rest = [b for b in range(len(slots)) if b not in full]
        for b in rest:
            self.context[slots[b]] = (self.context[slots[b]] + [tokens[b]])[-self.seq_len :]
        if not full:
            return decode(self.model, self.cache, slots, tokens)
        out = torch.empty(len(slots), VOCAB)
        for b in full:
            out[b] = self.prefill(slots[b], (self.context[slots[b]] + [tokens[b]])[-(self.seq_len // 2 or 1) :])[-1]
        if rest:
            out[rest] = decode(self.model, self.cache, [slots[b] for b in rest], [tokens[b] for b in rest])
        return out
