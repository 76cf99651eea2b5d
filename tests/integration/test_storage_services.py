"""infra.storage against real S3 (moto server) and Azure Blob (Azurite) APIs on 127.0.0.1."""

from __future__ import annotations

import pytest

from infra import storage, storage_retry


@pytest.fixture(params=["s3", "az"])
def base(request, unique_prefix):
    if request.param == "s3":
        request.getfixturevalue("s3_server")
    else:
        request.getfixturevalue("azurite")
    return f"{request.param}://shardline/{unique_prefix}"


def test_round_trip_list_copy_delete(base, tmp_path):
    storage.write_bytes(storage.join(base, "a/one.bin"), b"1" * 10)
    local = tmp_path / "two.bin"
    local.write_bytes(b"2" * 70000)
    storage.upload_file(local, storage.join(base, "b/two.bin"))
    storage.copy(storage.join(base, "b/two.bin"), storage.join(base, "c/three.bin"))
    entries = storage.list_prefix(base)
    assert [(e.uri.removeprefix(base), e.size) for e in entries] == [
        ("/a/one.bin", 10),
        ("/b/two.bin", 70000),
        ("/c/three.bin", 70000),
    ]
    assert storage.read_bytes(storage.join(base, "c/three.bin")) == b"2" * 70000
    with storage.open_read(storage.join(base, "b/two.bin")) as fh:
        assert fh.read(5) == b"22222" and len(fh.read()) == 69995
    assert storage.exists(storage.join(base, "a/one.bin")) and not storage.exists(storage.join(base, "a/none"))
    assert storage.delete_prefix(storage.join(base, "b")) == 1
    assert [e.uri.removeprefix(base) for e in storage.list_prefix(base)] == ["/a/one.bin", "/c/three.bin"]
    assert storage.list_prefix(storage.join(base, "nothing-here")) == []


def test_missing_object_is_a_final_error_naming_the_uri(base):
    uri = storage.join(base, "missing.txt")
    with pytest.raises(storage.StorageError, match=f"^{uri}: "):
        storage.read_bytes(uri, retries=3)


def test_webdataset_streams_remote_tar(base, tmp_path):
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for key in ("x", "y"):
            info = tarfile.TarInfo(f"{key}.txt")
            info.size = 3
            tar.addfile(info, io.BytesIO(key.encode() * 3))
    storage.write_bytes(storage.join(base, "s.tar"), buf.getvalue())
    from training.data.loader import iter_texts

    assert list(iter_texts([storage.join(base, "s.tar")])) == [("x", b"xxx"), ("y", b"yyy")]


def test_unreachable_endpoint_is_retried_then_fails(monkeypatch):
    import time

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: connection refused
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setattr(storage_retry, "BACKOFF_BASE_S", 0.05)
    start = time.monotonic()
    with pytest.raises(storage.StorageError, match="after 3 attempts"):
        storage.read_bytes("s3://shardline/x", retries=2)
    assert time.monotonic() - start >= 0.1  # two backoff sleeps happened


class _CuttingProxy:
    """A TCP proxy to a local server that drops its first connection after `cut` bytes of the response: a
    connection lost in the middle of a download, on the real network path (the server is not touched)."""

    def __init__(self, upstream_port: int, cut: int) -> None:
        import socket
        import threading

        self.upstream, self.cut, self.connections = upstream_port, cut, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._pipe, args=(client, self.connections == 1), daemon=True).start()

    def _pipe(self, client, cut_this: bool) -> None:
        import socket
        import threading

        upstream = socket.create_connection(("127.0.0.1", self.upstream))

        def forward_requests() -> None:
            try:
                while data := client.recv(1 << 16):
                    upstream.sendall(data)
            except OSError:
                pass

        threading.Thread(target=forward_requests, daemon=True).start()
        sent = 0
        try:
            while data := upstream.recv(1 << 16):
                if cut_this and sent + len(data) > self.cut:
                    client.sendall(data[: self.cut - sent])
                    break
                client.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (client, upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("scheme", ["s3", "az"])
def test_connection_lost_mid_download_is_resumed(scheme, request, unique_prefix, monkeypatch):
    import os
    import re

    payload = os.urandom(3 << 20)
    uri = f"{scheme}://shardline/{unique_prefix}/big.bin"
    if scheme == "s3":
        endpoint = request.getfixturevalue("s3_server")
        storage.write_bytes(uri, payload)
        proxy = _CuttingProxy(int(endpoint.rsplit(":", 1)[1]), cut=1 << 20)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    else:
        conn = request.getfixturevalue("azurite")
        storage.write_bytes(uri, payload)
        port = int(re.search(r"127\.0\.0\.1:(\d+)", conn).group(1))
        proxy = _CuttingProxy(port, cut=1 << 20)
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", conn.replace(f":{port}/", f":{proxy.port}/"))
    monkeypatch.setattr(storage_retry, "BACKOFF_BASE_S", 0.05)
    try:
        if scheme == "s3":  # without retries the cut surfaces as a one-line StorageError naming the byte
            with pytest.raises(storage.StorageError, match=rf"{uri}: .* at byte \d+"):
                with storage.open_read(uri, retries=0) as fh:
                    fh.read()
            proxy.connections = 0
        with storage.open_read(uri) as fh:
            assert fh.read() == payload
        assert proxy.connections >= 2  # the first connection was cut, the read went on over a new one
    finally:
        proxy.close()
