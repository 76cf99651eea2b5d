"""The state directory: everything shardline keeps locally lives under $SHARDLINE_HOME."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def shardline_home() -> Path:
    """Return `$SHARDLINE_HOME` (default `./.shardline`), absolute, created if missing.

    Raises:
        NotADirectoryError: it, or a folder above it, is a file (one line naming SHARDLINE_HOME).
    """
    home = Path(os.environ.get("SHARDLINE_HOME", ".shardline")).expanduser().resolve()
    try:
        home.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise NotADirectoryError(f"SHARDLINE_HOME={home}: a file is in the way of this state directory") from None
    return home


def quiet_telemetry() -> None:
    """Turn off the usage reporting of every service shardline starts; there may be no network."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (/proc), so no other thread's file is ever
    created under a momentarily cleared umask."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def replace_file(path: Path, fill: Callable[[str], object]) -> None:
    """Have `fill` write a temp file of this call's own next to `path`, then rename it into place.

    A name of its own (mkstemp), not one per process: two threads writing one path renamed each other's
    half-written file and a reader saw a torn object. A failed write removes its temp file, which otherwise stayed
    under the prefix for good. The file gets the mode a plain open() would give it (mkstemp makes it 0600), so
    other users of shared storage can still read it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, 0o666 & ~_umask())
        finally:
            os.close(fd)
        fill(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
