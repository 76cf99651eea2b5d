"""HTTP plumbing shared by the gateway and the routers: bounded body reads, replies as plain dicts, auth.

A reply crosses Serve's deployment handles as a dict ({"status", "headers", "media_type", "body"}), so the router
can answer the gateway and, in a single-model application (KubeRay), its own HTTP requests with one code path.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayTaskError

from deployments.openai_api import ApiError
from infra.redact import first_line

JSON = "application/json"
TOKEN_SPACE = b" \t\r\n\x0b\x0c"  # what surrounds a bearer token without being part of it: ASCII whitespace
EVENT_STREAM = "text/event-stream"
# the methods /healthz and /metrics answer: a load balancer's health check is often a HEAD (the HTTP server sends
# the GET reply's status and headers, without the body)
READS = ("GET", "HEAD")


def failure_line(e: BaseException) -> str:
    """How a failure reads in a client's error message: `Type: first line`, credentials masked, at most 300
    characters. A replica's failure arrives as a RayTaskError whose text is the replica's traceback (its pid and
    address, file paths): it reads as its cause."""
    while isinstance(e, RayTaskError) and isinstance(e.cause, BaseException) and e.cause is not e:
        e = e.cause
    return f"{type(e).__name__}: {first_line(e)}"[:300]


def reply(status: int, payload: Any, headers: dict[str, str] | None = None, media_type: str = JSON) -> dict[str, Any]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return {"status": status, "headers": dict(headers or {}), "media_type": media_type, "body": body}


def error_reply(e: ApiError, headers: dict[str, str] | None = None) -> dict[str, Any]:
    extra = dict(headers or {})
    if e.retry_after is not None:
        extra["retry-after"] = str(max(1, round(e.retry_after)))
    if e.allow is not None:
        extra["allow"] = e.allow
    return reply(e.status, e.body(), extra)


async def read_body(request: Any, limit: int, timeout_s: float | None = None) -> bytes:
    """The body, or ApiError(413) when it is over `limit` (from Content-Length before reading, else while
    streaming: a chunked body is never held past the limit), or ApiError(408) when it has not arrived whole within
    `timeout_s` (a client trickling its body holds no connection for long)."""
    declared = request.headers.get("content-length")
    too_large = ApiError(413, f"request body over serve.max_request_bytes={limit}", code="request_too_large")
    if (
        declared is not None
        and declared.isascii()
        and declared.isdigit()
        and (len(declared) > 18 or int(declared) > limit)
    ):
        raise too_large
    chunks, size = [], 0

    async def receive() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)

    try:
        async with asyncio.timeout(timeout_s):
            await receive()
    except TimeoutError:
        raise ApiError(
            408, f"request body not received within serve.body_timeout_s={timeout_s}", code="request_timeout"
        ) from None
    return b"".join(chunks)


def endpoint_of(path: str) -> str:
    """The endpoint a request path names (without a trailing slash): chat, completions, score, models, or "" for
    none. Metrics label refusals by it, never by the raw path, which would make a series per URL a client tries."""
    if path.endswith("/v1/chat/completions"):
        return "chat"
    if path.endswith("/v1/completions"):
        return "completions"
    if path.endswith("/v1/score"):
        return "score"
    if path.endswith("/v1/models") or "/v1/models/" in path:
        return "models"
    return ""


def check_token(headers: dict[str, str], token_sha256: str) -> None:
    """ApiError(401) unless the bearer token's sha256 is `token_sha256` ("" = no auth)."""
    if not token_sha256:
        return
    scheme, _, token = headers.get("authorization", "").partition(" ")
    try:  # ASGI servers decode header bytes as latin-1: encoding back gives the bytes the client sent (UTF-8)
        raw = token.encode("latin-1")
    except UnicodeEncodeError:  # a str that did not come from the wire (a caller's own dict)
        raw = token.encode()
    digest = hashlib.sha256(raw.strip(TOKEN_SPACE)).hexdigest()  # bytes: str.strip would eat \x85 and \xa0
    if scheme.lower() != "bearer" or not hmac.compare_digest(digest, token_sha256):  # the scheme is case-insensitive
        # as OpenAI answers a wrong key
        raise ApiError(401, "missing or wrong bearer token", kind="invalid_request_error", code="invalid_api_key")


def peek(body: bytes) -> tuple[str | None, bool]:
    """The request's `model` and `stream` fields if the body is a JSON object that has them (the gateway routes on
    them; the router validates the body in full)."""
    try:
        data = json.loads(body) if body else None
    except (ValueError, RecursionError):
        return None, False
    if not isinstance(data, dict):
        return None, False
    model = data.get("model")
    return (model if isinstance(model, str) else None), data.get("stream") is True


def to_response(out: dict[str, Any]) -> Any:
    from starlette.responses import Response

    return Response(out["body"], status_code=out["status"], headers=out["headers"], media_type=out["media_type"])


async def to_streaming_response(head: dict[str, Any], rest: AsyncIterator[Any]) -> Any:
    """A StreamingResponse from a reply head and the body chunks that follow it."""
    from starlette.responses import StreamingResponse

    return StreamingResponse(rest, status_code=head["status"], headers=head["headers"], media_type=head["media_type"])
