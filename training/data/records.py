"""What a corpus listing and reader yield (Source, Record, Problem), the record checks, the bad-input policy fields."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra import storage
from training.data.config import DataConfig
from training.data.shardset import DataError

POLICY_FIELD = {
    "empty": "on_empty_record",
    "oversize": "on_oversize",
    "binary": "on_binary",
    "undecodable": "on_undecodable",
    "unreadable": "on_unreadable",
    "symlink_loop": "on_symlink_loop",
    "unsafe_name": "on_unsafe_name",
}


def local_source(source: str) -> Path:
    """A local data.source as a path: a bare path, or a file:// URI read through storage.parse as data.output is
    (taken as a relative path, 'file:///data' was a directory named 'file:' that never exists)."""
    return Path(storage.parse(source).key).expanduser()


@dataclass(frozen=True)
class Record:
    key: str  # unique name of the record in the corpus (relative path, file:line, or the key field)
    data: bytes
    origin: str  # the file / object / line it came from, for messages


@dataclass(frozen=True)
class Source:
    """One listed input: a local file or an object in S3/Azure, keyed relative to data.source."""

    where: str  # local path or object URI
    key: str
    size: int  # as listed (stat / object size): what chunks are planned by
    stamp: str = ""  # as listed: ETag or file times (training.data.listing_index)


@dataclass(frozen=True)
class Problem:
    kind: str  # one of POLICY_FIELD
    origin: str
    cause: str


@dataclass
class Tally:
    """What the policies skipped: counts per cause and the first few one-line causes."""

    skipped: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    EXAMPLES = 20

    def count(self, kind: str, example: str) -> None:
        self.skipped[kind] += 1
        if len(self.examples) < self.EXAMPLES:
            self.examples.append(example)

    def merge(self, skipped: dict[str, int], examples: list[str]) -> None:
        """Add a later chunk's counts and examples (examples stay the first ones in corpus order)."""
        self.skipped.update(skipped)
        self.examples += examples[: self.EXAMPLES - len(self.examples)]


def describe(problem: Problem) -> str:
    """The problem in one line of text: a file name that is not UTF-8 shows its bytes escaped (caf\\udce9.txt), so
    printing it, logging it or writing it into an MLflow tag cannot fail."""
    return f"{problem.origin}: {problem.cause}".encode("utf-8", "backslashreplace").decode("utf-8")


def unsafe_key(key: str) -> bool:
    """A key that could escape a directory when used as a path: '..' segments, absolute, drive letter, NUL; or one
    that is not text (a file name in another encoding, a lone surrogate in a JSON key field): the split, the tar
    member name and the manifest all take its UTF-8 bytes."""
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return True
    k = key.replace("\\", "/")
    return (
        not k
        or "\x00" in k
        or k.startswith("/")
        or re.match(r"^[A-Za-z]:", k) is not None
        or any(part == ".." for part in k.split("/"))
    )


def check_record(rec: Record, cfg: DataConfig) -> Problem | None:
    """The first problem of a record read in full, or None when it is a good record."""
    if unsafe_key(rec.key):
        return Problem("unsafe_name", rec.origin, f"unsafe record key {rec.key!r} ('..', absolute, or not UTF-8)")
    n = len(rec.data)
    if n > cfg.max_record_bytes:
        return Problem("oversize", rec.origin, f"{n} bytes > data.max_record_bytes={cfg.max_record_bytes}")
    if n < cfg.min_record_bytes:
        return Problem("empty", rec.origin, f"empty record ({n} bytes < data.min_record_bytes={cfg.min_record_bytes})")
    nul = rec.data.find(b"\x00")
    if nul >= 0:
        return Problem("binary", rec.origin, f"binary content (NUL byte at offset {nul})")
    try:
        rec.data.isascii() or rec.data.decode("utf-8")
    except UnicodeDecodeError as err:
        return Problem("undecodable", rec.origin, f"not valid UTF-8 at byte {err.start}")
    return None


def load_callable(path: str, what: str) -> Callable[..., Any]:
    """Import 'module:function'; DataError naming the field when it is not there."""
    from training.config import load_object

    try:
        return load_object(path, what)
    except ValueError as err:
        raise DataError(str(err)) from None
