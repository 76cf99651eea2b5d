"""Tests that need a program `make test` installs (Azurite, PostgreSQL, Prometheus, Chromium): where it is
missing, a developer's run skips them and says how to install it; under CI (`CI` set, and not 0/false/no) the
same test fails, because `make test` installed it there and a quiet skip would drop coverage."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(why: str) -> NoReturn:
    """Skip (a developer's machine) or fail (CI) the calling test or fixture, naming what is missing and why."""
    if under_ci():
        pytest.fail(f"{why} (CI: `make test` installs it, so this is a failure, not a skip)")
    pytest.skip(why)
