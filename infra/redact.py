"""Redaction of credentials in URI-like values and text, before anything reaches MLflow, Prefect, logs or the CLI.

One function decides what a credential looks like (`find_credential`), one rewrites it (`redact`): the password of
`scheme://user:password@host` (a bare `scheme://token@host` too), query keys that carry signatures or tokens
(`sig`, `X-Amz-*`, `token`, ...), and the secret parts of connection strings (`AccountKey=`,
`SharedAccessSignature=`, `Password=`).
"""

from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import parse_qsl, urlsplit

MASK = "***"
_SECRET_QUERY_KEYS = {
    "sig",
    "signature",
    "token",
    "access_token",
    "id_token",
    "refresh_token",
    "password",
    "passwd",
    "pwd",
    "secret",
    "client_secret",
    "api_key",
    "apikey",
    "key",
    "code",
    "awsaccesskeyid",
    "sharedaccesssignature",
    "accountkey",
    "credential",
    "credentials",
    "auth",
    "authorization",
}
_CONN_KEYS = ("AccountKey", "SharedAccessSignature", "SharedAccessKey", "Password", "Pwd", "AccessKey", "Secret")
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
_CONN = re.compile(r"(?i)\b(" + "|".join(_CONN_KEYS) + r")=([^;\s'\"]+)")
_QUERY_PAIR = re.compile(r"([?&;])([^=&#\s]+)=([^&#\s]*)")


def _secret_key(key: str) -> bool:
    k = key.lower()
    return k in _SECRET_QUERY_KEYS or k.startswith("x-amz-") or k.startswith("x-goog-")


def find_credential(value: str) -> str | None:
    """What credential `value` holds ("a password in the URI", "query key 'sig'", ...), or None."""
    for uri in _URI.findall(value):
        parts = urlsplit(uri)
        if "@" in parts.netloc:
            userinfo = parts.netloc.rsplit("@", 1)[0]
            return "a password in the URI" if ":" in userinfo else "a user/token in the URI"
        for key, _ in parse_qsl(parts.query, keep_blank_values=True):
            if _secret_key(key):
                return f"query key {key!r}"
    match = _CONN.search(value)
    if match:
        return f"{match.group(1)}= in a connection string"
    return None


def _redact_uri(uri: str) -> str:
    scheme, rest = uri.split("://", 1)
    netloc, sep, tail = rest.partition("/")
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0] if ":" in userinfo else ""
        netloc = f"{user}:{MASK}@{host}" if user else f"{MASK}@{host}"
    out = f"{scheme}://{netloc}{sep}{tail}"
    return _QUERY_PAIR.sub(lambda m: f"{m.group(1)}{m.group(2)}={MASK}" if _secret_key(m.group(2)) else m.group(0), out)


def redact(text: Any) -> str:
    """`text` as a string with every credential in it masked: URIs, their query strings, connection strings."""
    s = str(text)
    if "://" in s:
        s = _URI.sub(lambda m: _redact_uri(m.group(0)), s)
    if "=" in s:
        s = _CONN.sub(lambda m: f"{m.group(1)}={MASK}", s)
    return s


def first_line(err: BaseException, limit: int = 300) -> str:
    """The first line of an error's message (its type's name when it has none), credentials masked, at most
    `limit` characters: the cause a one-line error quotes."""
    return redact((str(err).strip().splitlines() or [type(err).__name__])[0])[:limit]


def redact_mapping(values: dict[str, Any]) -> dict[str, str]:
    """Every value of `values` redacted (MLflow params and tags)."""
    return {k: redact(v) for k, v in values.items()}


class RedactingFilter(logging.Filter):
    """A logging filter that masks credentials in a record's message (and its exception text)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record: leave it to the handler's own error path
            return True
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[1] is not None:
            text = logging.Formatter().formatException(record.exc_info)
            if redact(text) != text:
                record.exc_text = redact(text)
                record.exc_info = None  # the redacted text stands in for it
        return True
