"""The replica's generation engine: continuous batching of in-flight completions over a model backend.

Every request owns a slot of the backend (a KV cache row for the built-in GPT, a context for any other model).
One loop on the replica's event loop admits waiting requests (each prefilled alone), then runs ONE batched decode
step for every request that wants a next token, samples each row with its own generation.Completion and hands
the events to the request's queue. A new request therefore joins at the next step instead of waiting for a long
one to finish, and a consumer that goes away (the router cancels the stream; the generator is closed) frees its
slot at once. The model runs on one worker thread, so the event loop keeps answering while a step computes.
"""
from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from deployments.generation import Completion


class Backend(Protocol):
    """What the engine needs from a model: per-slot prefill and a batched one-token decode."""

    model: Callable[[torch.Tensor], torch.Tensor]  # [B, T] byte ids -> [B, T, 256] logits (scoring, health)
    seq_len: int
    slots: int

    def prefill(self, slot: int, tokens: list[int]) -> torch.Tensor: ...  # [T, 256] logits of the last seq_len

    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor: ...  # [B, 256] next-token logits


class Recompute:
    """Any causal [B, T] -> [B, T, 256] model (an exported pt2 program): each decode step runs every slot's
    last seq_len bytes, right-padded to the longest, as one batch; a row's logits are read at its own last
    position, which causal attention keeps independent of the padding after it."""

    def __init__(self, model: Callable[[torch.Tensor], torch.Tensor], seq_len: int, slots: int) -> None:
        self.model, self.seq_len, self.slots = model, seq_len, slots
        self.context: list[list[int]] = [[] for _ in range(slots)]

    @torch.no_grad()
    def prefill(self, slot: int, tokens: list[int]) -> torch.Tensor:
        self.context[slot] = list(tokens[-self.seq_len:])
        return self.model(torch.tensor([self.context[slot]], dtype=torch.long))[0].float()

    @torch.no_grad()
    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        for s, t in zip(slots, tokens):
            self.context[s] = (self.context[s] + [t])[-self.seq_len:]
        lengths = [len(self.context[s]) for s in slots]
        batch = torch.zeros(len(slots), max(lengths), dtype=torch.long)
        for b, s in enumerate(slots):
            batch[b, :lengths[b]] = torch.tensor(self.context[s])
        logits = self.model(batch)
        return logits[torch.arange(len(slots)), torch.tensor(lengths) - 1].float()


@dataclass(eq=False)
class _Request:
    prompt: bytes
    completion: Completion
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    slot: int | None = None
    last: int = 0  # the token the next decode step feeds
    closed: bool = False


class Engine:
    """Continuous batching over `backend` (at most backend.slots requests at once; more wait for a slot)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.free = list(range(backend.slots))[::-1]
        self.waiting: deque[_Request] = deque()
        self.running: dict[int, _Request] = {}
        self.steps = 0  # batched decode steps run (the tests read how many requests shared them)
        self._task: asyncio.Task | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engine")

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the engine's model thread (scoring shares it with the decode steps)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def stream(self, prompt: bytes, completion: Completion) -> AsyncIterator[dict[str, Any]]:
        """{"bits", "bytes"} of the prompt's own bytes first, then `completion`'s events as they are decoded.

        The prompt's bits come from the prefill's logits when the prompt fits the window (training.bpb's windows
        are then the generation context); a longer prompt is scored separately, as training.bpb scores it.
        """
        if not prompt:
            raise ValueError("an empty prompt has nothing to condition on")
        req = _Request(prompt, completion)
        self.waiting.append(req)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        try:
            while True:
                event = await req.queue.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if "finish_reason" in event:
                    return
        finally:
            self._release(req)

    def _release(self, req: _Request) -> None:
        """Free the request's slot now; a step that is computing with it has its row ignored."""
        req.closed = True
        if req.slot is not None and self.running.get(req.slot) is req:
            del self.running[req.slot]
            self.free.append(req.slot)

    def _emit(self, req: _Request, events: list[dict[str, Any]]) -> None:
        for event in events:
            req.queue.put_nowait(event)
        if req.completion.done:
            self._release(req)  # the consumer still drains its queue; only the slot goes

    def _fail(self, req: _Request, error: BaseException) -> None:
        req.queue.put_nowait(error)
        self._release(req)

    def _advance(self, req: _Request, logits: torch.Tensor) -> None:
        try:
            req.last, events = req.completion.step(logits)
        except Exception as e:  # noqa: BLE001 - e.g. non-finite logits: this request fails, the others go on
            self._fail(req, e)
            return
        self._emit(req, events + (req.completion.close() if req.completion.done else []))

    def _prefill(self, req: _Request) -> tuple[dict[str, Any], torch.Tensor]:
        assert req.slot is not None
        logits = self.backend.prefill(req.slot, list(req.prompt))
        if len(req.prompt) <= self.backend.seq_len:
            target = torch.tensor(list(req.prompt[1:]), dtype=torch.long)
            nats = float(F.cross_entropy(logits[:-1].float(), target, reduction="sum")) if len(target) else 0.0
            head = {"bits": nats / math.log(2), "bytes": len(target)}
        else:
            from training.bpb import text_bits

            bits, n = text_bits(self.backend.model, req.prompt, self.backend.seq_len)
            head = {"bits": bits, "bytes": n}
        return head, logits[-1]

    async def _loop(self) -> None:
        try:
            await self._steps()
        except BaseException as e:  # a bug or the replica shutting down: no request may wait forever
            for req in [*self.waiting, *self.running.values()]:
                self._fail(req, e if isinstance(e, Exception) else RuntimeError("the engine stopped"))
            self.waiting.clear()
            raise

    async def _steps(self) -> None:
        while self.waiting or self.running:
            while self.waiting and self.free:
                req = self.waiting.popleft()
                if req.closed:
                    continue
                req.slot = self.free.pop()
                self.running[req.slot] = req
                try:
                    head, logits = await self.run(self._prefill, req)
                except Exception as e:  # noqa: BLE001 - the request fails; the engine serves the others
                    self._fail(req, e)
                    continue
                if req.closed:
                    continue
                req.queue.put_nowait(head)
                if req.completion.done:  # max_tokens 0
                    self._emit(req, req.completion.close())
                else:
                    self._advance(req, logits)
            batch = [r for r in self.running.values() if not r.completion.done]
            if not batch:
                if self.waiting and not self.free:  # cannot happen: finished requests free their slots
                    await asyncio.sleep(0)
                continue
            try:
                logits = await self.run(self.backend.decode, [r.slot for r in batch], [r.last for r in batch])
            except Exception as e:  # noqa: BLE001 - a failed step fails the requests in it, not the engine
                for r in batch:
                    if not r.closed:
                        self._fail(r, e)
                continue
            self.steps += 1
            for r, row in zip(batch, logits):
                if not r.closed:
                    self._advance(r, row)
