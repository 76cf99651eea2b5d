"""Remote clusters: storage their nodes cannot reach is a one-line config error; Ray Client is refused; the training
job's runtime env carries the code (packaged by Ray's own zipper) and no credential."""

from __future__ import annotations

import json
import zipfile

import pytest

from flows.config import ConfigError, load_config

JOB_SERVER = ["cluster.mode=remote", "cluster.address=http://head:8265", "canary.enabled=false"]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path / "home"


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        load_config("configs/debug.toml", overrides)
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    return message


def test_driver_local_default_checkpoints_are_refused_naming_field_and_path(home):
    message = _error(JOB_SERVER)
    assert "train.storage_path=''" in message and str(home / "checkpoints") in message
    assert "cluster.shared_paths" in message and "configs/debug.toml" in message


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("data.output=/srv/local-shards", "data.output"),
        ("registry.tracking_uri=sqlite:////srv/local/mlflow.db", "registry.tracking_uri"),
    ],
)
def test_each_unshared_location_is_named(override, field):
    shared = [
        "train.storage_path=s3://bucket/ckpt",
        "data.output=s3://bucket/shards",
        "registry.tracking_uri=http://mlflow:5000",
    ]
    message = _error([*JOB_SERVER, *[s for s in shared if not s.startswith(field)], override])
    assert f"{field}=" in message and "/srv/local" in message


def test_object_storage_and_a_tracking_server_pass():
    cfg = load_config(
        "configs/debug.toml",
        [
            *JOB_SERVER,
            "train.storage_path=s3://bucket/ckpt",
            "data.output=az://container/shards",
            "registry.tracking_uri=https://mlflow.example.com",
        ],
    )
    assert cfg.cluster.job_server


@pytest.mark.parametrize("tracking", ["databricks", "databricks-uc", "databricks://prof", "databricks-uc://prof"])
def test_databricks_tracking_uris_are_servers_not_local_paths(tracking):
    """MLflow's bare `databricks` and `databricks-uc` name the workspace of the default profile, not a folder."""
    cfg = load_config(
        "configs/debug.toml",
        [
            *JOB_SERVER,
            "train.storage_path=s3://bucket/ckpt",
            "data.output=az://container/shards",
            f"registry.tracking_uri={tracking}",
        ],
    )
    assert cfg.registry.tracking_uri == tracking
    # elsewhere the same word is a relative folder on the driver
    assert "data.output='databricks'" in _error([*JOB_SERVER, "train.storage_path=s3://b/c", "data.output=databricks"])


def test_paths_under_a_declared_shared_mount_pass(home):
    cfg = load_config("configs/debug.toml", [*JOB_SERVER, f'cluster.shared_paths=["{home.parent}"]'])
    assert cfg.cluster.shared_paths == [str(home.parent)]
    assert "not an absolute path" in _error([*JOB_SERVER, 'cluster.shared_paths=["relative/dir"]'])


def test_a_local_cluster_keeps_its_local_defaults():
    assert load_config("configs/debug.toml", []).cluster.mode == "local"
    gcs = load_config(
        "configs/debug.toml",
        [
            "cluster.mode=remote",
            "cluster.address=head:6379",
            "train.storage_path=s3://b/c",
            "data.output=s3://b/s",
            "registry.tracking_uri=http://m:5000",
        ],
    )
    assert not gcs.cluster.job_server  # a GCS address keeps this process a driver on the cluster


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("data.engine=ray", "data.engine='ray'"),
        ("canary.enabled=true", "canary.enabled=false"),
    ],
)
def test_stages_that_need_a_driver_are_refused_with_a_job_server(home, override, words):
    message = _error([*JOB_SERVER, f'cluster.shared_paths=["{home.parent}"]', override])
    assert words in message


def test_ray_client_is_refused_pointing_to_the_job_server():
    message = _error(["cluster.mode=remote", "cluster.address=ray://head:10001"])
    assert "cluster.address" in message and "http://head:8265" in message


def test_what_git_ignores_on_this_machine_only_is_not_uploaded(tmp_path):
    from infra.jobs import local_excludes

    assert local_excludes(tmp_path) == []  # not a checkout
    (tmp_path / ".git" / "info").mkdir(parents=True)
    (tmp_path / ".git" / "info" / "exclude").write_text("# git's comment\n\n/.gpu/\n*.bin\n!keep.bin\n")
    assert local_excludes(tmp_path) == ["/.gpu/", "*.bin"]


def test_job_runtime_env_carries_code_and_plain_settings_but_no_secret(monkeypatch, tmp_path):
    from infra.config import ClusterConfig
    from infra.credentials import WORKER_SECRETS_ENV
    from infra.jobs import ROOT, job_runtime_env

    planted = "planted-secret-41d7"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", planted)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", planted)
    monkeypatch.setenv("MLFLOW_CRYPTO_KEK_PASSPHRASE", planted)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"AccountName=a;AccountKey={planted}")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    env = job_runtime_env(ClusterConfig(mode="remote", address="http://h:8265"))
    assert planted not in json.dumps(env)
    assert env["env_vars"]["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    assert env["env_vars"][WORKER_SECRETS_ENV] == "-" and "SHARDLINE_HOME" not in env["env_vars"]
    assert env["working_dir"] == str(ROOT) and "pip" not in env
    with_file = job_runtime_env(
        ClusterConfig(
            mode="remote",
            address="http://h:8265",
            job_pip=["webdataset==1.0.2"],
            job_secrets_file="/etc/shardline/secrets.json",
        )
    )
    assert with_file["pip"] == ["webdataset==1.0.2"]
    assert with_file["env_vars"][WORKER_SECRETS_ENV] == "/etc/shardline/secrets.json"

    # what Ray uploads, zipped by Ray's own packaging code with these excludes
    from ray._private.runtime_env.packaging import create_package

    package = tmp_path / "working_dir.zip"
    create_package(env["working_dir"], package, include_gitignore=True, excludes=env["excludes"])
    names = zipfile.ZipFile(package).namelist()
    assert "training/job_entry.py" in names and "training/loop.py" in names and "infra/jobs.py" in names
    assert not [
        n
        for n in names
        if n.startswith((".venv/", "tests/", ".shardline/", ".git/")) or "node_modules/" in n or n.endswith(".pyc")
    ]
    assert package.stat().st_size < 5 * 1024 * 1024


def test_a_database_tracking_uri_from_the_environment_passes_with_its_driver_and_is_never_echoed(monkeypatch):
    """$MLFLOW_TRACKING_URI may carry its password (the README allows it there); SQLAlchemy's `+driver` is the
    same server."""
    stored = ["train.storage_path=s3://bucket/ckpt", "data.output=s3://bucket/shards"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql+psycopg2://u:hunter2@db/mlflow")
    assert load_config("configs/debug.toml", [*JOB_SERVER, *stored]).cluster.job_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "mysqlx://u:hunter2@db/mlflow")  # not a server MLflow speaks
    message = _error([*JOB_SERVER, *stored])
    assert "registry.tracking_uri='mysqlx://u:***@db/mlflow'" in message and "hunter2" not in message


class _RecordingJobClient:
    def __init__(self):
        self.submitted = []

    def submit_job(self, **kw):
        self.submitted.append(kw)


@pytest.mark.parametrize(
    ("inputs", "field"),
    [
        ({"tracking_uri": "postgresql://mlflow:hunter2@db:5432/mlflow", "train_run_id": "r1"}, "tracking_uri"),
        ({"tracking_uri": "http://m:5000", "worker_env": {"HF_ENDPOINT": "https://x/?token=hunter2"}}, "worker_env."),
        ({"shards": {"train_shards": ["s3://b/s-0.tar?X-Amz-Signature=hunter2"]}}, "shards.train_shards[0]"),
    ],
)
def test_a_job_input_holding_a_credential_is_refused_and_never_written(tmp_path, inputs, field):
    """inputs.json lies in clear on shared storage: a password from $MLFLOW_TRACKING_URI must not be put there."""
    from flows.log_hygiene import is_expected
    from infra.config import ClusterConfig
    from infra.jobs import job_folder, submit
    from infra.remote import RemoteConfigError

    client = _RecordingJobClient()
    cluster = ClusterConfig(mode="remote", address="http://head:8265")
    with pytest.raises(RemoteConfigError) as err:
        submit(client, cluster, "job1", inputs, str(tmp_path), {})
    message = str(err.value)
    assert f"job input {field}" in message and "cluster.job_secrets_file" in message
    assert "hunter2" not in message and len(message.splitlines()) == 1
    assert not (tmp_path / "shardline-jobs").exists() and not client.submitted
    assert is_expected(err.value) and isinstance(err.value, ValueError)  # one line in the logs, not retried
    # without the credential the same inputs are written and the job submitted
    submit(client, cluster, "job2", {"tracking_uri": "postgresql://db/mlflow"}, str(tmp_path), {})
    written = json.loads((tmp_path / "shardline-jobs" / "job2" / "inputs.json").read_text())
    assert written == {"tracking_uri": "postgresql://db/mlflow"} and len(client.submitted) == 1
    assert job_folder(str(tmp_path), "job2").endswith("job2")
