"""`shardline cluster`: --dry-run renders and checks; without it, missing cloud credentials stop it in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def _no_cloud_env(home: Path) -> dict[str, str]:
    """This environment without any cloud credential: no AWS/Azure variables, an empty home (no ~/.aws, ~/.azure),
    and no instance-metadata lookup (nothing may contact a cloud)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "AZURE_", "IDENTITY_", "MSI_"))}
    env.update(
        HOME=str(home),
        SHARDLINE_HOME=str(home / "state"),
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=str(home / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(home / "none"),
    )
    return env


def _shardline(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "cluster", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("provider", ["aws", "azure"])
def test_dry_run_prints_the_checked_config(provider, tmp_path):
    proc = _shardline(
        "up",
        "--provider",
        provider,
        "--dry-run",
        "--set",
        "cluster.launcher.cluster_name=team-a",
        env=_no_cloud_env(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert path == tmp_path / "state" / "cluster" / f"{provider}.yaml"
    assert yaml.safe_load(path.read_text())["cluster_name"] == "team-a"


@pytest.mark.parametrize(("provider", "cause"), [("aws", "no AWS credentials"), ("azure", "no Azure credentials")])
def test_missing_credentials_stop_before_ray_up(provider, cause, tmp_path):
    for verb in ("up", "down"):
        proc = _shardline(verb, "--provider", provider, env=_no_cloud_env(tmp_path))
        assert proc.returncode == 1
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"shardline: cluster {verb}: {cause}"), proc.stderr
        assert lines[0].endswith("nothing was started") and "Traceback" not in proc.stderr


def test_bad_launcher_value_is_one_line_exit_2(tmp_path):
    proc = _shardline(
        "render", "--provider", "aws", "--set", "cluster.launcher.aws.gpu_worker.gpus=-1", env=_no_cloud_env(tmp_path)
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "cluster.launcher.aws.gpu_worker.gpus" in proc.stderr


def test_credential_checks_accept_configured_credentials(tmp_path, monkeypatch):
    from infra.launch.cloud_auth import credentials_missing

    for key in [k for k in os.environ if k.startswith(("AWS_", "AZURE_", "IDENTITY_", "MSI_"))]:
        monkeypatch.delenv(key)
    for key, value in _no_cloud_env(tmp_path).items():
        if key.startswith("AWS_") or key == "HOME":
            monkeypatch.setenv(key, value)
    assert credentials_missing("aws").startswith("no AWS credentials")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-real-secret")
    assert credentials_missing("aws") == ""
    assert credentials_missing("azure").startswith("no Azure credentials")
    (tmp_path / ".azure").mkdir()
    (tmp_path / ".azure" / "azureProfile.json").write_text('{"subscriptions": [{"id": "00000000"}]}')
    assert credentials_missing("azure") == ""


def test_kuberay_up_only_renders(tmp_path):
    env = _no_cloud_env(tmp_path)
    proc = _shardline("up", "--provider", "kuberay", env=env)
    assert proc.returncode == 2 and "only renders manifests" in proc.stderr
    proc = _shardline("up", "--provider", "kuberay", "--dry-run", "--out", str(tmp_path / "out"), env=env)
    assert proc.returncode == 0, proc.stderr
    assert [Path(p).name for p in proc.stdout.split()] == ["raycluster.yaml", "rayjob.yaml", "rayservice.yaml"]
