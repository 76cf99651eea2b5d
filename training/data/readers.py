"""The built-in corpus readers: stdlib, local directory tree or file, object-store prefix, JSON Lines, plug-in;
Parquet and save_to_disk directories are read by training.data.columnar.

Reading is two steps, so that chunks of a corpus can be read in parallel: `list_sources` lists the inputs (files,
objects, and problems found while listing) in one deterministic order, with their sizes; `read_sources` reads any
run of them into Records and Problems. Policies are applied by corpus.checked.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import stat
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from infra import storage
from infra.redact import first_line
from training.data.columnar import list_saved, read_columnar
from training.data.config import DataConfig
from training.data.records import Problem, Record, Source, load_callable, local_source, unsafe_key
from training.data.shardset import DataError

# A JSON-escaped string can be up to 6x its UTF-8 size (\u00XX); longer lines are oversize without parsing.
JSON_ESCAPE_FACTOR = 6
COLUMNAR = ("parquet", "hf_dataset")

__all__ = ["Source", "list_sources", "plugin_records", "read_sources", "records_of"]


def records_of(cfg: DataConfig) -> Iterator[Record | Problem]:
    """Every record of `cfg`'s corpus in one process: data.reader if set, else the listed sources, read in order."""
    if cfg.reader:
        return plugin_records(cfg)
    return read_sources(list_sources(cfg), cfg)


def list_sources(cfg: DataConfig) -> Iterator[Source | Problem]:
    """The inputs of the corpus (not a plug-in's) in a deterministic order; DataError when there are none."""
    if cfg.source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(".py"))
        return iter([_local_source(p, p.name) for p in files])
    if cfg.format == "hf_dataset":
        return list_saved(cfg)
    if storage.is_remote(cfg.source):
        return _list_remote(cfg)
    return _list_local(cfg)


def read_sources(items: Iterable[Source | Problem], cfg: DataConfig) -> Iterator[Record | Problem]:
    """The records of listed inputs, in order (a JSON Lines file gives one per line, a Parquet or Arrow file one per
    row); problems pass through."""
    remote = cfg.source != "stdlib" and storage.is_remote(cfg.source)
    for item in items:
        if isinstance(item, Problem):
            yield item
        elif remote:
            yield from _read_object(item, cfg)
        else:
            yield from _read_local_file(item, cfg)


def _local_source(path: Path, key: str) -> Source:
    st = path.stat()
    return Source(str(path), key, st.st_size, storage.file_stamp(st))


def _include(cfg: DataConfig) -> str:
    if cfg.include == "*" and cfg.format in ("jsonl", "parquet"):
        return f"*.{cfg.format}"
    return cfg.include


# ---------------------------------------------------------------------------------------------- local


def _list_local(cfg: DataConfig) -> Iterator[Source | Problem]:
    root = local_source(cfg.source)
    if not root.exists() and not root.is_symlink():
        raise DataError(f"{cfg.source}: no such file or directory (data.source)")
    if root.is_file():
        yield _local_source(root, root.name)
        return
    if not root.is_dir():
        raise DataError(f"{cfg.source}: not a directory or regular file (data.source)")
    found = [False]
    yield from _walk(root, _include(cfg), found)
    if not found[0]:
        raise DataError(f"{cfg.source}: no files matching {_include(cfg)!r} (empty directory? data.include)")


def _walk(root: Path, pattern: str, found: list[bool]) -> Iterator[Source | Problem]:
    """Every matching file under root, sorted, following directory links once."""
    top = os.stat(root)

    def visit(directory: str, rel: str, ancestors: frozenset[tuple[int, int]]) -> Iterator[Source | Problem]:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as err:
            yield Problem("unreadable", directory, f"cannot list directory: {err.strerror}")
            return
        for entry in entries:
            if entry.name.startswith("."):
                continue
            path, key = entry.path, f"{rel}{entry.name}"
            try:
                st = os.stat(path)  # follows links
            except OSError as err:
                if entry.is_symlink() and err.errno in (errno.ELOOP, errno.ENOENT):
                    what = "symlink loop" if err.errno == errno.ELOOP else "dangling symlink"
                    yield Problem("symlink_loop", path, f"{what} (-> {os.readlink(path)})")
                else:
                    yield Problem("unreadable", path, f"cannot stat: {err.strerror}")
                continue
            if stat.S_ISDIR(st.st_mode):
                ident = (st.st_dev, st.st_ino)
                if ident in ancestors:
                    yield Problem("symlink_loop", path, f"symlink loop (-> {os.readlink(path)} is an ancestor)")
                    continue
                yield from visit(path, f"{key}/", ancestors | {ident})
            elif fnmatch.fnmatch(entry.name, pattern):
                found[0] = True
                yield Source(path, key, st.st_size, storage.file_stamp(st))

    yield from visit(str(root), "", frozenset({(top.st_dev, top.st_ino)}))


def _read_local_file(item: Source, cfg: DataConfig) -> Iterator[Record | Problem]:
    path, key = item.where, item.key
    try:
        st = os.stat(path)
    except OSError as err:
        yield Problem("unreadable", path, f"cannot stat: {err.strerror}")
        return
    if not stat.S_ISREG(st.st_mode):
        kind = "FIFO" if stat.S_ISFIFO(st.st_mode) else "socket" if stat.S_ISSOCK(st.st_mode) else "special file"
        yield Problem("unreadable", path, f"not a regular file ({kind})")
        return
    if cfg.format in COLUMNAR:
        yield from read_columnar(item, cfg, remote=False)
        return
    if cfg.format == "jsonl":
        try:
            with open(path, "rb") as fh:
                yield from _jsonl(fh, path, key, cfg)
        except OSError as err:
            yield Problem("unreadable", path, f"cannot read: {err.strerror or err}")
        return
    if st.st_size > cfg.max_record_bytes:
        yield Problem("oversize", path, f"{st.st_size} bytes > data.max_record_bytes={cfg.max_record_bytes}")
        return
    try:
        # O_NONBLOCK: a file swapped for a FIFO after the stat above must not hang the stage.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(cfg.max_record_bytes + 1)
    except OSError as err:
        yield Problem("unreadable", path, f"cannot read: {err.strerror or err}")
        return
    yield Record(key, data, path)


# ---------------------------------------------------------------------------------------------- remote


def _list_remote(cfg: DataConfig) -> Iterator[Source | Problem]:
    prefix = cfg.source.rstrip("/")
    try:
        entries = storage.list_prefix(prefix, retries=cfg.storage_retries)
        single = None if entries else storage.stat(prefix, retries=cfg.storage_retries)
    except storage.StorageError as err:
        raise DataError(f"{err} (data.source)") from err
    if single is not None:  # one object named by its key: one input, as a local single file is
        yield _single_object(single)
        return
    if not entries:
        raise DataError(f"{cfg.source}: no objects under this prefix, nor an object of that name (data.source)")
    pattern = _include(cfg)
    matched = [e for e in entries if fnmatch.fnmatch(e.uri.rsplit("/", 1)[-1], pattern)]
    if not matched:
        raise DataError(f"{cfg.source}: no objects matching {pattern!r} (data.include)")
    for entry in matched:
        key = entry.uri[len(prefix) + 1 :]
        if unsafe_key(key):
            yield Problem("unsafe_name", entry.uri, f"unsafe object name {key!r} ('..', absolute, or not UTF-8)")
        else:
            yield Source(entry.uri, key, entry.size, entry.stamp)


def _single_object(entry: storage.Entry) -> Source | Problem:
    name = entry.uri.rsplit("/", 1)[-1]
    if unsafe_key(name):
        return Problem("unsafe_name", entry.uri, f"unsafe object name {name!r} ('..', absolute, or not UTF-8)")
    return Source(entry.uri, name, entry.size, entry.stamp)


def _read_object(item: Source, cfg: DataConfig) -> Iterator[Record | Problem]:
    if cfg.format in COLUMNAR:
        yield from read_columnar(item, cfg, remote=True)
        return
    if cfg.format == "jsonl":
        try:
            with storage.open_read(item.where, retries=cfg.storage_retries) as fh:
                yield from _jsonl(fh, item.where, item.key, cfg)
        except storage.StorageError as err:
            yield Problem("unreadable", item.where, f"cannot read: {str(err).split(': ', 1)[-1]}")
        return
    if item.size > cfg.max_record_bytes:
        yield Problem("oversize", item.where, f"{item.size} bytes > data.max_record_bytes={cfg.max_record_bytes}")
        return
    try:
        data = storage.read_bytes(item.where, retries=cfg.storage_retries)
    except storage.StorageError as err:
        yield Problem("unreadable", item.where, f"cannot read: {str(err).split(': ', 1)[-1]}")
        return
    yield Record(item.key, data, item.where)


# ---------------------------------------------------------------------------------------------- JSON Lines


def _jsonl(fh: IO[bytes], origin: str, rel: str, cfg: DataConfig) -> Iterator[Record | Problem]:
    limit = cfg.max_record_bytes * JSON_ESCAPE_FACTOR + 4096
    lineno = 0
    while True:
        line = fh.readline(limit + 1)
        if not line:
            return
        lineno += 1
        where = f"{origin}:{lineno}"
        if len(line) > limit and not line.endswith(b"\n"):
            total = len(line)
            while True:  # drain the rest of the line without holding it
                chunk = fh.readline(1 << 20)
                total += len(chunk)
                if not chunk or chunk.endswith(b"\n"):
                    break
            yield Problem("oversize", where, f"line of {total} bytes > data.max_record_bytes={cfg.max_record_bytes}")
            continue
        if lineno == 1 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]  # a UTF-8 byte order mark (Windows editors write one): not part of the first record
        if not line.strip():
            continue  # blank lines are not records
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            yield Problem("undecodable", where, f"not valid UTF-8 at byte {err.start}")
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as err:
            yield Problem("undecodable", where, f"not valid JSON ({err.msg} at column {err.colno})")
            continue
        except (ValueError, RecursionError) as err:  # JSON the parser refuses: too deeply nested, a 5,000-digit int
            yield Problem(
                "undecodable", where, f"not JSON this reader takes ({type(err).__name__}: {first_line(err, 80)})"
            )
            continue
        if not isinstance(obj, dict):
            yield Problem("undecodable", where, f"not a JSON object but {_json_kind(obj)} (data.format='jsonl')")
            continue
        value = obj.get(cfg.text_field)
        if not isinstance(value, str):
            yield Problem("undecodable", where, _not_a(cfg.text_field, obj, "a string", "data.text_field"))
            continue
        key = f"{rel}:{lineno}"
        if cfg.key_field:
            raw_key = obj.get(cfg.key_field)
            if not isinstance(raw_key, (str, int)) or isinstance(raw_key, bool):
                yield Problem("undecodable", where, _not_a(cfg.key_field, obj, "a string or integer", "data.key_field"))
                continue
            key = str(raw_key)
        try:
            data = value.encode("utf-8")
        except UnicodeEncodeError as err:
            yield Problem("undecodable", where, f"text is not valid Unicode (lone surrogate at char {err.start})")
            continue
        yield Record(key, data, where)


def _json_kind(value: object) -> str:
    """A JSON value's type and a short excerpt of it, for messages: 'a number (12)', 'null'."""
    if value is None:
        return "null"
    kind = {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)
    text = json.dumps(value, ensure_ascii=True)
    return f"{kind} ({text if len(text) <= 40 else text[:37] + '...'})"


def _not_a(field: str, obj: dict, wanted: str, setting: str) -> str:
    if field not in obj:
        return f"no field {field!r} ({setting})"
    return f"field {field!r} is {_json_kind(obj[field])}, not {wanted} ({setting})"


# ---------------------------------------------------------------------------------------------- plug-in


def plugin_records(cfg: DataConfig) -> Iterator[Record | Problem]:
    """The records data.reader yields; a plug-in is one opaque stream, so it is always one chunk."""
    fn = load_callable(cfg.reader, "data.reader")
    try:
        for index, item in enumerate(fn(cfg.source, cfg)):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise DataError(f"data.reader {cfg.reader}: item {index} is not a (key, bytes) pair")
            key, data = item
            origin = f"{cfg.reader}[{key!r}]"
            if isinstance(data, str):
                try:
                    data = data.encode("utf-8")
                except UnicodeEncodeError as err:
                    yield Problem("undecodable", origin, f"text is not valid Unicode (char {err.start})")
                    continue
            if not isinstance(data, (bytes, bytearray)):
                raise DataError(f"data.reader {cfg.reader}: record {key!r} is {type(data).__name__}, not bytes")
            yield Record(key, bytes(data), origin)
    except DataError:
        raise
    except Exception as err:  # the plug-in's own failure, reported in one line with its type
        raise DataError(f"data.reader {cfg.reader}: {type(err).__name__}: {err}") from err
