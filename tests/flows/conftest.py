"""A real local Prefect server for the whole session (prefect_test_harness), shared by every flow test."""
from __future__ import annotations

import pytest

# Telemetry is switched off for every test by tests/conftest.py.


@pytest.fixture(scope="session")
def prefect_server():
    """Yields the API URL of a temporary Prefect server backed by a throwaway SQLite database."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()
