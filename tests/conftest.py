"""Shared pytest fixtures. Each part keeps its fixtures in its own clearly marked block."""

from __future__ import annotations

# ================================================================================================================
# data part: real object-store API servers on 127.0.0.1 (moto's S3 server, Azurite), started once per session.
#   s3_server -> endpoint URL; sets AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID/SECRET=testing, AWS_DEFAULT_REGION.
#   azurite   -> connection string; sets AZURE_STORAGE_CONNECTION_STRING.
# Both create a bucket / container named "shardline"; tests that need isolation use a fresh prefix.
# ================================================================================================================
import os
import shutil  # noqa: F401  (used by the deployments block below)
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.requires import missing
from support.store_servers import S3Service, start_azurite, stop_process

TIERS = ("unit", "processes", "integration", "flows", "stack")


def pytest_configure(config):
    # a scenario module's selected tests run with the tests before them (tests/support/scenarios.py)
    config.pluginmanager.import_plugin("support.scenarios")


def pytest_collection_modifyitems(config, items):
    """Every test is marked with its tier, the folder it is in (pyproject.toml says what each may start), and the
    tiers run in TIERS order: the unit tier first, in a process that nothing has connected to Ray yet, and a
    failure of pure logic shows in seconds, not after the end-to-end tiers."""
    here = Path(__file__).resolve().parent
    rank = {}
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(here).parts
        tier = parts[0] if parts and parts[0] in TIERS else ""
        if tier:
            item.add_marker(getattr(pytest.mark, tier))
        rank[item.nodeid] = TIERS.index(tier) if tier else len(TIERS)
    items.sort(key=lambda item: rank[item.nodeid])  # stable: a module's tests stay together, in file order


@pytest.fixture(scope="session")
def s3_service() -> Iterator[S3Service]:
    service = S3Service()
    service.start()
    yield service
    service.stop()


@pytest.fixture
def s3_server(s3_service: S3Service, monkeypatch: pytest.MonkeyPatch) -> str:
    """The moto S3 endpoint URL, with the AWS variables pointing at it for this test (bucket 'shardline')."""
    for key, value in s3_service.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3_service.endpoint


@pytest.fixture(scope="session")
def azurite_service() -> Iterator[str]:
    try:
        proc, conn = start_azurite()
    except RuntimeError as err:
        missing(f"AZURE BLOB TESTS NOT RUN: Azurite did not start ({err}); `make test` installs it")
    yield conn
    stop_process(proc)


@pytest.fixture
def azurite(azurite_service: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The Azurite connection string, set as AZURE_STORAGE_CONNECTION_STRING for this test (container 'shardline')."""
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_service)
    return azurite_service


@pytest.fixture
def unique_prefix() -> str:
    """A fresh key prefix, so tests sharing the session's bucket do not see each other's objects."""
    return f"t-{uuid.uuid4().hex[:10]}"


os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Ray Train's controller polls its workers every 2 s (Ray's default): a short test fit then waits up to two polls
# after its last report before it ends. Polling every 0.25 s saves about 3 s a fit (A/B on test_train_stage.py), and
# every fit of the suite (in-process, CLI and stack runs: the controller takes it from the driver's environment)
# gains it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
# ============================================ end of data part ==================================================


# ================================================================================================================
# deployments part: a real MLflow SQLite store per test, copied from one migrated template (migrations take ~1 s).
#   mlflow_store -> (tracking URI, experiment id); sets SHARDLINE_HOME to a tmp dir and the global tracking URI.
# ================================================================================================================
@pytest.fixture(scope="session")
def _mlflow_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from infra.tracking import setup_tracking

    root = tmp_path_factory.mktemp("mlflow-template")
    old_home = os.environ.get("SHARDLINE_HOME")
    os.environ["SHARDLINE_HOME"] = str(root / "home")
    try:
        setup_tracking(f"sqlite:///{root / 'mlflow.db'}", "shardline-test")
    finally:
        if old_home is None:
            os.environ.pop("SHARDLINE_HOME", None)
        else:
            os.environ["SHARDLINE_HOME"] = old_home
    return root / "mlflow.db"


@pytest.fixture
def mlflow_store(_mlflow_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    from infra.tracking import setup_tracking

    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shutil.copy(_mlflow_template, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return uri, setup_tracking(uri, "shardline-test")


# ========================================= end of deployments part ==============================================


# ================================================================================================================
# shared: the MLflow run tree of one (pretend) flow run, as every stage task receives it.
# ================================================================================================================
def flow_run_lineage(tracking_uri: str, flow_run_id: str):
    """A parent run for `flow_run_id` in the test experiment, wrapped as the Lineage a task receives."""
    from infra.tracking import Lineage, open_parent_run

    parent = open_parent_run(tracking_uri, "shardline-test", flow_run_id, f"name-of-{flow_run_id}")
    return Lineage(
        tracking_uri=tracking_uri, experiment="shardline-test", parent_run_id=parent, flow_run_id=flow_run_id
    )


@pytest.fixture
def lineage_for(mlflow_store):
    """Makes the Lineage of a named flow run over one fresh MLflow SQLite store ($SHARDLINE_HOME is a tmp dir)."""
    return lambda flow_run_id: flow_run_lineage(mlflow_store[0], flow_run_id)


@pytest.fixture
def lineage(lineage_for):
    """Lineage of flow run 'flow-run-1'."""
    return lineage_for("flow-run-1")
