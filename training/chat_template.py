"""Chat templates: Jinja in Hugging Face's chat-template dialect, the way transformers' `apply_chat_template` runs it,
and where a model's own template comes from.

A template sees `messages` (each `{"role", "content"}`), `add_generation_prompt` (always true: the model answers
next), `bos_token` and `eos_token` (empty strings: unlike transformers, which passes the tokenizer's own special
tokens, the endpoint knows none; a template that writes them writes nothing there), `raise_exception(message)` and
`strftime_now(format)`, with the `tojson` filter that keeps non-ASCII text and the loop controls (`break`,
`continue`). It renders in Jinja's immutable sandbox with `trim_blocks` and `lstrip_blocks`.

A model version carries its tokenizer's template (`tokenizer.chat_template`, or found beside a `tokenizer.path`
the way a Hugging Face tokenizer directory holds it: `chat_template.jinja`, else `tokenizer_config.json`'s
`chat_template`); the endpoint renders a chat request with the template of the version that answers it
(deployments.openai_chat), unless `serve.chat_template` overrides every version's, as vLLM's `--chat-template` does.
"""

from __future__ import annotations

import functools
import hashlib
import json
from datetime import datetime
from typing import Any

from infra import storage
from infra.redact import first_line, redact

JINJA_FILE = "chat_template.jinja"  # what transformers >= 4.47 saves beside the tokenizer
CONFIG_FILE = "tokenizer_config.json"  # where older transformers keep it, as "chat_template"


class TemplateRefused(ValueError):
    """The template raised while rendering (its `raise_exception`, or any error): one line."""


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> Any:
    """The Jinja template of a chat template's source, in the immutable sandbox.

    Raises:
        ValueError: one line with Jinja's message and line, when the source does not parse.
    """
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"not a Jinja template: line {e.lineno}: {e.message}") from None


def render(source: str, messages: list[dict[str, str]]) -> str:
    """The prompt a chat template makes of `messages`, ready for the model to answer.

    Raises:
        TemplateRefused: the template refused the messages (its `raise_exception`, or an error while rendering).
    """
    import jinja2

    try:
        return str(
            compile_template(source).render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
        )
    except Exception as e:  # noqa: BLE001 - the model's template: whatever it raises is the request's refusal
        cause = first_line(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {first_line(e)}"
        raise TemplateRefused(cause) from None


def fingerprint(source: str) -> str:
    """sha256 of a template's text (a lineage tag; '' for none)."""
    return hashlib.sha256(source.encode("utf-8")).hexdigest() if source else ""


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
    parent = tokenizer_json.rsplit("/", 1)[0] if "/" in tokenizer_json else "."
    for name in (JINJA_FILE, CONFIG_FILE):
        candidate = storage.join(parent, name)
        try:
            present = storage.exists(candidate)
        except Exception as e:  # noqa: BLE001 - any store's error (a 403, a timeout): one line naming the file
            raise ValueError(f"{redact(candidate)}: cannot be read: {first_line(e)}") from None
        if not present:
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
