"""The object-store servers the tests start (tests/support/store_servers) die with the process that started them,
so a pytest that is killed mid-run leaves no moto server listening."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTER = """
import time
from support.store_servers import S3Service
s3 = S3Service()
s3.start()
print(s3.proc.pid, s3.port, flush=True)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_killed_test_process_takes_its_moto_server_with_it():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "tests"), REPO])}
    starter = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        assert starter.stdout is not None
        line = starter.stdout.readline()
        assert line, f"the starter exited with {starter.wait(timeout=30)} before its server listened"
        pid, port = (int(x) for x in line.split())
        assert not _gone(pid) and any(c.laddr.port == port for c in psutil.Process(pid).net_connections())
        os.kill(starter.pid, signal.SIGKILL)  # no fixture teardown, no atexit: only the kernel's parent-death signal
        starter.wait(timeout=10)
        deadline = time.monotonic() + 15
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(pid), f"moto server {pid} outlived the process that started it"
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
