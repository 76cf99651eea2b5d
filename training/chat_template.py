"""Chat templates: Jinja in Hugging Face's chat-template dialect, the way transformers' `apply_chat_template` runs it,
and where a model's own template comes from.

A template sees `messages` (each `{"role", "content"}`), `add_generation_prompt` (always true: the model answers
next), `bos_token` and `eos_token` (the tokenizer's, as transformers passes its special tokens: see `ChatFormat`;
an empty string where the tokenizer names none), `raise_exception(message)` and
`strftime_now(format)`, with the `tojson` filter that keeps non-ASCII text and the loop controls (`break`,
`continue`). It renders in Jinja's immutable sandbox with `trim_blocks` and `lstrip_blocks`.

Rendering is bounded, because the endpoint renders every chat request: it stops once the prompt passes the byte
limit it will be held to (`serve.max_prompt_bytes`), and once it has taken `RENDER_BUDGET_S` of CPU time (checked at
every piece of output, every attribute or item the template reads, every call and every loop iteration), each a
refusal that says which. The sandbox keeps a template from reaching out of it; the budget keeps a template that is
slow on large inputs from holding a replica's thread. Neither bounds one operation written to exhaust memory
(`'x' * 10**10`): templates are the operator's and the registry's, not the client's.

A model version carries its tokenizer's template (`tokenizer.chat_template`, or found beside a `tokenizer.path`
the way a Hugging Face tokenizer directory holds it: `chat_template.jinja`, else `tokenizer_config.json`'s
`chat_template`); the endpoint renders a chat request with the template of the version that answers it
(deployments.openai_chat), unless `serve.chat_template` overrides every version's, as vLLM's `--chat-template` does.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from infra import storage
from infra.redact import first_line, redact

JINJA_FILE = "chat_template.jinja"  # what transformers >= 4.47 saves beside the tokenizer
CONFIG_FILE = "tokenizer_config.json"  # where older transformers keep it, as "chat_template"


SPECIAL_TOKENS = ("bos_token", "eos_token")  # the special tokens a template sees, as transformers names them


@dataclass(frozen=True)
class ChatFormat:
    """How a version turns chat into a prompt: its template and the special tokens its tokenizer gives the
    template (as transformers' `apply_chat_template` passes `bos_token` and `eos_token`).

    The tokens come from the `tokenizer_config.json` the template came from, else the one beside `tokenizer.path`
    (a Hugging Face tokenizer directory; `special_tokens`). Validation keeps only those the tokenizer has (none for
    bytes) and names an eos_token nobody named as the transformers flavor's tokenizer does (a BPE trained in the
    run: its `<|endoftext|>`), so the endpoint and `apply_chat_template` on the flavor render alike
    (training.servable.log_servable_model); '' where none is named. False when there is no template.
    """

    template: str = ""
    bos_token: str = ""
    eos_token: str = ""

    def __bool__(self) -> bool:
        return bool(self.template)

    def tokens(self) -> dict[str, str]:
        """The special tokens that are named, by their transformers names (empty ones left out)."""
        return {k: v for k in SPECIAL_TOKENS if (v := getattr(self, k))}

    @classmethod
    def given(cls, held: ChatFormat | str) -> ChatFormat:
        """A format as given: itself, or a bare template's (no special tokens)."""
        return held if isinstance(held, ChatFormat) else cls(held)

    @classmethod
    def of(cls, template: str, tokens: Mapping[str, Any] | None = None) -> ChatFormat:
        """The format of `template` with the string tokens of `tokens` that a template sees (others ignored)."""
        held = tokens if isinstance(tokens, Mapping) else {}
        return cls(template, **{k: held[k] for k in SPECIAL_TOKENS if isinstance(held.get(k), str)})


NO_CHAT = ChatFormat()  # a tokenizer without a chat template or special tokens


RENDER_BUDGET_S = 1.0  # the most CPU time one render may take (its thread's: waiting for the GIL is not counted)

_CLOCK_EVERY = 32  # checks between two reads of the thread's CPU clock (a system call, ~1 µs)


class _Budget:
    """The running render's deadline on its thread's CPU clock (0: none), read every `_CLOCK_EVERY` checks."""

    __slots__ = ("deadline", "left")

    def __init__(self, deadline: float) -> None:
        self.deadline, self.left = deadline, 0


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)


class TemplateRefused(ValueError):
    """The template raised while rendering (its `raise_exception`, or any error), or ran past its time budget:
    one line."""


class PromptTooLong(ValueError):
    """The rendered prompt passed the byte limit rendering was held to: rendering stopped there."""


class _OverBudget(Exception):
    """A render ran past its budget: raised in the template's frames, turned into TemplateRefused by render."""


def _check_deadline() -> None:
    budget = _budget.get()
    if budget is None or not budget.deadline:
        return
    if budget.left > 0:
        budget.left -= 1
        return
    budget.left = _CLOCK_EVERY
    if time.thread_time() > budget.deadline:
        raise _OverBudget


_LOOP_GUARD = "shardline_bounded_loop"  # the global every for loop's iterable passes through (compile_template)


def _bounded_loop(iterable: Any) -> Any:
    """`iterable`'s items, the render's deadline checked before each: a loop that reads and writes nothing (at the
    top level, or inside a macro, a `set` block or a `filter` block, whose output Jinja collects whole) still ends."""
    for item in iterable:
        _check_deadline()
        yield item


def _sandbox() -> Any:
    """Jinja's immutable sandbox, checking the render's deadline at every attribute or item a template reads and
    every call it makes (functions, methods, macros)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        def getattr(self, obj: Any, attribute: str) -> Any:
            _check_deadline()
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            _check_deadline()
            return super().getitem(obj, argument)

        def call(self, context: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
            _check_deadline()
            return super().call(context, obj, *args, **kwargs)

    return Bounded


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> Any:
    """The Jinja template of a chat template's source, in the immutable sandbox, with every `for` loop's iterable
    passed through `_bounded_loop` (Jinja's own loop object takes any iterable: `loop.length`, `loop.last` work).

    Raises:
        ValueError: one line with Jinja's message and line, when the source does not parse.
    """
    import jinja2
    from jinja2 import nodes

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = _sandbox()(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals[_LOOP_GUARD] = _bounded_loop
    try:
        tree = env.parse(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"not a Jinja template: line {e.lineno}: {e.message}") from None
    for loop in tree.find_all(nodes.For):
        guard = nodes.Call(nodes.Name(_LOOP_GUARD, "load"), [loop.iter], [], None, None)
        loop.iter = guard.set_lineno(loop.iter.lineno)
    return env.from_string(tree)


def render(
    source: str | ChatFormat, messages: list[dict[str, str]], max_bytes: int = 0, budget_s: float = RENDER_BUDGET_S
) -> str:
    """The prompt a chat template (with its tokenizer's special tokens, when a ChatFormat) makes of `messages`,
    ready for the model to answer.

    Args:
        max_bytes: stop once the prompt has more UTF-8 bytes than this (0: no limit).
        budget_s: stop once rendering has run this long (0: no limit).

    Raises:
        TemplateRefused: the template refused the messages (its `raise_exception`, or an error while rendering), or
            ran past `budget_s`.
        PromptTooLong: the prompt passed `max_bytes` (the message says so; rendering stopped there).
    """
    import jinja2

    fmt = ChatFormat.given(source)
    token = _budget.set(_Budget(time.thread_time() + budget_s if budget_s else 0.0))
    parts: list[str] = []
    size = 0
    try:
        template = compile_template(fmt.template)  # parsed when the version was loaded: a refusal if it is not
        for part in template.generate(
            messages=messages, add_generation_prompt=True, bos_token=fmt.bos_token, eos_token=fmt.eos_token
        ):
            parts.append(part)
            size += len(part.encode("utf-8"))
            if max_bytes and size > max_bytes:
                raise PromptTooLong(f"the rendered prompt has more than {max_bytes} bytes")
            _check_deadline()
    except PromptTooLong:
        raise
    except _OverBudget:
        raise TemplateRefused(f"rendering took more than {budget_s:g} s of CPU time") from None
    except Exception as e:  # noqa: BLE001 - the model's template: whatever it raises is the request's refusal
        cause = first_line(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {first_line(e)}"
        raise TemplateRefused(cause) from None
    finally:
        _budget.reset(token)
    return "".join(parts)


def fingerprint(source: str) -> str:
    """sha256 of a template's text (a lineage tag; '' for none)."""
    return hashlib.sha256(source.encode("utf-8")).hexdigest() if source else ""


def tokens_tag(tokens: dict[str, str]) -> str:
    """A ChatFormat's tokens as a lineage tag's value: JSON, keys sorted ('' for none)."""
    return json.dumps(tokens, sort_keys=True, ensure_ascii=False) if tokens else ""


def tokens_of_tag(tag: str) -> dict[str, Any]:
    """`tokens_tag` read back ({} for ''); a tag that is not that JSON (set by hand, or cut at MLflow's length
    limit) is kept as text under "unparsed"."""
    try:
        tokens = json.loads(tag) if tag else {}
    except ValueError:
        return {"unparsed": tag}
    return tokens if isinstance(tokens, dict) else {"unparsed": tag}


def read(uri: str) -> str:
    """The template in a file: a `.jinja` file's text, or a `tokenizer_config.json`'s "chat_template" (a string).

    Raises:
        ValueError: one line naming the file: unreadable, not UTF-8, no usable "chat_template", or not Jinja.
    """
    return _parsed(uri, _text(uri))


def _text(uri: str) -> str:
    """A file's text (ValueError, one line naming it, when it cannot be read or is not UTF-8)."""
    try:
        return storage.read_bytes(uri).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{redact(uri)}: not UTF-8 text (byte {e.start})") from None
    except Exception as e:  # noqa: BLE001 - any store's missing or unreadable file: one line naming it
        raise ValueError(f"{redact(uri)}: cannot be read: {first_line(e)}") from None


def _exists(uri: str) -> bool:
    """Whether a file is there (ValueError, one line naming it, when the store cannot say: a 403, a timeout)."""
    try:
        return storage.exists(uri)
    except Exception as e:  # noqa: BLE001 - any store's error: one line naming the file
        raise ValueError(f"{redact(uri)}: cannot be read: {first_line(e)}") from None


def _parsed(uri: str, text: str) -> str:
    """The template in the text of file `uri` (see `read`), checked to parse."""
    where = redact(uri)
    if uri.endswith(".json"):
        try:
            held = json.loads(text).get("chat_template")
        except (ValueError, AttributeError):
            raise ValueError(f"{where}: not a JSON object") from None
        text = _default_template(held)
        if not text:
            raise ValueError(f"{where}: has no chat_template (a string, or a list of named ones with 'default')")
    try:
        compile_template(text)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return text


def _default_template(held: Any) -> str:
    """A tokenizer_config.json's chat_template: the string, or from a list of named templates the one named
    'default', which is what `apply_chat_template` uses when no name is given; '' for neither."""
    if isinstance(held, list):
        named = {t.get("name"): t.get("template") for t in held if isinstance(t, dict)}
        held = named.get("default")
    return held if isinstance(held, str) else ""


def discover(tokenizer_json: str) -> str:
    """The chat template stored beside a tokenizer.json as a Hugging Face tokenizer directory holds it, or ''.

    Raises:
        ValueError: a file is there but is not a usable template (one line naming it).
    """
    for name in (JINJA_FILE, CONFIG_FILE):
        candidate = beside(tokenizer_json, name)
        if not _exists(candidate):
            continue
        text = _text(candidate)  # read once: a tokenizer_config.json is looked into, then parsed, from this
        if name == CONFIG_FILE:
            try:
                held = json.loads(text).get("chat_template")
            except (ValueError, AttributeError):
                held = None
            if not held:
                continue  # a tokenizer_config.json without a template is just that
        return _parsed(candidate, text)
    return ""


def special_tokens(config_uri: str) -> tuple[dict[str, str], bool]:
    """`bos_token` and `eos_token` of a `tokenizer_config.json` or `special_tokens_map.json`, the ones named only
    (a string, or an AddedToken's `{"content": ...}`; "" for one named as null or empty, which clears it when the
    file is merged over another, as transformers assigns it), and whether the file has an `added_tokens_decoder`
    (a tokenizer_config.json that has one is read without special_tokens_map.json, as transformers reads it);
    ({}, False) when the file is absent.

    Raises:
        ValueError: the file is there but cannot be read or is not JSON (one line naming it).
    """
    if not _exists(config_uri):
        return {}, False
    text = _text(config_uri)  # ValueError naming it: unreadable, or not UTF-8
    try:
        held = json.loads(text)
    except ValueError:
        raise ValueError(f"{redact(config_uri)}: not JSON") from None
    if not isinstance(held, dict):
        return {}, False
    out: dict[str, str] = {}
    for key in SPECIAL_TOKENS:
        if key not in held:
            continue
        value = held[key]
        value = value.get("content") if isinstance(value, dict) else value
        out[key] = value if isinstance(value, str) else ""  # named as none: it clears one named before it
    return out, "added_tokens_decoder" in held


def beside(tokenizer_json: str, name: str = CONFIG_FILE) -> str:
    """The URI of file `name` in the directory of a tokenizer.json (a Hugging Face tokenizer directory)."""
    parent = tokenizer_json.rsplit("/", 1)[0] if "/" in tokenizer_json else "."
    return storage.join(parent, name)
