"""One small API over local paths, s3://bucket/prefix (boto3) and az://container/prefix (Azure Blob), with retries.

Endpoints and credentials come only from the environment or Prefect Secret blocks (see infra/credentials.py).
URIs never carry credentials; a URI with a user-info part is rejected. Every remote call is retried with
exponential backoff on transient errors (endpoint down, timeouts, throttling, 5xx); other errors are final.
"""

from __future__ import annotations

import functools
import http.client
import io
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

from infra.credentials import CredentialsError, azure_service, s3_client

T = TypeVar("T")

DEFAULT_RETRIES = 5
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 8.0
SCHEMES = ("s3", "az")


class StorageError(OSError):
    """A storage call failed for good (not found, denied, or still failing after all retries)."""


@dataclass(frozen=True)
class Location:
    scheme: str  # "file", "s3" or "az"
    bucket: str  # bucket or container; "" for local paths
    key: str  # object key / blob name (no leading '/'); the path for local files


@dataclass(frozen=True)
class Entry:
    uri: str
    size: int
    stamp: str = ""  # changes whenever the content may have: ETag of an object, mtime/ctime of a file


def parse(uri: str) -> Location:
    """Split a URI into scheme, bucket/container and key; a bare path (or file://) is local."""
    if "://" not in uri:
        return Location("file", "", uri)
    scheme, rest = uri.split("://", 1)
    if scheme == "file":
        return Location("file", "", rest)
    if scheme not in SCHEMES:
        raise StorageError(f"{uri}: unsupported scheme {scheme!r} (use a local path, s3:// or az://)")
    bucket, _, key = rest.partition("/")
    if "@" in bucket or ":" in bucket:
        raise StorageError(
            f"{scheme}://<redacted>: credentials or endpoints do not belong in URIs; use the environment"
        )
    if not bucket:
        raise StorageError(f"{uri}: missing bucket/container name")
    return Location(scheme, bucket, key)


def is_remote(uri: str) -> bool:
    return parse(uri).scheme in SCHEMES


def join(base: str, *parts: str) -> str:
    """Join path segments onto a URI or local path with '/'."""
    out = base.rstrip("/") if base not in ("", "/") else base
    for part in parts:
        part = part.strip("/")
        if part:
            out = f"{out}/{part}" if out else part
    return out


# ---------------------------------------------------------------------------------------------- retries


def is_transient(err: BaseException) -> bool:
    """Endpoint down, timeouts, throttling and 5xx are worth retrying; not-found and denied are not."""
    try:
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            IncompleteReadError,
            ReadTimeoutError,
            ResponseStreamingError,
        )
        from botocore.exceptions import ConnectionError as BotoConnectionError

        if isinstance(err, (BotoConnectionError, ReadTimeoutError)):
            return True
        if isinstance(err, ClientError):
            meta = err.response.get("ResponseMetadata", {})
            code = err.response.get("Error", {}).get("Code", "")
            return int(meta.get("HTTPStatusCode") or 0) >= 500 or code in (
                "SlowDown",
                "RequestTimeout",
                "Throttling",
                "InternalError",
                "ServiceUnavailable",
            )
        if isinstance(err, (ResponseStreamingError, IncompleteReadError)):  # connection lost mid-body
            return True
        if isinstance(err, BotoCoreError) and "Connect" in type(err).__name__:
            return True
    except ImportError:  # boto3 not installed: no S3 errors to classify
        pass
    try:
        from azure.core.exceptions import HttpResponseError, ServiceRequestError, ServiceResponseError
        from azure.core.exceptions import IncompleteReadError as AzureIncompleteRead

        if isinstance(err, (ServiceRequestError, ServiceResponseError, AzureIncompleteRead)):
            return True
        if isinstance(err, HttpResponseError):
            return int(err.status_code or 0) >= 500 or err.status_code in (408, 429)
    except ImportError:
        pass
    try:
        from urllib3.exceptions import ProtocolError
        from urllib3.exceptions import ReadTimeoutError as Urllib3ReadTimeout

        if isinstance(err, (ProtocolError, Urllib3ReadTimeout)):
            return True
    except ImportError:
        pass
    return isinstance(err, (ConnectionError, TimeoutError, http.client.IncompleteRead))


def with_retries(fn: Callable[[], T], what: str, retries: int | None = None) -> T:
    """Call fn(), retrying transient errors with exponential backoff and jitter; StorageError when it gives up."""
    retries = DEFAULT_RETRIES if retries is None else retries
    for attempt in range(retries + 1):
        try:
            return fn()
        except (StorageError, CredentialsError):
            raise
        except Exception as err:  # classified below; anything not transient is final
            if not is_transient(err) or attempt == retries:
                reason = _one_line(err)
                tail = f" after {attempt + 1} attempts" if attempt else ""
                raise StorageError(f"{what}: {reason}{tail}") from err
            delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**attempt) * (0.8 + 0.4 * random.random())
            time.sleep(delay)
    raise AssertionError("unreachable")


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".strip().rstrip(":")


def _blob(loc: Location) -> Any:
    return azure_service().get_blob_client(loc.bucket, loc.key)


def _readable_url(source: Any, minutes: int = 60) -> str:
    """The source blob's URL with a short-lived read-only SAS: Copy Blob From URL reads the source anonymously,
    which real Azure refuses for a private container. With an account key the SAS is signed here; with a SAS
    connection string the client's URL already carries it. The URL is never logged.
    """
    import datetime as dt

    from azure.storage.blob import BlobSasPermissions, generate_blob_sas

    credential = getattr(source, "credential", None)
    key = getattr(credential, "account_key", None)
    if not key or "?" in source.url:
        return source.url
    sas = generate_blob_sas(
        account_name=source.account_name,
        container_name=source.container_name,
        blob_name=source.blob_name,
        account_key=key,
        permission=BlobSasPermissions(read=True),
        expiry=dt.datetime.now(dt.UTC) + dt.timedelta(minutes=minutes),
    )
    return f"{source.url}?{sas}"


def _not_found(err: BaseException) -> bool:
    code = ""
    if hasattr(err, "response"):
        code = str(getattr(err, "response", {}).get("Error", {}).get("Code", ""))
    status = getattr(err, "status_code", None)
    return code in ("NoSuchKey", "404", "NoSuchBucket") or status == 404 or isinstance(err, FileNotFoundError)


# ---------------------------------------------------------------------------------------------- operations


def read_bytes(uri: str, retries: int | None = None) -> bytes:
    """The whole object; StorageError naming the URI when it is missing or unreadable."""
    loc = parse(uri)
    if loc.scheme == "file":
        try:
            return Path(loc.key).read_bytes()
        except OSError as err:
            raise StorageError(f"{uri}: {err.strerror or err}") from err
    if loc.scheme == "s3":
        return with_retries(lambda: s3_client().get_object(Bucket=loc.bucket, Key=loc.key)["Body"].read(), uri, retries)
    return with_retries(lambda: _blob(loc).download_blob().readall(), uri, retries)


def open_read(uri: str, retries: int | None = None) -> IO[bytes]:
    """A streaming binary reader. Opening is retried; so is a connection lost mid-stream: the reader reopens the
    object at the byte it had reached (S3 Range / Azure offset) and carries on."""
    loc = parse(uri)
    if loc.scheme == "file":
        try:
            return open(loc.key, "rb")
        except OSError as err:
            raise StorageError(f"{uri}: {err.strerror or err}") from err

    def open_at(pos: int) -> tuple[Callable[[int], bytes], Callable[[], None]]:
        if loc.scheme == "s3":
            ranged = {"Range": f"bytes={pos}-"} if pos else {}
            body = s3_client().get_object(Bucket=loc.bucket, Key=loc.key, **ranged)["Body"]
            return body.read, body.close
        downloader = _blob(loc).download_blob(offset=pos or None, max_concurrency=1)
        return downloader.read, lambda: None

    return io.BufferedReader(_ResumableReader(uri, open_at, retries), buffer_size=1 << 16)


class _ResumableReader(io.RawIOBase):
    """A read(n) stream over an object that reopens at the current offset after a transient error."""

    def __init__(
        self, uri: str, open_at: Callable[[int], tuple[Callable[[int], bytes], Callable[[], None]]], retries: int | None
    ) -> None:
        self.uri, self._open_at = uri, open_at
        self._retries = DEFAULT_RETRIES if retries is None else retries
        self._read, self._close = with_retries(lambda: open_at(0), uri, retries)
        self._received, self._pending = 0, b""

    def readable(self) -> bool:
        return True

    def _fetch(self, n: int) -> bytes:
        for attempt in range(self._retries + 1):
            try:
                data = self._read(n)
                self._received += len(data)
                return data
            except Exception as err:
                if not is_transient(err) or attempt == self._retries:
                    raise StorageError(f"{self.uri}: {_one_line(err)} at byte {self._received}") from err
                time.sleep(min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**attempt))
                try:
                    self._close()
                except Exception:  # the broken connection may not close cleanly; it is dropped either way
                    pass
                self._read, self._close = with_retries(
                    functools.partial(self._open_at, self._received), self.uri, self._retries
                )
        raise AssertionError("unreachable")

    def readinto(self, buf: Any) -> int:
        if not self._pending:
            self._pending = self._fetch(max(len(buf), 1 << 16))
        n = min(len(buf), len(self._pending))
        buf[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            try:
                self._close()
            finally:
                super().close()


def write_bytes(uri: str, data: bytes, retries: int | None = None) -> None:
    """Write (replace) an object; a local file is written to a temp name and renamed into place."""
    loc = parse(uri)
    if loc.scheme == "file":
        path = Path(loc.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    elif loc.scheme == "s3":
        with_retries(lambda: s3_client().put_object(Bucket=loc.bucket, Key=loc.key, Body=data), uri, retries)
    else:
        with_retries(lambda: _blob(loc).upload_blob(data, overwrite=True), uri, retries)


def upload_file(path: str | Path, uri: str, retries: int | None = None) -> None:
    """Copy a local file to `uri` (single request per attempt; shards are bounded by max_shard_bytes)."""
    loc = parse(uri)
    if loc.scheme == "file":
        Path(loc.key).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, loc.key)
        return
    data = Path(path).read_bytes()
    write_bytes(uri, data, retries)


def exists(uri: str, retries: int | None = None) -> bool:
    loc = parse(uri)
    if loc.scheme == "file":
        return Path(loc.key).exists()

    def probe() -> bool:
        try:
            if loc.scheme == "s3":
                s3_client().head_object(Bucket=loc.bucket, Key=loc.key)
                return True
            return bool(_blob(loc).exists())
        except Exception as err:
            if _not_found(err):
                return False
            raise

    return with_retries(probe, uri, retries)


def file_stamp(st: os.stat_result) -> str:
    """A local file's change stamp: modification and inode-change times (the latter cannot be set back)."""
    return f"{st.st_mtime_ns}-{st.st_ctime_ns}"


def _file_entry(path: Path) -> Entry:
    st = path.stat()
    return Entry(str(path), st.st_size, file_stamp(st))


def list_prefix(uri: str, retries: int | None = None) -> list[Entry]:
    """Every object under `uri` (recursively, sorted by URI); [] when there are none."""
    loc = parse(uri)
    if loc.scheme == "file":
        root = Path(loc.key)
        if root.is_file():
            return [_file_entry(root)]
        if not root.is_dir():
            return []
        found = [_file_entry(p) for p in root.rglob("*") if p.is_file()]
        return sorted(found, key=lambda e: e.uri)
    prefix = loc.key.rstrip("/") + "/" if loc.key else ""
    base = f"{loc.scheme}://{loc.bucket}/"
    if loc.scheme == "s3":

        def s3_list() -> list[Entry]:
            out = []
            for page in s3_client().get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=prefix):
                out += [Entry(base + o["Key"], int(o["Size"]), o.get("ETag", "")) for o in page.get("Contents", [])]
            return out

        return sorted(with_retries(s3_list, uri, retries), key=lambda e: e.uri)

    def az_list() -> list[Entry]:
        container = azure_service().get_container_client(loc.bucket)
        return [
            Entry(base + b.name, int(b.size), str(b.etag or "")) for b in container.list_blobs(name_starts_with=prefix)
        ]

    try:
        return sorted(with_retries(az_list, uri, retries), key=lambda e: e.uri)
    except StorageError as err:
        if err.__cause__ is not None and _not_found(err.__cause__):  # no such container
            return []
        raise


def delete(uri: str, retries: int | None = None) -> None:
    loc = parse(uri)
    if loc.scheme == "file":
        Path(loc.key).unlink(missing_ok=True)
    elif loc.scheme == "s3":
        with_retries(lambda: s3_client().delete_object(Bucket=loc.bucket, Key=loc.key), uri, retries)
    else:

        def az_delete() -> None:
            try:
                _blob(loc).delete_blob()
            except Exception as err:
                if not _not_found(err):
                    raise

        with_retries(az_delete, uri, retries)


def delete_prefix(uri: str, retries: int | None = None) -> int:
    """Delete everything under `uri`; return how many objects (files) went."""
    loc = parse(uri)
    if loc.scheme == "file":
        root = Path(loc.key)
        if not root.exists():
            return 0
        count = sum(1 for p in root.rglob("*") if p.is_file()) if root.is_dir() else 1
        shutil.rmtree(root) if root.is_dir() else root.unlink()
        return count
    entries = list_prefix(uri, retries)
    for entry in entries:
        delete(entry.uri, retries)
    return len(entries)


def copy(src: str, dst: str, retries: int | None = None) -> None:
    """Server-side copy within one store (S3 CopyObject, Azure Copy Blob); local files are copied."""
    s, d = parse(src), parse(dst)
    if s.scheme != d.scheme:
        raise StorageError(f"{src} -> {dst}: copy across stores is not supported")
    if s.scheme == "file":
        upload_file(s.key, dst)
    elif s.scheme == "s3":
        with_retries(
            lambda: s3_client().copy_object(Bucket=d.bucket, Key=d.key, CopySource={"Bucket": s.bucket, "Key": s.key}),
            dst,
            retries,
        )
    else:

        def az_copy() -> None:
            target = _blob(d)
            props = target.start_copy_from_url(_readable_url(_blob(s)), requires_sync=True)
            if props.get("copy_status") not in (None, "success"):
                raise StorageError(f"{dst}: copy from {src} ended {props.get('copy_status')}")

        with_retries(az_copy, dst, retries)


# ---------------------------------------------------------------------------------------------- webdataset


def register_gopen() -> None:
    """Let webdataset (gopen) stream s3:// and az:// shards through this module."""
    import importlib

    # `webdataset.gopen` the attribute is the function; the dispatch table lives in the module of that name.
    schemes = importlib.import_module("webdataset.gopen").gopen_schemes

    def handler(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> IO[bytes]:
        if mode != "rb":
            raise StorageError(f"{url}: webdataset may only read from object storage here")
        return open_read(url)

    for scheme in SCHEMES:
        schemes[scheme] = handler
