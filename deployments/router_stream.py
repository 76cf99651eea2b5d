"""The router's streamed completions and chat completions: OpenAI's server-sent events from a replica's token stream.

A mixin of deployments.serve_app.Router, which owns the routing (`_route`: the version, and a chat request's
prompt in that version's format), the replica calls (`_call`,
`_handle`, `inflight`), the metrics and the evidence (`_record`, from router_evidence): a stream goes to the version
the weight picks (or the tester's variant); one that fails before its first byte is answered by the champion (a
chat request only when the champion can take it in its own format), one
that fails later ends with an error event; a client that goes away cancels the replica's generation at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from deployments import openai_api as oai
from deployments.http_io import EVENT_STREAM, error_reply, failure_line
from deployments.openai_api import ApiError, CompletionRequest, EmptyEncoding, empty_encoding
from deployments.openai_chat import chat_chunk, chat_id
from deployments.router_config import VERSION_HEADER, Job


def prompt_piece(head: dict[str, Any]) -> dict[str, Any] | None:
    """The echoed prompt's logprobs: the replica's labels of its prompt tokens (a tokenizer's ids) and where each
    starts in the prompt, else the prompt's bytes (merge_logprobs counts their characters)."""
    from deployments.codec import byte_label

    scored = head.get("prompt_logprobs")
    if scored is None:
        return None
    piece = {
        "tokens": head.get("prompt_tokens") or [byte_label(b) for b in head["prompt"]],
        "token_logprobs": [lp for lp, _ in scored],
        "top_logprobs": [top for _, top in scored],
    }
    if head.get("prompt_offsets") is not None:
        piece |= {"text_offset": head["prompt_offsets"], "echo": True}
    return piece


class RouterStreams:
    """Streams completions; see the module docstring for what the router provides."""

    inflight: Counter[str]
    metrics: Any
    _route: Callable[[Job], Awaitable[tuple[Job, bool, bool] | dict[str, Any]]]
    _call: Callable[..., Awaitable[dict[str, Any]]]
    _handle: Callable[[str], Any]
    _record: Callable[..., None]
    _source: Callable[[Job], str]
    _kind: Callable[[Job], str]

    async def _serve_stream(self, job: Job) -> AsyncIterator[Any]:
        """A completion as server-sent events: OpenAI's chunks, a usage chunk when asked, then `data: [DONE]`."""
        from deployments.generation import merge_logprobs

        cfg = job.cfg
        t0 = time.perf_counter()
        routed = await self._route(job)
        if isinstance(routed, dict):
            yield routed
            return
        job, to_challenger, paired = routed
        shadow = failed = None
        version = str(cfg.challenger) if to_challenger else cfg.champion
        _, (prompt, params) = job.at(version).op_args()
        if paired:
            shadow = await self._call(cfg.champion, "score", "shadow", prompt)
        stream, head = await self._open_stream(version, prompt, params)
        can_fall_back = to_challenger and not job.variant and (job.messages is None or cfg.champion in job.rendered)
        if head.get("refused") and can_fall_back:
            # the prompt encodes to no tokens for the challenger (the client's input, not its failure): the champion
            # answers, as when the challenger's chat template cannot take the messages (_render); the request is the
            # champion's
            to_challenger, shadow, version = False, None, cfg.champion
            _, (prompt, params) = job.at(version).op_args()
            stream, head = await self._open_stream(version, prompt, params)
        elif "error" in head and can_fall_back:
            # failed before a byte: the champion answers (a chat request in the champion's own format, if it has one)
            failed, version = head, cfg.champion
            _, (prompt, params) = job.at(version).op_args()
            stream, head = await self._open_stream(version, prompt, params)
        if head.get("refused"):  # the client's 400: neither the version's failure nor evidence
            self.metrics.rejected(job.endpoint, 400)
            yield error_reply(empty_encoding(job.endpoint == "chat"), {VERSION_HEADER: version})
            return
        if "error" in head:
            self._finish_stream(job, to_challenger, head, shadow, failed, t0)
            yield error_reply(
                ApiError(
                    503,
                    f"model version {version} failed: {head['error']}",
                    kind="server_error",
                    code="model_failed",
                    retry_after=1,
                ),
                {VERSION_HEADER: version},
            )
            return
        served: dict[str, Any] = {**head, "ok": True}
        finished = False
        # from here on the replica is generating: a client that goes away at any yield below (the head, the chat
        # role chunk, the echo chunk or a token's chunk) cancels it, and the request is recorded once
        try:
            yield {
                "status": 200,
                "headers": {VERSION_HEADER: version, "cache-control": "no-cache"},
                "media_type": EVENT_STREAM,
            }
            model, req, chat = cfg.model_name, job.at(version).req, job.endpoint == "chat"
            assert isinstance(req, CompletionRequest)
            cid = chat_id() if chat else oai.completion_id()
            # with include_usage, OpenAI's every chunk has a `usage` field: null, and the totals on the last one
            with_usage = req.stream_options is not None and req.stream_options.include_usage
            # every chunk carries the stream's one `created` (as OpenAI's do), and with include_usage `"usage": null`
            common = {"created": int(time.time())} | ({"usage": None} if with_usage else {})

            def piece(text: str, finish_reason: str | None, lp: dict[str, Any] | None = None) -> bytes:
                if chat:  # the new text in `delta.content` (the last chunk's delta is empty); never logprobs
                    delta = {"content": text} if text else {}
                    return oai.sse(chat_chunk(cid, model, version, delta, finish_reason) | common)
                return oai.sse(oai.chunk(cid, model, version, text, finish_reason, lp) | common)

            if chat:  # OpenAI's first chat chunk carries the role
                yield oai.sse(chat_chunk(cid, model, version, {"role": "assistant", "content": ""}, None) | common)
            if req.echo:
                head_lp = prompt_piece({**head, "prompt": prompt}) if req.logprobs is not None else None
                yield piece(req.prompt, None, merge_logprobs([head_lp]) if head_lp else None)
            offset = len(req.prompt) if req.echo else 0
            try:
                async for event in stream:
                    if "text" in event:
                        lp = None
                        if req.logprobs is not None:
                            lp = merge_logprobs([event["logprobs"]], offset, len(req.prompt) if req.echo else 0)
                        offset += len(event["text"])
                        yield piece(event["text"], None, lp)
                    else:
                        served |= event
            except Exception as e:  # noqa: BLE001 - a replica dying mid-stream: the client gets an error event
                served = {**served, "ok": False, "error": failure_line(e)}
                yield oai.sse(
                    oai.error_body(
                        f"model version {version} failed mid-stream: {served['error']}",
                        "server_error",
                        code="model_failed",
                    )
                )
            else:
                finished = True
                yield piece("", served.get("finish_reason", "length"))
                if with_usage:
                    used = (int(served.get("prompt_ids", len(prompt))), int(served.get("tokens", 0)))
                    kind = "chat.completion.chunk" if chat else "text_completion"
                    yield oai.sse(
                        oai.usage_chunk(cid, model, version, *used, kind=kind) | {"created": common["created"]}
                    )
        finally:
            if not finished:  # the client went away (or the replica failed): stop generating now
                stream.cancel()
            self._finish_stream(job, to_challenger, served, shadow, failed, t0)
        yield oai.DONE

    async def _open_stream(self, version: str, prompt: bytes, params: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The replica's event stream and its first event, or (None, {"version", "error"})."""
        self.inflight[version] += 1
        stream = None
        try:
            stream = self._handle(version).options(stream=True).complete_stream.remote(prompt, params)
            return stream, {**await stream.__anext__(), "prompt": prompt}
        except EmptyEncoding as e:  # the prompt encodes to no tokens for this version: the client's 400
            return None, {"version": version, "ok": False, "refused": True, "error": failure_line(e)}
        except Exception as e:  # noqa: BLE001 - a replica failure is an observation, not a router failure
            return None, {"version": version, "ok": False, "error": failure_line(e)}
        except asyncio.CancelledError:  # the request was cancelled while its first event was awaited
            if stream is not None:
                stream.cancel()
            raise
        finally:
            self.inflight[version] -= 1

    def _finish_stream(
        self, job: Job, to_challenger: bool, served: dict[str, Any], shadow: dict | None, failed: dict | None, t0: float
    ) -> None:
        out = dict(served)
        out.setdefault("latency_ms", (time.perf_counter() - t0) * 1000.0)
        self.metrics.model_call(out["version"], self._kind(job), "complete", out)
        self.metrics.request(out["version"], job.endpoint, self._source(job), ok=bool(out["ok"]))
        if not job.variant:
            self._record(job, to_challenger, out, shadow, failed, (time.perf_counter() - t0) * 1000.0)
