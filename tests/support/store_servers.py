"""Object-store API servers for tests, on 127.0.0.1 and free ports: moto's S3 server and Azurite.

Plain functions and classes (no pytest) so scripts and fixtures can both use them; the fixtures are in
tests/conftest.py.
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from infra.cluster import free_port  # one free-port helper for code and tests

REPO = Path(__file__).resolve().parents[2]
AZURITE = REPO / "tests" / "services" / "node_modules" / ".bin" / "azurite-blob"
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
BUCKET = "shardline"


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the forked child only calls it
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn: the server gets SIGTERM when the test process that started it dies (Linux prctl
    PR_SET_PDEATHSIG, kept across exec), so a killed or crashed pytest leaves no moto or Azurite behind."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_for_port(port: int, proc: subprocess.Popen | None = None, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


class S3Service:
    """A `python -m moto.server` subprocess on 127.0.0.1 that a test may stop and start again (same port)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        wait_for_port(self.port, self.proc)
        req = urllib.request.Request(f"{self.endpoint}/{BUCKET}", method="PUT")  # a fresh server is empty
        urllib.request.urlopen(req, timeout=10).close()

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


def start_azurite() -> tuple[subprocess.Popen, str]:
    """Start Azurite (blob only, in memory, loose, no telemetry); return the process and its connection string."""
    if not AZURITE.exists():
        if shutil.which("npm") is None:
            raise RuntimeError("Azurite is not installed (npm install --prefix tests/services)")
        subprocess.run(
            ["npm", "install", "--prefix", str(REPO / "tests" / "services"), "--no-audit", "--no-fund"],
            check=True,
            capture_output=True,
        )
    port = free_port()
    proc = subprocess.Popen(
        [
            str(AZURITE),
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--inMemoryPersistence",
            "--skipApiVersionCheck",
            "--loose",
            "--silent",
            "--disableTelemetry",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )
    wait_for_port(port, proc, timeout=60)
    conn = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};"
    )
    from azure.storage.blob import BlobServiceClient

    BlobServiceClient.from_connection_string(conn).create_container(BUCKET)
    return proc, conn


def stop_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
