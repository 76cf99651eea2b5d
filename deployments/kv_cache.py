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

from typing import NamedTuple, cast

import torch
import torch.nn.functional as F

from training.model import GPT, Block


class Layer(NamedTuple):
    """One block's parameters as plain tensors (the model's own, not copies), read once: at one token per step,
    nn.Module attribute lookups and calls cost as much as the arithmetic."""

    ln_1: tuple[torch.Tensor, torch.Tensor]
    c_attn: tuple[torch.Tensor, torch.Tensor]
    c_proj: tuple[torch.Tensor, torch.Tensor]
    ln_2: tuple[torch.Tensor, torch.Tensor]
    c_fc: tuple[torch.Tensor, torch.Tensor]
    mlp_proj: tuple[torch.Tensor, torch.Tensor]
    n_head: int
    eps: tuple[float, float]


def _layer(block: Block) -> Layer:
    def wb(m: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return cast(torch.Tensor, m.weight), cast(torch.Tensor, m.bias)

    return Layer(
        wb(block.ln_1),
        wb(block.attn.c_attn),
        wb(block.attn.c_proj),
        wb(block.ln_2),
        wb(block.mlp.c_fc),
        wb(block.mlp.c_proj),
        block.attn.n_head,
        (block.ln_1.eps, block.ln_2.eps),
    )


class KVCache:
    """Keys and values of `slots` sequences of up to model.seq_len tokens, and each slot's length.

    One tensor per layer [slots, seq_len, 2, n_head, head_dim]: a token's key and value sit side by side as the
    attention projection produces them, so a decode step writes both with one copy and reads a slot's keys and
    values as views. `layers` holds each block's parameters (Layer), read once.
    """

    def __init__(self, model: GPT, slots: int) -> None:
        blocks = cast(list[Block], list(model.blocks))
        self.layers = [_layer(b) for b in blocks]
        d_model = model.wte.embedding_dim
        h = blocks[0].attn.n_head
        shape = (len(blocks), slots, model.seq_len, 2, h, d_model // h)
        self.kv = torch.zeros(shape, dtype=model.wte.weight.dtype, device=model.wte.weight.device)
        self.pools = self.kv.unbind(0)  # each layer's [slots, seq_len, 2, n_head, head_dim], as views
        self.lengths = [0] * slots


# The blocks' parameters are used through torch.nn.functional, not through the modules: the same ops as
# Block.forward in eval mode (dropout is the identity).
def _ln(x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor], eps: float) -> torch.Tensor:
    return torch.layer_norm(x, (x.shape[-1],), wb[0], wb[1], eps)


def _mlp(layer: Layer, x: torch.Tensor) -> torch.Tensor:
    h = F.gelu(F.linear(_ln(x, layer.ln_2, layer.eps[1]), *layer.c_fc))
    return F.linear(h, *layer.mlp_proj)


def _head(model: GPT, x: torch.Tensor) -> torch.Tensor:
    return F.linear(
        F.layer_norm(x, model.ln_f.normalized_shape, model.ln_f.weight, model.ln_f.bias, model.ln_f.eps),
        model.lm_head.weight,
    )


@torch.inference_mode()
def prefill(model: GPT, cache: KVCache, slot: int, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [T, vocab] at every position of `tokens` (int64 [T], 1 <= T <= seq_len), whose keys and values
    become `slot`'s whole cache."""
    t = tokens.numel()
    if not 1 <= t <= model.seq_len:
        raise ValueError(f"prefill of {t} tokens: the model takes 1..{model.seq_len}")
    c = model.wte.embedding_dim
    x = F.embedding(tokens[None], model.wte.weight) + F.embedding(
        torch.arange(t, device=tokens.device), model.wpe.weight
    )
    for i, layer in enumerate(cache.layers):
        h = layer.n_head
        qkv = F.linear(_ln(x, layer.ln_1, layer.eps[0]), *layer.c_attn)  # [1, T, 3C]
        cache.kv[i, slot, :t] = qkv[0, :, c:].view(t, 2, h, c // h)
        q, k, v = (z.view(1, t, h, c // h).transpose(1, 2) for z in qkv.split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(1, t, c)
        x = x + F.linear(y, *layer.c_proj)
        x = x + _mlp(layer, x)
    cache.lengths[slot] = t
    return _head(model, x)[0]


@torch.inference_mode()
def decode(model: GPT, cache: KVCache, slots: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits [B, vocab] after appending tokens[b] to slot slots[b], for every b in one forward.

    Raises:
        ValueError: a slot is already full (seq_len tokens): slide it first.
    """
    device = model.wte.weight.device
    b, c = len(slots), model.wte.embedding_dim
    at = [cache.lengths[s] for s in slots]
    span = max(at) + 1  # keys beyond the longest row are never read
    if span > model.seq_len:
        raise ValueError(f"decode: a slot already holds seq_len={model.seq_len} tokens")
    # the engine allocates low slots first and steps them in slot order: usually a contiguous run of slots, read
    # as a view of the pool; any other set is gathered (a copy of every row's keys and values, per layer)
    contiguous = slots == list(range(slots[0], slots[0] + b))
    # every row at the same position (always so for one stream): plain slices, no mask, no index tensors
    level = contiguous and min(at) == span - 1
    x = F.embedding(torch.tensor(tokens, device=device), model.wte.weight)
    if level:
        x = x + model.wpe.weight[span - 1]
        mask, pos, rows = None, None, None
    else:
        pos = torch.tensor(at, device=device)
        x = x + F.embedding(pos, model.wpe.weight)
        # rows shorter than the longest must not see the keys past their own length (stale or another request's)
        mask = (torch.arange(span, device=device) <= pos[:, None])[:, None, None, :]
        rows = torch.arange(b, device=device) if contiguous else torch.tensor(slots, device=device)
    x = x[:, None, :]  # [B, 1, C]
    for i, layer in enumerate(cache.layers):
        h = layer.n_head
        qkv = F.linear(_ln(x, layer.ln_1, layer.eps[0]), *layer.c_attn)  # [B, 1, 3C]
        new = qkv[:, 0, c:].view(b, 2, h, c // h)
        pool = cache.pools[i][slots[0] : slots[0] + b] if contiguous else cache.pools[i]
        if level:
            pool[:, span - 1] = new  # a plain slice copy; an indexed write costs several times more
        else:
            pool[rows, pos] = new
        kv = pool[:, :span] if contiguous else pool[rows, :span]  # [B, span, 2, H, C/H]
        q = qkv[..., :c].view(b, 1, h, c // h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2), attn_mask=mask)
        x = x + F.linear(y.transpose(1, 2).reshape(b, 1, c), *layer.c_proj)
        x = x + _mlp(layer, x)
    for s in slots:
        cache.lengths[s] += 1
    return _head(model, x[:, 0])


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
        """Logits [T, vocab] at every position of the last seq_len `tokens`; `slot` now holds them."""
        window = tokens[-self.seq_len :]
        self.context[slot] = list(window)
        return prefill(self.model, self.cache, slot, torch.tensor(window, dtype=torch.long))

    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """Next-token logits [B, vocab] once tokens[b] is appended to slots[b] (full slots slide first)."""
        full = {b for b, s in enumerate(slots) if self.cache.lengths[s] >= self.seq_len}
        rest = [b for b in range(len(slots)) if b not in full]
        for b in rest:
            self.context[slots[b]] = (self.context[slots[b]] + [tokens[b]])[-self.seq_len :]
        if not full:
            return decode(self.model, self.cache, slots, tokens)
        out = torch.empty(len(slots), self.model.lm_head.out_features)
        for b in full:
            out[b] = self.prefill(slots[b], (self.context[slots[b]] + [tokens[b]])[-(self.seq_len // 2 or 1) :])[-1]
        if rest:
            out[rest] = decode(self.model, self.cache, [slots[b] for b in rest], [tokens[b] for b in rest])
        return out
