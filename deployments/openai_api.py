"""The OpenAI completions protocol as the live endpoint speaks it: request models, response and error objects
(the chat API, which runs as a completion, is deployments.openai_chat).

Pure pydantic and dicts, no Ray and no torch, so the router, the gateway and the tests share one definition of the
wire format. The shapes follow OpenAI's `/v1/completions` and `/v1/models` (and vLLM's extensions `top_k`); what
the endpoint cannot honour (n > 1, best_of > 1, suffix, logit_bias, penalties, token-id prompts) is a 400 that
names the parameter, never silently ignored.

Tokens: a byte-level model's token is one byte, so `usage` counts bytes for it. In `logprobs`, a byte that is not
a whole UTF-8 character on its own is written `bytes:\\xNN` (tiktoken's convention for partial characters).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from infra.redact import clip

M = TypeVar("M", bound=BaseModel)

MAX_LOGPROBS = 5  # OpenAI's limit for the completions API
MAX_STOP = 4

# parameters of OpenAI's API that the endpoint refuses unless they have their neutral value
_NEUTRAL = {"n": 1, "best_of": 1, "suffix": None, "logit_bias": None, "presence_penalty": 0, "frequency_penalty": 0}


class ApiError(Exception):
    """A request the endpoint refuses: HTTP status, a one-line message, OpenAI's error type, param and code."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        retry_after: float | None = None,
        allow: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after = retry_after
        self.allow = allow  # a 405's Allow header (RFC 9110): the method the path takes

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


class EmptyEncoding(ValueError):
    """A prompt that the answering version's codec encodes to no ids (a tokenizer whose pre-tokenizer drops
    whitespace, given only whitespace): nothing to condition on. The replica's engine raises it; the router answers
    it as the client's 400, neither a failure of that version nor canary evidence. Here, with no
    torch, so that the router can tell it from a replica's failure."""


def empty_encoding(chat: bool) -> ApiError:
    """The 400 that answers an EmptyEncoding: names `messages` for a chat request, else `prompt`."""
    if chat:
        return ApiError(400, "messages: render to a prompt that encodes to no tokens for this model", param="messages")
    return ApiError(400, "prompt: encodes to no tokens for this model", param="prompt")


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ApiModel(BaseModel):
    """A request object of the API: strict types, unknown parameters refused, and an explicit `null` for one of its
    own fields meaning that field's default, as in OpenAI's API, where every optional parameter is nullable (clients
    and tools built on it send `"max_tokens": null` or `"temperature": null`). A required field sent as null is
    then "Field required"."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


def check_stop(value: Any) -> Any:
    """`stop` as OpenAI takes it, a string or a list of strings, or ValueError saying so."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError(f"a string or a list of at most {MAX_STOP} strings, got {shown(value)}")


# OpenAI's `stop`, on completions and chat alike: checked before its union's members, so a wrong type is named
# `stop`, not pydantic's `stop.str`
Stop = Annotated[str | list[str] | None, BeforeValidator(check_stop)]


def shown(value: Any, as_json: bool = True) -> str:
    """A value as an error message quotes it, as JSON (or as Python's repr): at most 60 characters (a client's value
    may be of any size or depth: one nested close to the JSON parser's limit is named by its type, not re-encoded)."""
    try:
        text = json.dumps(value) if as_json and isinstance(value, (dict, list, int, float, bool)) else repr(value)
    except RecursionError:
        text = f"a deeply nested {type(value).__name__}"
    return clip(text, 60)


class StreamOptions(ApiModel):
    include_usage: bool = False
    include_obfuscation: bool = True  # OpenAI pads its stream chunks against side channels; these carry no padding


class CompletionRequest(ApiModel):
    """POST /v1/completions: OpenAI's parameters the endpoint honours (and the neutral values of the rest)."""

    model: str | None = None
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(16, ge=0, description="0 with echo and logprobs scores the prompt, as in OpenAI's API.")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0, description="0 keeps the likeliest token only.")
    top_k: int = Field(
        0, ge=-1, description="vLLM's extension: sample from the k likeliest tokens; 0 or -1 (vLLM's 'disabled') = all."
    )
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: Stop = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # refused unless neutral (see _NEUTRAL)
    n: int = 1
    best_of: int = 1
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ScoreRequest(ApiModel):
    """POST /v1/score: bits per byte of `text` under the model (shardline's own endpoint, not a cross-encoder)."""

    model: str | None = None
    text: str = Field(min_length=1)


def parse_json(body: bytes) -> Any:
    """The request body as JSON, or ApiError(400) with the parser's position; a string holding half of a UTF-16
    surrogate pair (`"\\ud800"`, which no UTF-8 text can hold) is refused naming the field it is in."""
    try:
        text = body.decode("utf-8-sig")  # strictly: raw surrogates or UTF-16 are not the UTF-8 the API takes
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"body is not JSON: {e.msg} at position {e.pos}") from None
    except UnicodeDecodeError as e:
        raise ApiError(400, f"body is not UTF-8 JSON: byte {e.start} is not UTF-8") from None
    except RecursionError:
        raise ApiError(400, "body is not JSON this endpoint accepts: nested too deeply") from None
    except ValueError as e:  # Python's own limit on a number's digits (4300)
        raise ApiError(400, f"body is not JSON this endpoint accepts: {str(e).split(';')[0]}") from None
    if "\\u" in text and (where := _lone_surrogate(data, "")) is not None:  # only an escape can make one now
        field = where or "body"
        raise ApiError(400, f"{field}: holds an unpaired UTF-16 surrogate (\\ud800-\\udfff), not text", param=field)
    return data


def _lone_surrogate(value: Any, where: str) -> str | None:
    """Where in a JSON value a string (or an object's key) holds an unpaired surrogate, OpenAI-style
    (`messages[0].content`), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        inner = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key)
        if isinstance(key, str) and _lone_surrogate(key, "") is not None:
            return where or "body"
        if (found := _lone_surrogate(item, inner)) is not None:
            return found
    return None


def field_path(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as OpenAI writes a param (`messages[0].content`), without pydantic's labels of a
    union's members (`stop.str`, `stop.list[str]`), shortened past 100 characters (an unknown key is echoed)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in _UNION_LABELS and "[" not in str(part):
            out += f".{part}" if out else str(part)
    return clip(out, 100)


_UNION_LABELS = {"str", "int", "float", "bool", "dict", "list", "none"}


def model_or_error(model: type[M], data: Any) -> M:
    """`model` validated from a request body, or ApiError(400) naming the first field that is wrong or unknown."""
    if not isinstance(data, dict):
        raise ApiError(400, f"body: must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = field_path(first["loc"]) or "body"
        if first["type"] == "extra_forbidden":  # the last part is the client's own key, whatever it reads
            within, key = field_path(first["loc"][:-1]), str(first["loc"][-1])
            where = clip(f"{within}.{key}" if within else key, 100)
            raise ApiError(400, f"{where}: unsupported parameter", param=where, code="unsupported_parameter") from None
        message = str(first["msg"]).removeprefix("Value error, ")
        raise ApiError(400, f"{where}: {message}", param=None if where == "body" else where) from None


def validate(
    endpoint: Literal["completions", "score"],
    data: Any,
    max_prompt_bytes: int,
    max_tokens_cap: int,
) -> CompletionRequest | ScoreRequest:
    """A request object, or ApiError(400) naming the first parameter that is wrong or not supported."""
    model: type[CompletionRequest | ScoreRequest] = CompletionRequest if endpoint == "completions" else ScoreRequest
    if endpoint == "completions" and isinstance(data, dict) and isinstance(data.get("prompt"), list):
        prompts = data["prompt"]
        if len(prompts) == 1 and isinstance(prompts[0], str):
            data = {**data, "prompt": prompts[0]}  # a batch of one prompt is that prompt
        else:
            raise ApiError(
                400,
                "prompt: only one prompt string per request is supported (no batches or token ids)",
                param="prompt",
                code="unsupported_parameter",
            )
    req = model_or_error(model, data)
    if isinstance(req, CompletionRequest):
        for name, neutral in _NEUTRAL.items():
            value = getattr(req, name)
            if value is not None and value != neutral and (neutral is not None or value):
                raise ApiError(
                    400,
                    f"{name}: only {neutral!r} is supported, got {shown(getattr(req, name), as_json=False)}",
                    param=name,
                    code="unsupported_parameter",
                )
        if len(req.stops()) > MAX_STOP or any(not s for s in req.stops()):
            raise ApiError(400, f"stop: at most {MAX_STOP} non-empty strings", param="stop")
        if req.max_tokens > max_tokens_cap:
            raise ApiError(
                400, f"max_tokens: {req.max_tokens} > serve.max_tokens_cap={max_tokens_cap}", param="max_tokens"
            )
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options: only allowed with stream: true", param="stream_options")
    text = req.prompt if isinstance(req, CompletionRequest) else req.text
    size = len(text.encode("utf-8"))
    field = "prompt" if isinstance(req, CompletionRequest) else "text"
    if size > max_prompt_bytes:
        raise ApiError(400, f"{field}: {size} bytes > serve.max_prompt_bytes={max_prompt_bytes}", param=field)
    if isinstance(req, ScoreRequest) and size < 2:
        raise ApiError(400, "text: needs at least 2 bytes (the first byte is never predicted)", param="text")
    return req


def model_not_found(model: str, served: list[str]) -> ApiError:
    """OpenAI's 404 model_not_found, naming what is served."""
    return ApiError(
        404,
        f"model: {shown(model)} is not served here; served: {', '.join(served) or 'none'}",
        param="model",
        code="model_not_found",
    )


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def completion(
    cid: str,
    model: str,
    version: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: dict[str, Any] | None,
    prompt_bpb: float | None,
) -> dict[str, Any]:
    """OpenAI's `text_completion` object, plus shardline's `model_version` and `prompt_bits_per_byte`."""
    return {
        **envelope(cid, model, version),
        "choices": [{"text": text, "index": 0, "finish_reason": finish_reason, "logprobs": logprobs}],
        "usage": usage(prompt_tokens, completion_tokens),
        "model_version": version,
        "prompt_bits_per_byte": prompt_bpb,
    }


def envelope(cid: str, model: str, version: str, kind: str = "text_completion") -> dict[str, Any]:
    """The fields every completion object and stream chunk starts with (`kind`: its `object`)."""
    return {
        "id": cid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": f"{model}-v{version}",
    }


def chunk(
    cid: str, model: str, version: str, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One streamed piece of a completion (the same object, `choices[0].text` holding the new text only)."""
    return {
        **envelope(cid, model, version),
        "choices": [{"text": text, "index": 0, "finish_reason": finish_reason, "logprobs": logprobs}],
        "model_version": version,
    }


def usage_chunk(
    cid: str, model: str, version: str, prompt_tokens: int, completion_tokens: int, kind: str = "text_completion"
) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    return {
        **envelope(cid, model, version, kind),
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
        "model_version": version,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


DONE = sse("[DONE]")


def model_card(model: str, version: str, created: float | None = None) -> dict[str, Any]:
    """One entry of GET /v1/models: OpenAI's model object, plus the champion version it serves."""
    return {
        "id": model,
        "object": "model",
        "created": int(created or time.time()),
        "owned_by": "shardline",
        "champion_version": version,
    }


def model_list(cards: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": sorted(cards, key=lambda c: c["id"])}
