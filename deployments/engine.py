"""The replica's generation engine: continuous batching of in-flight completions over a model backend.

Every request owns a slot of the backend (a KV cache row for the built-in GPT, a context for any other model).
One loop on the engine's thread admits waiting requests (each prefilled alone), then runs ONE batched decode
step for every request that wants a next token, samples each row with its own generation.Completion and hands
the events to the request's queue. A new request therefore joins at the next step instead of waiting for a long
one to finish, and a consumer that goes away (the router cancels the stream; the generator is closed) frees its
slot at once. The event loop keeps answering while a step computes.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F

from deployments.codec import BYTES, ByteCodec, TokenCodec
from deployments.generation import Completion
from deployments.openai_api import EmptyEncoding


class Backend(Protocol):
    """What the engine needs from a model: per-slot prefill and a batched one-token decode."""

    model: Callable[[torch.Tensor], torch.Tensor]  # [B, T] ids -> [B, T, vocab] logits (scoring, health)
    seq_len: int
    slots: int

    def prefill(self, slot: int, tokens: list[int]) -> torch.Tensor: ...  # [T, vocab] logits of the last seq_len

    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor: ...  # [B, vocab] next-token logits


class Recompute:
    """Any causal [B, T] -> [B, T, vocab] model (an exported pt2 program): each decode step runs every slot's
    last seq_len ids, right-padded to the longest, as one batch; a row's logits are read at its own last
    position, which causal attention keeps independent of the padding after it."""

    def __init__(self, model: Callable[[torch.Tensor], torch.Tensor], seq_len: int, slots: int) -> None:
        self.model, self.seq_len, self.slots = model, seq_len, slots
        self.context: list[list[int]] = [[] for _ in range(slots)]

    @torch.no_grad()
    def prefill(self, slot: int, tokens: list[int]) -> torch.Tensor:
        self.context[slot] = list(tokens[-self.seq_len :])
        return self.model(torch.tensor([self.context[slot]], dtype=torch.long))[0].float()

    @torch.no_grad()
    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        for s, t in zip(slots, tokens, strict=True):
            self.context[s] = (self.context[s] + [t])[-self.seq_len :]
        lengths = [len(self.context[s]) for s in slots]
        batch = torch.zeros(len(slots), max(lengths), dtype=torch.long)
        for b, s in enumerate(slots):
            batch[b, : lengths[b]] = torch.tensor(self.context[s])
        logits = self.model(batch)
        return logits[torch.arange(len(slots)), torch.tensor(lengths) - 1].float()


@dataclass(eq=False)
class _Request:
    prompt: bytes
    completion: Completion
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    slot: int | None = None
    last: int = 0  # the token the next decode step feeds
    closed: bool = False  # the consumer is gone, or the request holds no slot any more


class Engine:
    """Continuous batching over `backend` (at most backend.slots requests at once; more wait for a slot).

    The model runs on one engine thread that loops while there is work: jobs (`run`), admissions, one decode step.
    It never waits for the event loop; events reach each request's asyncio queue via call_soon_threadsafe. Slot
    bookkeeping is shared under one lock, so a consumer that leaves frees its slot at once; the engine ignores its
    row in a step that was already computing.
    """

    def __init__(self, backend: Backend, codec: ByteCodec | TokenCodec = BYTES) -> None:
        self.backend, self.codec = backend, codec  # the codec turns a prompt's text into the model's ids
        self.free = list(range(backend.slots))[::-1]
        self.waiting: deque[_Request] = deque()
        self.running: dict[int, _Request] = {}
        self.steps = 0  # batched decode steps run (the tests read how many requests shared them)
        self._jobs: deque[tuple[Callable[..., Any], tuple, asyncio.AbstractEventLoop, asyncio.Future]] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the engine thread, between decode steps (scoring shares the model with generation)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            self._jobs.append((fn, args, loop, future))
            self._wake()
        return await future

    async def stream(self, prompt: bytes, completion: Completion) -> AsyncGenerator[dict[str, Any], None]:
        """{"bits", "bytes", "prompt_ids"} of the prompt's own text first, then `completion`'s events as they are
        decoded.

        The prompt's bits come from the prefill's logits when the prompt fits the window (training.bpb's windows
        are then the generation context); a longer prompt is scored separately, as training.bpb scores it.
        """
        if not prompt:
            raise EmptyEncoding("an empty prompt has nothing to condition on")
        req = _Request(prompt, completion, asyncio.get_running_loop())
        with self._cond:
            self.waiting.append(req)
            self._wake()
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

    def _wake(self) -> None:  # under the lock
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="shardline-engine", daemon=True)
            self._thread.start()
        self._cond.notify()

    def _release(self, req: _Request) -> None:
        """Free the request's slot now; a step that is computing with it has its row ignored."""
        with self._cond:
            req.closed = True
            if req.slot is not None and self.running.get(req.slot) is req:
                del self.running[req.slot]
                self.free.append(req.slot)
                self.free.sort(reverse=True)  # lowest slot next: in-flight slots stay a contiguous run (kv_cache)
                self._cond.notify()

    # ----- the engine thread
    def _work(self) -> None:
        while True:
            with self._cond:
                while not (self._jobs or (self.waiting and self.free) or self.running):
                    self._cond.wait()
                jobs = list(self._jobs)
                self._jobs.clear()
                admitted = []
                while self.waiting and self.free:
                    req = self.waiting.popleft()
                    if not req.closed:
                        req.slot = self.free.pop()
                        self.running[req.slot] = req
                        admitted.append(req)
                batch = [r for _, r in sorted(self.running.items()) if r not in admitted]  # in slot order
            out: list[tuple[_Request, list[Any]]] = []
            try:
                for fn, args, loop, future in jobs:
                    loop.call_soon_threadsafe(_settle, future, *_call(fn, *args))
                for req in admitted:
                    self._admit(req, out)
                if batch:
                    self._step(batch, out)
            except BaseException as e:  # noqa: BLE001 - a bug here must fail the requests, not hang them
                with self._cond:
                    stuck = [*self.waiting, *self.running.values()]
                for req in stuck:
                    out.append((req, [e]))
                    self._release(req)
            _deliver(out)

    def _admit(self, req: _Request, out: list[tuple[_Request, list[Any]]]) -> None:
        try:
            head, logits = self._prefill(req)
        except Exception as e:  # noqa: BLE001 - the request fails; the engine serves the others
            out.append((req, [e]))
            self._release(req)
            return
        out.append((req, [head]))
        if req.completion.done:  # max_tokens 0
            out.append((req, req.completion.close()))
            self._release(req)
        else:
            self._advance(req, logits, out)

    def _step(self, batch: list[_Request], out: list[tuple[_Request, list[Any]]]) -> None:
        slots = [cast(int, r.slot) for r in batch]  # a request in a step holds a slot until it is released
        try:
            logits = self.backend.decode(slots, [r.last for r in batch])
        except Exception as e:  # noqa: BLE001 - a failed step fails the requests in it, not the engine
            for r in batch:
                out.append((r, [e]))
                self._release(r)
            return
        self.steps += 1
        for r, row in zip(batch, logits, strict=True):
            if not r.closed:
                self._advance(r, row, out)

    def _advance(self, req: _Request, logits: torch.Tensor, out: list[tuple[_Request, list[Any]]]) -> None:
        try:
            req.last, events = req.completion.step(logits)
        except Exception as e:  # noqa: BLE001 - e.g. non-finite logits: this request fails, the others go on
            out.append((req, [e]))
            self._release(req)
            return
        if req.completion.done:
            events += req.completion.close()
            self._release(req)  # the consumer still drains its queue; only the slot goes
        if events:
            out.append((req, events))

    def _prefill(self, req: _Request) -> tuple[dict[str, Any], torch.Tensor]:
        assert req.slot is not None
        ids, predicted = self.codec.scored(req.prompt)  # the bytes every id but the first covers
        if not ids:
            raise EmptyEncoding("the prompt encodes to no tokens: nothing to condition on")  # the client's 400
        logits = self.backend.prefill(req.slot, ids)
        if len(ids) <= self.backend.seq_len:
            target = torch.tensor(ids[1:], dtype=torch.long)
            nats = float(F.cross_entropy(logits[:-1].float(), target, reduction="sum")) if len(target) else 0.0
            head = {"bits": nats / math.log(2), "bytes": predicted}
        else:
            from training.bpb import token_bits

            bits, n = token_bits(self.backend.model, ids, predicted, self.backend.seq_len)
            head = {"bits": bits, "bytes": n}
        return head | {"prompt_ids": len(ids)}, logits[-1]  # usage.prompt_tokens: the model's ids, not bytes


def _call(fn: Callable[..., Any], *args: Any) -> tuple[Any, BaseException | None]:
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001 - handed to the awaiting caller
        return None, e


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _deliver(out: list[tuple[_Request, list[Any]]]) -> None:
    """Hand a step's events to their requests' queues: one wake-up per event loop, not one per event."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Request, list[Any]]]] = {}
    for req, events in out:
        by_loop.setdefault(req.loop, []).append((req, events))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put, items)
        except RuntimeError:  # that event loop is closed: nobody is reading
            pass


def _put(items: list[tuple[_Request, list[Any]]]) -> None:
    for req, events in items:
        for event in events:
            req.queue.put_nowait(event)
