"""OpenAI's chat completions API on the live endpoint: the request, its messages rendered into one prompt by the
answering version's chat template, and the `chat.completion` objects and stream chunks.

The template is the answering version's own (its tokenizer's, logged with it), unless `serve.chat_template`
overrides every version's; training.chat_template describes the dialect (Hugging Face's, rendered as transformers'
`apply_chat_template` renders it) and where a version's template comes from. A content given as text parts is
their texts joined by newlines. The router picks the version first, then renders (`parse_chat`, then
`render_prompt`): a canary's champion and challenger each answer in their own format. The rendered prompt is then
an ordinary completion: the same router, canary evidence, limits (`serve.max_prompt_bytes` applies to the
rendered prompt) and generation engine. What the chat API has and the endpoint cannot honour (n > 1, logprobs,
tools, response formats, penalties) is a 400 that names the parameter.

Pure pydantic, Jinja (training.chat_template) and dicts, no Ray and no torch, like deployments.openai_api.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from deployments.openai_api import (
    ApiError,
    ApiModel,
    CompletionRequest,
    Stop,
    StreamOptions,
    envelope,
    model_or_error,
    shown,
    usage,
    validate,
)
from training import chat_template

PLACEHOLDER = "?"  # the prompt of a parsed chat request until a version's template renders its messages

# OpenAI chat parameters refused unless neutral (as openai_api refuses its own)
_NEUTRAL: dict[str, Any] = {
    "n": 1,
    "logprobs": False,
    "top_logprobs": None,
    "logit_bias": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "tools": None,
    "tool_choice": None,
    "response_format": None,
    "functions": None,
    "function_call": None,
    "store": False,
    "service_tier": None,
    "reasoning_effort": None,
    "modalities": None,
    "prediction": None,
    "audio": None,
    "verbosity": None,
    "web_search_options": None,
}
# an empty list or object of these means none (`tools: []`); an empty value of any other is refused as OpenAI does
_EMPTY_IS_NEUTRAL = {"tools", "functions", "logit_bias"}
# other values that mean the neutral one, which clients send explicitly (OpenAI's own defaults)
_ALSO_NEUTRAL: dict[str, list[Any]] = {
    "response_format": [{"type": "text"}],
    "tool_choice": ["none"],
    "function_call": ["none"],
    "service_tier": ["auto", "default"],
    "modalities": [["text"]],
    "verbosity": ["medium"],
}


class ChatMessage(ApiModel):
    """One message. An assistant's may come back as the endpoint answered it (`refusal`, `tool_calls`,
    `annotations`, `audio` null or empty, `content` null), since clients append the reply they got to the
    conversation."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | None = Field(None, validate_default=True)
    name: str | None = None
    refusal: Any = None
    tool_calls: Any = None
    function_call: Any = None
    audio: Any = None
    annotations: Any = None

    @field_validator("refusal", "tool_calls", "function_call", "audio", "annotations")
    @classmethod
    def _null_or_empty(cls, value: Any) -> Any:
        if value not in ([], {}, ""):  # a null never gets here: it is the default
            raise ValueError("only null or empty is supported (no tools, refusals or audio here)")
        return None

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, value: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")  # validated before content (field order); absent when it was refused
        if value is None and role is not None and role != "assistant":
            raise ValueError(f"required for a {role} message")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        """A content given as text parts is their texts joined by newlines; any other part is refused."""
        if not isinstance(value, list):
            return value
        if value and all(isinstance(p, dict) and p.keys() == {"type", "text"} and p["type"] == "text" for p in value):
            if all(isinstance(p["text"], str) for p in value):
                return "\n".join(p["text"] for p in value)
        raise ValueError('only a string or text parts ({"type": "text", "text": ...}) are supported')


class ChatRequest(ApiModel):
    """POST /v1/chat/completions: OpenAI's parameters the endpoint honours (and the neutral values of the rest)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's extension: 0 or -1 (vLLM's "disabled") = all
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # refused unless neutral (see _NEUTRAL)
    n: int = 1
    logprobs: bool = False
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    store: bool = False
    service_tier: Any = None
    reasoning_effort: Any = None
    modalities: Any = None
    prediction: Any = None
    audio: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    # accepted, without effect on the answer (like `user`): hints and labels for OpenAI's own services
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None  # about tools, which are refused


def render(source: str | chat_template.ChatFormat, messages: list[dict[str, str]], max_bytes: int = 0) -> str:
    """The prompt a chat template makes of `messages`, ready for the model to answer (training.chat_template.render:
    stopped past `max_bytes`, 0 for no limit, or past its time budget).

    Raises:
        ApiError: 400 naming messages when the template refuses them (its `raise_exception`, an error while
            rendering, or its time budget) or renders them longer than `max_bytes`.
    """
    try:
        return chat_template.render(source, messages, max_bytes)
    except chat_template.TemplateRefused as e:
        raise ApiError(400, f"messages: the model's chat template refused them: {e}", param="messages") from None
    except chat_template.PromptTooLong:
        what = f"the rendered prompt has more than serve.max_prompt_bytes={max_bytes} bytes"
        raise ApiError(400, f"messages: {what}", param="messages") from None


def render_prompt(source: str | chat_template.ChatFormat, messages: list[dict[str, str]], max_prompt_bytes: int) -> str:
    """`render` held to serve.max_prompt_bytes, and not empty (ApiError 400 naming messages)."""
    prompt = render(source, messages, max_prompt_bytes)
    if not prompt:
        raise ApiError(400, "messages: the model's chat template rendered them as an empty prompt", param="messages")
    return prompt


def validate_chat(data: Any, template: str, max_prompt_bytes: int, max_tokens_cap: int) -> CompletionRequest:
    """The chat request as the completion it runs as, its messages rendered by `template` (parse_chat, then
    render_prompt)."""
    req, messages = parse_chat(data, max_tokens_cap)
    return req.model_copy(update={"prompt": render_prompt(template, messages, max_prompt_bytes)})


def parse_chat(data: Any, max_tokens_cap: int) -> tuple[CompletionRequest, list[dict[str, str]]]:
    """The chat request as the completion it runs as, with a placeholder prompt, and its messages; or
    ApiError(400) naming the first parameter that is wrong or not supported. Which template renders the messages
    depends on the version that answers (the router's choice), so the prompt is set after it: the caller puts
    `render_prompt(...)` in the placeholder's place. Without `max_tokens`, the answer may run to
    serve.max_tokens_cap."""
    req = model_or_error(ChatRequest, data)
    for name, neutral in _NEUTRAL.items():
        value = getattr(req, name)
        if value in _ALSO_NEUTRAL.get(name, []):
            continue
        if value is not None and value != neutral and not (name in _EMPTY_IS_NEUTRAL and value in ([], {})):
            raise ApiError(
                400,
                f"{name}: only {neutral!r} is supported, got {shown(value, as_json=False)}",
                param=name,
                code="unsupported_parameter",
            )
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise ApiError(400, "max_tokens and max_completion_tokens: give one", param="max_completion_tokens")
    asked, field = (
        (req.max_completion_tokens, "max_completion_tokens")
        if req.max_completion_tokens is not None
        else (req.max_tokens, "max_tokens")
    )
    if asked is not None and asked > max_tokens_cap:
        raise ApiError(400, f"{field}: {asked} > serve.max_tokens_cap={max_tokens_cap}", param=field)
    completion = {
        "model": req.model,
        "prompt": PLACEHOLDER,
        "max_tokens": asked or max_tokens_cap,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "seed": req.seed,
        "stop": req.stop,
        "stream": req.stream,
        "stream_options": req.stream_options.model_dump() if req.stream_options else None,
        "user": req.user,
    }
    out = validate("completions", completion, len(PLACEHOLDER), max_tokens_cap)
    assert isinstance(out, CompletionRequest)  # validate("completions", ...) returns one
    messages = [m.model_dump(include={"role", "content", "name"}, exclude_none=True) for m in req.messages]
    return out, [{**m, "content": m.get("content", "")} for m in messages]


def chat_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def chat_completion(
    cid: str,
    model: str,
    version: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    prompt_bpb: float | None,
) -> dict[str, Any]:
    """OpenAI's `chat.completion` object, plus shardline's `model_version` and `prompt_bits_per_byte`."""
    message = {"role": "assistant", "content": text, "refusal": None}
    return {
        **envelope(cid, model, version, "chat.completion"),
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": usage(prompt_tokens, completion_tokens),
        "model_version": version,
        "prompt_bits_per_byte": prompt_bpb,
    }


def chat_chunk(cid: str, model: str, version: str, delta: dict[str, str], finish_reason: str | None) -> dict[str, Any]:
    """One streamed piece of a chat completion: `choices[0].delta` holds the role (first) or the new text."""
    return {
        **envelope(cid, model, version, "chat.completion.chunk"),
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
        "model_version": version,
    }
