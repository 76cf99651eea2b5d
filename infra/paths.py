"""The state directory: everything shardline keeps locally lives under $SHARDLINE_HOME."""

from __future__ import annotations

import os
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
