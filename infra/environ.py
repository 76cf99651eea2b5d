"""One environment variable set for the length of a block, then restored (removed if it was unset)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def overridden(name: str, value: str) -> Iterator[None]:
    """os.environ[name] = value inside the block; the earlier value (or its absence) after it. Process-wide: a
    caller whose threads may overlap holds its own lock around it."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
