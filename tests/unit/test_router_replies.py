"""The router's replies from a replica's own code: a real ModelServer.complete_stream on a tiny in-process GPT
(KV-cache engine). No Ray: each version's deployment handle is a plain stand-in that calls the replica's methods in
this process (`_Handle`), with a stream that the router can cancel as Serve's can."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from typing import Any

import torch

from deployments.codec import BYTES, TokenCodec
from deployments.engine import Engine
from deployments.kv_cache import CachedGPT
from deployments.model_server import ModelServer
from deployments.serve_app import Router
from training.chat_template import ChatFormat
from training.model import GPT

SEQ = 64
SAY = "{% for m in messages %}{{ m.content }}{% endfor %}"  # the messages' contents, nothing around them
CALLED: list[tuple[str, str]] = []  # (version, method) of every replica call, in order


def _server(version: str, codec: Any = BYTES) -> ModelServer:
    """A replica without its registry: a tiny GPT served by the engine, as ModelServer.__init__ sets it up."""
    torch.manual_seed(0)
    model = GPT(SEQ, n_layer=2, n_head=2, d_model=32).eval()
    server = object.__new__(ModelServer)
    server.version, server.codec, server.chat = version, codec, ChatFormat.of(SAY, {})
    server.backend = CachedGPT(model, 2)
    server.model, server.seq_len, server.kv_cache = model, SEQ, True
    server.engine = Engine(server.backend, codec)
    server.score_batch, server._score = 1, server._score_one  # scores one at a time (no serve.batch)
    return server


def _whitespace_dropping() -> TokenCodec:
    """A tokenizer whose pre-tokenizer drops whitespace (as BERT- and T5-style tokenizer.json files do)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return TokenCodec(tokenizer)


class _Stream:
    """A streaming call's replies, cancellable."""

    def __init__(self, events: Any) -> None:
        self.events, self.cancelled = events, False

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Any:
        return await self.events.__anext__()

    def cancel(self) -> None:
        self.cancelled = True
        asyncio.get_running_loop().create_task(self.events.aclose())


class _Call:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class _Handle:
    """A version's deployment handle calling its replica in this process."""

    def __init__(self, server: ModelServer, streams: list[_Stream]) -> None:
        self.server, self.streams = server, streams

    def options(self, stream: bool = False) -> _Handle:
        return self

    def __getattr__(self, name: str) -> _Call:
        CALLED.append((self.server.version, name))
        if name == "complete_stream":

            def open_stream(*args: Any) -> _Stream:
                self.streams.append(_Stream(self.server.complete_stream(*args)))
                return self.streams[-1]

            return _Call(open_stream)
        if name == "chat_template":

            async def template() -> dict[str, str]:
                return self.server.chat_template()

            return _Call(template)
        return _Call(getattr(self.server, name))


def _router(servers: dict[str, ModelServer], **cfg: Any) -> tuple[Router, list[_Stream]]:
    streams: list[_Stream] = []
    router = Router("shardline-m", {v: _Handle(s, streams) for v, s in servers.items()}, "m")
    router.reconfigure({"model_name": "m", "champion": "1", **cfg})
    return router, streams


async def _stream(router: Router, path: str, body: dict[str, Any], items: int | None = None) -> list[Any]:
    """The router's reply to a stream request; `items`: the client goes away after that many."""
    out = []
    async with aclosing(router.respond_stream("POST", path, {}, json.dumps(body).encode())) as reply:
        async for item in reply:
            out.append(item)
            if items is not None and len(out) >= items:
                break
    return out


def _error(reply: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
    return reply["status"], json.loads(reply["body"])["error"], reply["headers"]


def _errors_counted(router: Router) -> float:
    """The router's model-call and request error series, summed."""
    text = router.metrics.exposition()[0].decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if "_total{" in line and 'outcome="error"' in line
    )


def test_a_prompt_that_encodes_to_no_tokens_is_the_clients_400_not_the_versions_failure():
    router, _ = _router({"1": _server("1", _whitespace_dropping())})
    body = {"prompt": "   ", "max_tokens": 3, "temperature": 0}

    async def scenario() -> tuple[dict[str, Any], list[Any], dict[str, Any]]:
        whole = await router.respond("POST", "/v1/completions", {}, json.dumps(body).encode())
        streamed = await _stream(router, "/v1/completions", body | {"stream": True})
        ok = await router.respond("POST", "/v1/completions", {}, json.dumps(body | {"prompt": "ab"}).encode())
        return whole, streamed, ok

    whole, streamed, ok = asyncio.run(scenario())
    for reply in (whole, streamed[0]):
        status, error, headers = _error(reply)
        assert status == 400 and "retry-after" not in headers
        assert error == {
            "message": "prompt: encodes to no tokens for this model",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": None,
        }
    assert len(streamed) == 1  # a whole reply, no events
    assert ok["status"] == 200
    # neither refusal is evidence or a failure of the version: only the answered request is recorded
    assert [o["champion"]["ok"] for o in router.observations] == [True]
    assert _errors_counted(router) == 0


def test_chat_messages_that_render_to_no_tokens_are_a_400_naming_messages():
    router, _ = _router({"1": _server("1", _whitespace_dropping())})
    body = {"messages": [{"role": "user", "content": " \n "}], "max_tokens": 3}
    reply = asyncio.run(router.respond("POST", "/v1/chat/completions", {}, json.dumps(body).encode()))
    status, error, _ = _error(reply)
    assert status == 400 and error["param"] == "messages" and "encodes to no tokens" in error["message"]
    assert not router.observations and _errors_counted(router) == 0


def test_a_challenger_that_encodes_the_prompt_to_no_tokens_leaves_the_answer_to_the_champion():
    servers = {"1": _server("1"), "2": _server("2", _whitespace_dropping())}
    lease = time.time() + 600
    router, _ = _router(servers, challenger="2", challenger_percent=100, canary_id="c1", lease_expires_at=lease)
    CALLED.clear()
    body = {"prompt": "   ", "max_tokens": 2, "temperature": 0}

    async def scenario() -> tuple[dict[str, Any], list[Any]]:
        whole = await router.respond("POST", "/v1/completions", {}, json.dumps(body).encode())
        return whole, await _stream(router, "/v1/completions", body | {"stream": True})

    whole, streamed = asyncio.run(scenario())
    assert whole["status"] == 200 and json.loads(whole["body"])["model_version"] == "1"
    assert streamed[0]["status"] == 200 and streamed[-1] == b"data: [DONE]\n\n"
    calls = [("2", "complete"), ("1", "complete"), ("2", "complete_stream"), ("1", "complete_stream")]
    assert [c for c in CALLED if c[1].startswith("complete")] == calls  # the challenger was asked first
    # the champion's requests: nothing counts against the challenger
    observations = list(router.observations)
    assert [(o["role"], o["challenger"], o["champion"]["ok"]) for o in observations] == [("champion", None, True)] * 2
    assert _errors_counted(router) == 0


def test_a_client_gone_before_the_first_token_chunk_cancels_the_replicas_generation():
    server = _server("1")
    router, streams = _router({"1": server}, max_tokens_cap=2048)
    prompt = {"prompt": "x", "max_tokens": 2048, "temperature": 0, "stream": True}
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2048, "stream": True}

    async def gone_after(path: str, body: dict[str, Any], items: int) -> tuple[bool, int]:
        await _stream(router, path, body, items)
        for _ in range(200):  # the cancelled generation leaves the engine
            if not server.engine.running:
                break
            await asyncio.sleep(0.01)
        steps = server.engine.steps
        await asyncio.sleep(0.05)
        return streams[-1].cancelled, server.engine.steps - steps

    async def scenario() -> list[tuple[bool, int]]:
        return [
            await gone_after("/v1/completions", prompt, 1),  # after the head
            await gone_after("/v1/completions", prompt | {"echo": True}, 2),  # after the echoed prompt
            await gone_after("/v1/chat/completions", chat, 2),  # after the chat role chunk
        ]

    for cancelled, steps_after in asyncio.run(scenario()):
        assert cancelled and steps_after == 0
    assert not server.engine.running and server.engine.steps < 3 * 2048
    # each request recorded once, as served (the model did not fail; its client left)
    assert [o["champion"]["ok"] for o in router.observations] == [True, True, True]
    assert _errors_counted(router) == 0


def _ray_task_error(cause: Exception) -> Exception:
    """A replica's failure as a deployment handle raises it: a RayTaskError whose text is the replica's traceback."""
    from ray.exceptions import RayTaskError

    try:
        raise cause
    except Exception:  # noqa: BLE001 - the traceback text Ray formats on the replica
        import traceback

        text = traceback.format_exc()
    return RayTaskError("handle_request", text, cause, pid=4242, ip="10.1.2.3").as_instanceof_cause()


def test_a_replica_failure_reaches_the_client_as_one_masked_line_not_the_replicas_traceback():
    server = _server("1")
    failure = OSError("could not read s3://mlflow/a?X-Amz-Signature=deadbeef AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI")

    async def fails(*args: Any) -> Any:
        raise _ray_task_error(failure)

    async def fails_to_stream(*args: Any) -> Any:
        raise _ray_task_error(failure)
        yield  # an async generator, as complete_stream is

    server.score = server.complete = fails  # type: ignore[method-assign] - the replica's calls, failing
    server.complete_stream = fails_to_stream  # type: ignore[method-assign]
    router, _ = _router({"1": server})
    expected = (
        "model version 1 failed: OSError: could not read s3://mlflow/a?X-Amz-Signature=*** AWS_SECRET_ACCESS_KEY=***"
    )

    async def scenario() -> list[dict[str, Any]]:
        scored = await router.respond("POST", "/v1/score", {}, b'{"text": "ab"}')
        whole = await router.respond("POST", "/v1/completions", {}, b'{"prompt": "ab", "max_tokens": 2}')
        streamed = await _stream(router, "/v1/completions", {"prompt": "ab", "max_tokens": 2, "stream": True})
        return [scored, whole, streamed[0]]

    for reply in asyncio.run(scenario()):
        status, error, headers = _error(reply)
        assert status == 503 and headers["retry-after"] == "1"
        assert error["message"] == expected and error["code"] == "model_failed"


def test_the_routers_own_route_sets_request_ids_itself_and_takes_serves_body_timeout():
    """On KubeRay the router is the ingress: a client repeating one request id kept all but its first request out of
    the canary's evidence (which counts an id once), and serve.body_timeout_s did not reach it (10 s always)."""
    from starlette.requests import Request

    router, _ = _router({"1": _server("1")}, body_timeout_s=0.2)

    def post(body: bytes | None) -> Request:
        async def receive() -> dict[str, Any]:
            if body is None:  # a client that never sends its body
                await asyncio.sleep(30)
            return {"type": "http.request", "body": body or b"", "more_body": False}

        headers = [(b"content-length", b"14"), (b"x-shardline-request-id", b"same-id")]
        return Request({"type": "http", "method": "POST", "path": "/v1/score", "headers": headers}, receive)

    async def scenario() -> list[Any]:
        return [await router(post(b'{"text": "ab"}')) for _ in range(2)] + [await router(post(None))]

    first, second, trickled = asyncio.run(scenario())
    assert first.status_code == second.status_code == 200
    ids = [o["request_id"] for o in router.observations]
    assert len(ids) == 2 and len(set(ids)) == 2 and "same-id" not in ids
    assert trickled.status_code == 408  # after the configured 0.2 s, which the message names
    assert json.loads(trickled.body)["error"]["message"] == "request body not received within serve.body_timeout_s=0.2"
