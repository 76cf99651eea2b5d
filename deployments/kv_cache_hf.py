"""Incremental decoding of a transformers causal LM (training.hf_model.CausalLM) with its own KV cache, for serving.

Each slot holds the `past_key_values` transformers returns (a DynamicCache), so a decode step runs one token through
the model instead of the whole window. Slots decode one after another (each has its own cache length, and the
transformers forward takes one cache), so a step costs slots x one-token forwards: still far less than recomputing
every slot's window, which is what the pt2 program does.

Sliding is the built-in GPT's rule (deployments.kv_cache.CachedGPT): a slot that holds seq_len tokens is rebuilt
from the last seq_len // 2 tokens of its context in one prefill. Positions restart there, which rotary embeddings
(relative) do not notice and learned ones see as a new window, as in training.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from training.hf_model import CausalLM


class CachedCausalLM:
    """deployments.engine's backend for a transformers model: prefill(slot, tokens) and decode(slots, tokens)."""

    kv_cache = True

    def __init__(self, model: CausalLM, slots: int) -> None:
        self.model = model.eval()
        self.seq_len = model.seq_len
        self.slots = slots
        self.past: list[Any] = [None] * slots
        self.lengths = [0] * slots
        self.context: list[list[int]] = [[] for _ in range(slots)]  # each slot's last seq_len tokens
        # transformers 5 names the cache `cache` (argument and output); 4.x named it `past_key_values`
        self.arg = "cache" if "cache" in inspect.signature(model.lm.forward).parameters else "past_key_values"

    @torch.no_grad()
    def prefill(self, slot: int, tokens: list[int]) -> torch.Tensor:
        """Logits [T, vocab] at every position of the last seq_len `tokens`; `slot` now holds their cache."""
        window = tokens[-self.seq_len :]
        out = self.model.lm(input_ids=torch.tensor([window], dtype=torch.long), use_cache=True)
        self.past[slot], self.lengths[slot], self.context[slot] = out[self.arg], len(window), list(window)
        return out.logits[0, :, : self.model.vocab].float()

    @torch.no_grad()
    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """Next-token logits [B, vocab] once tokens[b] is appended to slots[b] (full slots slide first)."""
        rows = []
        for slot, token in zip(slots, tokens, strict=True):
            context = (self.context[slot] + [token])[-self.seq_len :]
            if self.lengths[slot] >= self.seq_len:
                rows.append(self.prefill(slot, context[-(self.seq_len // 2 or 1) :])[-1])
                continue
            ids = torch.tensor([[token]], dtype=torch.long)
            out = self.model.lm(input_ids=ids, use_cache=True, **{self.arg: self.past[slot]})
            self.past[slot], self.context[slot] = out[self.arg], context
            self.lengths[slot] += 1
            rows.append(out.logits[0, -1, : self.model.vocab].float())
        return torch.stack(rows)
