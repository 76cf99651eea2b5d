"""Redaction of credentials in URI-like values and text, before anything reaches MLflow, Prefect, logs or the CLI.

One function decides what a credential looks like (`find_credential`), one rewrites it (`redact`): the password of
`scheme://user:password@host` (a bare `scheme://token@host` too), query keys that carry signatures or tokens
(`sig`, `X-Amz-*`, `token`, ...), and the secret parts of connection strings (`AccountKey=`,
`SharedAccessSignature=`, `Password=`); in text also environment-style secrets (`AWS_SECRET_ACCESS_KEY=...`),
secret keys in code, JSON, INI, YAML and repr forms (`aws_secret_access_key = ...`, `{"password": "..."}`,
a `password: ...` line, the
lines of a `password: |` block), header lines of
a secret (`x-api-key: ...`), a command line's secret option (`--password x`), signed query strings
printed without their scheme and host (urllib3's "Max retries exceeded with url: /c/b?sv=...&sig=..."), tokens of a
known shape (GitHub, GitLab, Hugging Face, AWS access key ids, JWTs) and `Bearer`/`Basic` tokens.
`find_credential`, which refuses config values, knows URIs, connection strings and tokens of a known shape.
The user part of an Azure `abfs[s]://` or `wasb[s]://` URI is its container, not a credential.
"""

from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import parse_qsl

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
    "sas",
    "api-key",
    "x-api-key",
    "private_token",
    "private-token",  # GitLab's header name, also taken as a query key
    "secret_key",  # MinIO's and boto's spellings; `access_key_id` (an id, not a secret) stays readable
    "access_key",
    "aws_secret_key",
    "passphrase",
}
_CONN_KEYS = ("AccountKey", "SharedAccessSignature", "SharedAccessKey", "Password", "Pwd", "AccessKey", "Secret")
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
# a value in braces may hold ';' (ODBC's `PWD={a;b}`)
_CONN = re.compile(r"(?i)\b(" + "|".join(_CONN_KEYS) + r")=(\{[^}]*\}|[^;\s'\"]+)")
# in text (logs, errors): an environment-style secret (`AWS_SECRET_ACCESS_KEY=...`) and a bearer token
_ENV_SECRET = re.compile(
    r"\b([A-Z][A-Z0-9_]*(?:SECRET|PASSWORD|TOKEN|_KEY|AUTH|_PWD(?![A-Z])|_PASS(?![A-Z]))[A-Z0-9_]*)"
    r"=(['\"]?)[^\s'\"]+\2"
)
# a token: 8 or more token characters with a digit, a mark inside (not a sentence's last full stop) or a case change
_BEARER = re.compile(
    r"\b((?i:bearer)|Basic)\s+"
    r"(?=[A-Za-z]*[0-9]|[A-Za-z]*[._~+/=-][A-Za-z0-9._~+/=-]|[A-Za-z]*[a-z][A-Z])[A-Za-z0-9._~+/=-]{8,}"
)
# `&amp;`: an HTML-escaped one; a value already masked and quoted (`sig=***'`) is left as it is, so text masked twice
# (a message built from a masked value) keeps its closing quote
_QUERY_PAIR = re.compile(r"([?&;](?:amp;)?)([^=&#?;\s]+)=(?!\*\*\*['\"])([^&#\s]*)")
# in text: a secret key as code, JSON or a repr writes it (`client_secret=...`, `"password": "..."`,
# `{'aws_secret_access_key': '...'}`); the `:` form only after a quoted key, so prose ("Password: must be set") stays
_KV_KEY = (
    r"(?<![A-Za-z0-9])((?:[A-Za-z0-9]+[_-]){0,6}(?:password|passwd|secret|secret[_-]access[_-]key|secret[_-]key|"
    r"access[_-]key|api[_-]?key|account[_-]?key|sas[_-]token|session[_-]token|security[_-]token|access[_-]token|"
    r"refresh[_-]token|auth[_-]token|private[_-]token|private[_-]key|passphrase|signature))"
)
# `=` with spaces around it too (`aws_secret_access_key = ...` in ~/.aws/credentials and INI files), not `==`
_KV_SECRET = re.compile(
    r"(?i)" + _KV_KEY + r"""(?:(\s*=(?!=)\s*)("[^"]*"|'[^']*'|[^\s'"&;,})\]]+)|(["']\s*:\s*b?)("[^"]*"|'[^']*'))"""
)
# a YAML line of a secret (`password: hunter2`, `  - 'api_key': "a b"  # c`): one value to the line's end (a comment
# may follow after a space; CRLF lines too), so prose at a line's start ("Password: must be set") stays, and so does
# a value that says none is set (null, ~, "")
_YAML_SECRET = re.compile(
    r"(?im)^([ \t]*(?:-[ \t]+)?['\"]?" + _KV_KEY + r"['\"]?[ \t]*:[ \t]+)"
    r"(?!(?:null|~|\"\"|''|[|>][1-9+-]{0,2})[ \t]*(?:#[^\r\n]*)?\r?$)"
    r"(\"(?:[^\"\\\r\n]|\\.)*\"|'(?:[^'\r\n]|'')*'|[^\s'\"#]\S*)"
    r"(?=(?:[ \t]+#[^\r\n]*)?[ \t]*\r?$)"
)
# names of HTTP headers that carry a secret (a header line of one, or a YAML block under one, is masked)
_SECRET_HEADERS = "x-amz-security-token|x-api-key|api-key|x-goog-api-key|private-token|x-auth-token"
# the head of a YAML block scalar of a secret (`password: |`, `  private_key: >-  # pem`): _yaml_blocks masks the
# lines below it that are indented deeper, the value
_YAML_BLOCK_HEAD = re.compile(
    r"(?im)^([ \t]*)(?:-[ \t]+)?['\"]?(?:" + _KV_KEY + "|" + _SECRET_HEADERS + r")['\"]?[ \t]*:"
    r"[ \t]*(?:[!&][^\s]*[ \t]+){0,2}[|>][1-9+-]{0,2}[ \t]*(?:#[^\r\n]*)?\r?$"  # a tag or an anchor may come first
)
# a command line's secret option (`--password x`, `--api-key=x`); a value starting with '-' is the next option
_OPTION_SECRET = re.compile(
    r"(?i)(?<![\w-])(--(?:[a-z0-9]+-){0,4}(?:password|passwd|secret|token|api-key|secret-key|access-key|passphrase))"
    r"(\s+|=)(?!-)([^\s'\"]+)"
)
# an HTTP header line that carries a secret (a logged request: `x-api-key: ...`); Authorization is _BEARER's
_HEADER_SECRET = re.compile(r"(?im)^(\s*(?:" + _SECRET_HEADERS + r")\s*:\s*)(\S+)")
# tokens of a known shape wherever they stand (length floors keep names like `hf_model` or `ghp_x` as they are)
_TOKEN = re.compile(
    r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_\w{50,}|glpat-[\w-]{20,}|hf_[A-Za-z0-9]{30,}|(?:AKIA|ASIA)[0-9A-Z]{16}"
    r"|eyJ[\w-]{8,}\.eyJ[\w-]{8,}\.[\w-]{8,})\b"
)
_CONTAINER_USER = ("abfs", "abfss", "wasb", "wasbs")  # container@account.dfs.core.windows.net: no credential
# the user of `user:password@`, and the colon after it unless it starts a port (`host:8080/p?mail=a@b` has none)
# (an IPv6 host `[::1]:8080` starts with '[', which no user does)
_USER = re.compile(r"^([^:/?#@\[\]\s]*)(:(?!\d*(?:[/?#]|$)))?")


def _userinfo(rest: str) -> tuple[str, str | None, int] | None:
    """The credential part of a URI's text after `scheme://`: (user, password, where the host starts), the password
    None for a bare `token@host`; None when there is none. A password may hold '/', '?', '#' or '@' (SQLAlchemy and
    libpq read `postgresql://u:pa/ss@db/x` as password `pa/ss`), so it runs to the last '@' before the first '/',
    '?' or '#' after its first '@'."""
    user = _USER.match(rest)
    first = rest.find("@")
    if user is None or first < 0:
        return None

    def authority_end(start: int) -> int:
        ends = [i for i in (rest.find(c, start) for c in "/?#") if i >= 0]
        return min(ends, default=len(rest))

    if user.group(2):  # user:password@
        at = rest.rfind("@", 0, authority_end(first))
        return user.group(1), rest[user.end() : at], at + 1
    end = authority_end(0)
    if first < end:  # token@host
        at = rest.rfind("@", 0, end)
        return rest[:at], None, at + 1
    return None


def _secret_key(key: str) -> bool:
    k = key.lower()
    return k in _SECRET_QUERY_KEYS or k.startswith("x-amz-") or k.startswith("x-goog-")


def find_credential(value: str) -> str | None:
    """What credential `value` holds ("a password in the URI", "query key 'sig'", ...), or None."""
    for uri in _URI.findall(value):
        found = _credential_part(uri)
        if found is not None and found[1] is None and _TOKEN.fullmatch(found[0]):
            return "a token in the URI"  # https://ghp_...@github.com: the user is the token
        if found is not None:
            return "a password in the URI" if found[1] is not None else "a user/token in the URI"
        query = uri.partition("?")[2].partition("#")[0]  # not urlsplit: it raises on a malformed host (`http://[::1`)
        for key, _ in parse_qsl(query, keep_blank_values=True):
            if _secret_key(key):
                return f"query key {key!r}"
    match = _CONN.search(value)
    if match:
        return f"{match.group(1)}= in a connection string"
    if _TOKEN.search(value):
        return "a token"  # ghp_..., hf_..., AKIA..., a JWT: pasted where a name or a location belongs
    return None


def _credential_part(uri: str) -> tuple[str, str | None, int] | None:
    """_userinfo of `uri`, except an Azure container (`abfss://container@account...`)."""
    scheme, rest = uri.split("://", 1)
    found = _userinfo(rest)
    if found is not None and found[1] is None and scheme.lower() in _CONTAINER_USER:
        return None
    return found


def _redact_uri(uri: str) -> str:
    scheme, rest = uri.split("://", 1)
    found = _credential_part(uri)
    if found is not None:
        user, password, host = found
        shown = f"{user}:{MASK}@" if user and password is not None else f"{MASK}@"
        rest = shown + rest[host:]
    return _QUERY_PAIR.sub(_masked_pair, f"{scheme}://{rest}")


def redact(text: Any) -> str:
    """`text` as a string with every credential in it masked: URIs, their query strings, connection strings."""
    s = str(text)
    if "://" in s:
        s = _URI.sub(lambda m: _redact_uri(m.group(0)), s)
    if "=" in s:
        s = _CONN.sub(lambda m: f"{m.group(1)}={MASK}", s)
        s = _ENV_SECRET.sub(lambda m: f"{m.group(1)}={m.group(2)}{MASK}{m.group(2)}", s)
        s = _QUERY_PAIR.sub(_masked_pair, s)  # a signed path printed without scheme and host
    if "=" in s or ":" in s:
        s = _KV_SECRET.sub(_masked_value, s)
    if ":" in s:
        if ("|" in s or ">" in s) and _YAML_BLOCK_HEAD.search(s):  # first: the header rule masks a head's `|`
            s = _yaml_blocks(s)
        s = _HEADER_SECRET.sub(lambda m: f"{m.group(1)}{MASK}", s)
        s = _YAML_SECRET.sub(_masked_yaml, s)
    if "--" in s:
        s = _OPTION_SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", s)
    s = _TOKEN.sub(MASK, s)
    if "earer" in s or "EARER" in s or "Basic" in s:
        s = _BEARER.sub(lambda m: f"{m.group(1)} {MASK}", s)
    return s


def _masked_pair(m: re.Match[str]) -> str:
    return f"{m.group(1)}{m.group(2)}={MASK}" if _secret_key(m.group(2)) else m.group(0)


def _mask_keeping_quotes(value: str) -> str:
    quote = value[0] if value[:1] in ("'", '"') else ""
    return f"{quote}{MASK}{quote}"


def _masked_value(m: re.Match[str]) -> str:
    """A _KV_SECRET match with its value masked, quotes kept."""
    sep, value = (m.group(2), m.group(3)) if m.group(2) else (m.group(4), m.group(5))
    return f"{m.group(1)}{sep}{_mask_keeping_quotes(value)}"


def _masked_yaml(m: re.Match[str]) -> str:
    """A _YAML_SECRET match with its value masked, quotes kept."""
    return f"{m.group(1)}{_mask_keeping_quotes(m.group(3))}"


def _yaml_blocks(text: str) -> str:
    """`text` with the value of every YAML block scalar of a secret masked: each non-blank line below a
    _YAML_BLOCK_HEAD that is indented deeper than the head becomes `***` at its indentation (blank lines inside the
    block stay blank); the block ends at the first line indented no deeper."""
    out: list[str] = []
    head_indent: int | None = None
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        content = body.lstrip(" \t")
        indent = len(body) - len(content)
        if head_indent is not None and (not content or indent > head_indent):
            out.append(body[:indent] + (MASK if content else "") + line[len(body) :])
            continue
        head = _YAML_BLOCK_HEAD.match(body)
        head_indent = len(head.group(1)) if head else None
        out.append(line)
    return "".join(out)


def clip(text: str, limit: int) -> str:
    """`text` shortened to at most `limit` characters, ending "..." when cut: how an error message quotes a long
    value (a request field, a config value, a param path)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
