"""infra.storage without a server: URI parsing, local files, and which errors are retried."""

from __future__ import annotations

import os
import shutil
import stat as stat_module
from pathlib import Path

import pytest
from azure.core.exceptions import HttpResponseError, ResourceNotFoundError, ServiceRequestError
from botocore.exceptions import ClientError, EndpointConnectionError

from infra import storage, storage_retry


def _client_error(status: int, code: str) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "x"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
    )


def test_parse_and_join():
    assert storage.parse("s3://b/p/q") == storage.Location("s3", "b", "p/q")
    assert storage.parse("az://c") == storage.Location("az", "c", "")
    assert storage.parse("/tmp/x") == storage.Location("file", "", "/tmp/x")
    assert storage.join("s3://b/p/", "/x/", "y") == "s3://b/p/x/y"
    assert storage.join("rel", "a") == "rel/a"
    with pytest.raises(storage.StorageError, match="unsupported scheme 'gs'"):
        storage.parse("gs://b/x")


def test_stat_finds_one_object_by_its_name_not_what_lies_under_it(tmp_path):
    storage.write_bytes(str(tmp_path / "d" / "one.jsonl"), b"abcd")
    entry = storage.stat(str(tmp_path / "d" / "one.jsonl"))
    assert entry is not None and entry.size == 4 and entry.stamp
    assert storage.stat(str(tmp_path / "d")) is None and storage.stat(str(tmp_path / "nope")) is None
    assert storage.stat("s3://bucket") is None  # a bucket is never an object (no request made)


def test_credentials_in_uri_are_refused_without_echoing_them():
    with pytest.raises(storage.StorageError) as err:
        storage.parse("s3://AKIAXX:hunter2@bucket/key")
    assert "hunter2" not in str(err.value) and "credentials" in str(err.value)


def test_local_operations(tmp_path):
    base = str(tmp_path / "store")
    storage.write_bytes(storage.join(base, "a/b.bin"), b"abc")
    storage.copy(storage.join(base, "a/b.bin"), storage.join(base, "c.bin"))
    assert [(e.uri[len(base) :], e.size) for e in storage.list_prefix(base)] == [("/a/b.bin", 3), ("/c.bin", 3)]
    with storage.open_read(storage.join(base, "c.bin")) as fh:
        assert fh.read() == b"abc"
    assert storage.delete_prefix(storage.join(base, "a")) == 1 and not storage.exists(storage.join(base, "a/b.bin"))
    with pytest.raises(storage.StorageError, match="missing.bin: No such file"):
        storage.read_bytes(storage.join(base, "missing.bin"))


@pytest.mark.parametrize(
    "err",
    [
        _client_error(503, "SlowDown"),
        _client_error(500, "InternalError"),
        EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
        ServiceRequestError("connection refused"),
        HttpResponseError(message="busy", response=None),
        ConnectionResetError(),
        TimeoutError(),
    ],
)
def test_transient_errors_are_retried_with_backoff(err, monkeypatch):
    if isinstance(err, HttpResponseError):
        err.status_code = 503
    sleeps: list[float] = []
    monkeypatch.setattr(storage_retry.time, "sleep", sleeps.append)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise err
        return "ok"

    assert storage_retry.with_retries(flaky, "s3://b/k", retries=5) == "ok"
    assert len(calls) == 3 and len(sleeps) == 2 and sleeps[1] > sleeps[0]


@pytest.mark.parametrize(
    "err",
    [
        _client_error(404, "NoSuchKey"),
        _client_error(403, "AccessDenied"),
        ResourceNotFoundError("gone"),
        PermissionError(13, "denied"),
    ],
)
def test_final_errors_are_not_retried(err, monkeypatch):
    monkeypatch.setattr(storage_retry.time, "sleep", lambda s: pytest.fail("slept on a final error"))
    calls = []

    def broken():
        calls.append(1)
        raise err

    with pytest.raises(storage.StorageError, match=r"^s3://b/k: ") as caught:
        storage_retry.with_retries(broken, "s3://b/k", retries=5)
    assert len(calls) == 1 and "\n" not in str(caught.value)


def test_gives_up_after_the_configured_retries(monkeypatch):
    monkeypatch.setattr(storage_retry.time, "sleep", lambda s: None)
    calls = []

    def down():
        calls.append(1)
        raise ConnectionRefusedError(111, "Connection refused")

    with pytest.raises(storage.StorageError, match="after 4 attempts"):
        storage_retry.with_retries(down, "az://c/k", retries=3)
    assert len(calls) == 4


def test_local_writes_of_one_path_do_not_share_a_temp_file(tmp_path, monkeypatch):
    """Another writer of the same path (another thread) renames its file in between this one's write and rename:
    with one temp name per process it took this writer's half-written file and this rename failed."""
    target = str(tmp_path / "index.json")
    real_replace = os.replace
    calls = []

    def replace_after_another_writer(src, dst):
        if not calls:
            calls.append(src)
            storage.write_bytes(target, b"B" * 1000)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_after_another_writer)
    storage.write_bytes(target, b"A" * 1000)
    assert storage.read_bytes(target) == b"A" * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json"]


def test_a_failed_local_write_leaves_no_temp_file_and_keeps_the_old_object(tmp_path, monkeypatch):
    target = tmp_path / "d" / "shard-0.tar"
    storage.write_bytes(str(target), b"old")
    assert stat_module.S_IMODE(target.stat().st_mode) == 0o666 & ~_current_umask()  # not mkstemp's 0600
    real_write = Path.write_bytes

    def disk_full_write(self, data):
        real_write(self, data[:3])
        raise OSError(28, "No space left on device")

    def disk_full_copy(src, dst):
        Path(dst).write_bytes(b"hal")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", disk_full_write)
    with pytest.raises(OSError, match="No space"):
        storage.write_bytes(str(target), b"new content")
    monkeypatch.setattr(Path, "write_bytes", real_write)
    source = tmp_path / "src.bin"
    source.write_bytes(b"new content")
    monkeypatch.setattr(shutil, "copyfile", disk_full_copy)
    with pytest.raises(OSError, match="No space"):
        storage.upload_file(source, str(target))
    assert target.read_bytes() == b"old"
    assert [e.uri for e in storage.list_prefix(str(tmp_path / "d"))] == [str(target)]


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.mark.parametrize(
    ("uri", "says"),
    [
        ("https://AKIAEXAMPLE:hunter2@minio.local/bucket/key", "unsupported scheme 'https'"),
        ("gs://user:hunter2@bucket/corpus", "unsupported scheme 'gs'"),
        ("S3://hunter2@bucket/key", "unsupported scheme 'S3'"),
        ("s3:///key?X-Amz-Signature=hunter2", "missing bucket/container name"),
        ("az:///k?sv=2022&sig=hunter2", "missing bucket/container name"),
        ("user:hunter2@host://x", "not a URI scheme"),
    ],
)
def test_refused_uris_are_quoted_without_their_credentials(uri, says):
    """parse()'s errors reach logs and the CLI (`data.source: ...`): the URI they quote is masked."""
    with pytest.raises(storage.StorageError) as err:
        storage.parse(uri)
    assert says in str(err.value) and "hunter2" not in str(err.value) and "\n" not in str(err.value)


def test_local_listing_names_entries_as_join_does(tmp_path, monkeypatch):
    """Entries are `join(uri, name)`: `join(base, name) in listing` holds for file:// and ./relative bases too."""
    monkeypatch.chdir(tmp_path)
    for base in (f"file://{tmp_path}/store", "./rel", "rel/"):
        storage.write_bytes(storage.join(base, "d/x.bin"), b"abc")
        assert [e.uri for e in storage.list_prefix(base)] == [storage.join(base, "d/x.bin")]
        one = storage.join(base, "d/x.bin")
        assert [e.uri for e in storage.list_prefix(one)] == [one] and storage.stat(one).uri == one
