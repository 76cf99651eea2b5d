"""One small API over local paths, s3://bucket/prefix (boto3) and az://container/prefix (Azure Blob), with retries.

Endpoints and credentials come only from the environment or Prefect Secret blocks (see infra/credentials.py).
URIs never carry credentials; a URI with a user-info part is rejected. Every remote call is retried with
exponential backoff on transient errors (endpoint down, timeouts, throttling, 5xx); other errors are final
(infra/storage_retry.py).
"""

from __future__ import annotations

import io
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from infra.credentials import azure_service, s3_client
from infra.paths import replace_file
from infra.redact import redact
from infra.storage_retry import ResumableReader, StorageError, with_retries

SCHEMES = ("s3", "az")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")  # RFC 3986


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
    """Split a URI into scheme, bucket/container and key; a bare path (or file://) is local.

    Errors quote the URI only through redact(): a refused URI is often a presigned or user:password@ one pasted
    from elsewhere (https://key:secret@minio/..., ?X-Amz-Signature=...), and these errors reach logs and the CLI.
    """
    if "://" not in uri:
        return Location("file", "", uri)
    scheme, rest = uri.split("://", 1)
    if scheme == "file":
        return Location("file", "", rest)
    if scheme not in SCHEMES:
        if not _SCHEME.fullmatch(scheme):  # `user:secret@host://...`: not a URI redact() knows, so not quoted
            raise StorageError("<redacted>: what precedes '://' is not a URI scheme (use a local path, s3:// or az://)")
        raise StorageError(f"{redact(uri)}: unsupported scheme {scheme!r} (use a local path, s3:// or az://)")
    bucket, _, key = rest.partition("/")
    if "@" in bucket or ":" in bucket:
        raise StorageError(
            f"{scheme}://<redacted>: credentials or endpoints do not belong in URIs; use the environment"
        )
    if not bucket:
        raise StorageError(f"{redact(uri)}: missing bucket/container name")
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
    response = getattr(err, "response", None)
    if isinstance(response, dict):  # botocore's; an Azure error's `response` is its HTTP response (status_code below)
        code = str(response.get("Error", {}).get("Code", ""))
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

    return io.BufferedReader(ResumableReader(uri, open_at, retries), buffer_size=1 << 16)


def write_bytes(uri: str, data: bytes, retries: int | None = None) -> None:
    """Write (replace) an object; a local file is written to a temp name and renamed into place."""
    loc = parse(uri)
    if loc.scheme == "file":
        replace_file(Path(loc.key), lambda tmp: Path(tmp).write_bytes(data))
    elif loc.scheme == "s3":
        with_retries(lambda: s3_client().put_object(Bucket=loc.bucket, Key=loc.key, Body=data), uri, retries)
    else:
        with_retries(lambda: _blob(loc).upload_blob(data, overwrite=True), uri, retries)


def upload_file(path: str | Path, uri: str, retries: int | None = None) -> None:
    """Copy a local file to `uri` (single request per attempt; shards are bounded by max_shard_bytes). A local
    target is filled under a temp name and renamed, like write_bytes: a reader never sees half a copy."""
    loc = parse(uri)
    if loc.scheme == "file":
        replace_file(Path(loc.key), lambda tmp: shutil.copyfile(path, tmp))
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


def stat(uri: str, retries: int | None = None) -> Entry | None:
    """The object (or regular file) at `uri` itself, with its size and change stamp; None when there is none. Unlike
    list_prefix, which lists what lies under `uri/`, this finds a single object named by its full key."""
    loc = parse(uri)
    if loc.scheme == "file":
        path = Path(loc.key)
        return _file_entry(path, join(uri)) if path.is_file() else None
    if not loc.key:
        return None  # a bucket or container is never an object

    def probe() -> Entry | None:
        try:
            if loc.scheme == "s3":
                head = s3_client().head_object(Bucket=loc.bucket, Key=loc.key)
                return Entry(uri, int(head["ContentLength"]), head.get("ETag", ""))
            props = _blob(loc).get_blob_properties()
            return Entry(uri, int(props.size), str(props.etag or ""))
        except Exception as err:
            if _not_found(err):
                return None
            raise

    return with_retries(probe, uri, retries)


def file_stamp(st: os.stat_result) -> str:
    """A local file's change stamp: modification and inode-change times (the latter cannot be set back)."""
    return f"{st.st_mtime_ns}-{st.st_ctime_ns}"


def _file_entry(path: Path, uri: str) -> Entry:
    st = path.stat()
    return Entry(uri, st.st_size, file_stamp(st))


def list_prefix(uri: str, retries: int | None = None) -> list[Entry]:
    """Every object under `uri` (recursively, sorted by URI); [] when there are none.

    Each entry is named `join(uri, name under it)`, for local files too: str(Path) dropped file:// and a leading
    ./, so `join(base, name) in listing` failed and a shard set could not be opened by its file:// URI.
    """
    loc = parse(uri)
    if loc.scheme == "file":
        root = Path(loc.key)
        if root.is_file():
            return [_file_entry(root, join(uri))]
        if not root.is_dir():
            return []
        found = [_file_entry(p, join(uri, p.relative_to(root).as_posix())) for p in root.rglob("*") if p.is_file()]
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
        raise StorageError(f"{redact(src)} -> {redact(dst)}: copy across stores is not supported")
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
