"""A throwaway PostgreSQL server on 127.0.0.1 for the tests: the system's initdb/pg_ctl, run as `postgres` when
the tests run as root (initdb refuses root), trust authentication, data in a temporary directory."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from infra.cluster import free_port


def pg_bin() -> Path | None:
    """The newest installed PostgreSQL's bin directory (Debian layout), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


class PostgresServer:
    """start() -> URL `postgresql://shardline@127.0.0.1:PORT/shardline`; stop() removes everything."""

    user = "shardline"

    def __init__(self) -> None:
        bin_dir = pg_bin()
        if bin_dir is None:
            raise RuntimeError("no PostgreSQL server binaries (make test installs the 'postgresql' package)")
        self.bin = bin_dir
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="shardline-pg-"))
        self.data = self.dir / "data"

    def _run(self, *argv: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        proc = subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{Path(argv[0]).name} failed: {proc.stderr.strip()[-500:]}")

    def start(self) -> str:
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", self.user, "-A", "trust", "--no-sync")
        # fsync off: a test database that is thrown away; socket in the data dir, TCP on loopback only
        opts = f"-h 127.0.0.1 -p {self.port} -k {self.data} -F -c max_connections=200"
        self._run(
            str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", opts, "-l", str(self.dir / "log"), "-w", "start"
        )
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/shardline"

    def stop(self) -> None:
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
