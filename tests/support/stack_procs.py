"""Helpers of the stack's process tests: a free loopback port, an HTTP server's argv, waiting for a process to go."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

from flows.stack.procs import Proc, is_ours


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_server(port: int, directory: Path) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(directory)]


def gone(proc: Proc, within_s: float = 3.0) -> bool:
    """True once `proc` no longer runs, waiting up to `within_s`."""
    deadline = time.monotonic() + within_s
    while is_ours(proc) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not is_ours(proc)
