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


# ---------------------------------------------------------------------------------- issue 9: crash/rerun tests
def _stop_head_of(home):
    """Stop the long-lived Ray head that runs under `home` started (by its recorded PIDs), if any."""
    from infra.head import stop_head

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDLINE_HOME", str(home))
        stop_head()


@pytest.fixture
def run_home(tmp_path):
    """A fresh $SHARDLINE_HOME for CLI runs in subprocesses; the long-lived Ray head they start is stopped after."""
    home = tmp_path / "home"
    yield home
    _stop_head_of(home)


@pytest.fixture(scope="module")
def module_home(tmp_path_factory):
    """One $SHARDLINE_HOME for a module's CLI runs that do not read what another left: they share the Ray head the
    first run starts (~20 s to start on 2 cores), stopped after the module."""
    home = tmp_path_factory.mktemp("home")
    yield home
    _stop_head_of(home)


@pytest.fixture()
def ray_cluster():
    """A local Ray cluster of 4 CPUs for this test, with the test package on the workers' path."""
    import ray
    from support.train_support import ray_runtime_env

    from infra.cluster import ClusterInfo
    from infra.network import network_env

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env=ray_runtime_env())
    yield ClusterInfo(
        address=ray.get_runtime_context().gcs_address,
        mode="local",
        resources={},
        nodes=1,
        started_here=True,
        network="tcp",
        network_env=network_env("tcp"),
    )
    ray.shutdown()
