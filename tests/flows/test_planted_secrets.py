"""Credentials planted in every place a user can put them never reach the MLflow database or artifacts, the Prefect
database (parameters, logs, artifacts), the object store's small files, or the CLI's stdout/stderr, over a whole
run to S3 (moto server) tracked by an MLflow server whose URI carries a password. Places the config refuses
(a password in registry.tracking_uri or cluster.address) fail at once with one line that does not repeat it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from infra.cluster import free_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

ENV_KEY_ID, ENV_SECRET = "PLANTEDENVKEYID7A", "PLANTED-env-secret-7c2e"
BLOCK_KEY_ID, BLOCK_SECRET = "PLANTEDBLOCKKEY9B", "PLANTED-block-secret-9d4f"
MLFLOW_PASSWORD = "PLANTED-mlflow-pw-5a1b"
CONFIG_PASSWORDS = {
    "registry.tracking_uri": ("https://ops:{}@mlflow.example.com", "PLANTED-cfg-pw-2c3d"),
    "cluster.address": ("http://ops:{}@head:8265", "PLANTED-ray-pw-3b8e"),
}


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` on 127.0.0.1 (SQLite backend, proxied artifacts); yields (port, db, artifacts)."""
    port, db, artifacts = free_port(), tmp_path / "mlflow-server.db", tmp_path / "mlflow-artifacts"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{db}",
            "--artifacts-destination",
            str(artifacts),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"},
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("mlflow server did not come up")
            time.sleep(0.5)
    yield port, db, artifacts
    proc.terminate()
    proc.wait(timeout=30)


def _files(*roots: Path) -> list[Path]:
    out = []
    for root in roots:
        out += [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    return out


def _ray_session_logs(home: Path) -> list[Path]:
    """Log files of the Ray session of the head this $SHARDLINE_HOME started (found from its recorded PIDs)."""
    import json
    import re

    try:
        pids = json.loads((home / "ray" / "head.json").read_text())["pids"]
    except (OSError, ValueError, KeyError):
        return []
    for pid in pids:
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        match = re.search(r"(/[^\0=]*/session_[0-9_\-]+)", args)
        if match:
            logs = Path(match.group(1)) / "logs"
            return [p for p in logs.rglob("*") if p.is_file() and p.stat().st_size < 20 << 20]
    return []


def _leaks(planted: list[str], texts: dict[str, bytes]) -> list[tuple[str, str]]:
    return [(value, where) for where, data in texts.items() for value in planted if value.encode() in data]


def test_planted_credentials_appear_nowhere(
    prefect_server, s3_service, mlflow_server, tmp_path, unique_prefix, run_home
):
    from prefect.blocks.system import Secret
    from prefect.settings import get_current_settings

    from infra import storage

    port, mlflow_db, mlflow_artifacts = mlflow_server
    Secret(
        value={
            "endpoint_url": s3_service.endpoint,
            "aws_access_key_id": BLOCK_KEY_ID,
            "aws_secret_access_key": BLOCK_SECRET,
            "region_name": "us-east-1",
        }
    ).save("planted-s3", overwrite=True)
    home = run_home
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLFLOW_TRACKING"))},
        "PREFECT_API_URL": prefect_server,
        "SHARDLINE_HOME": str(home),
        "AWS_ENDPOINT_URL": s3_service.endpoint,
        "AWS_ACCESS_KEY_ID": ENV_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": ENV_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "SHARDLINE_S3_SECRET_BLOCK": "planted-s3",
        "MLFLOW_TRACKING_URI": f"http://ops:{MLFLOW_PASSWORD}@127.0.0.1:{port}",
    }
    outputs: dict[str, bytes] = {}

    # places the config refuses: one line, exit 2, the password not repeated
    for field, (template, password) in CONFIG_PASSWORDS.items():
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "flows.cli",
                "run",
                "--config",
                "configs/debug.toml",
                "--set",
                f"{field}={template.format(password)!r}".replace("'", '"'),
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            timeout=300,
        )
        assert proc.returncode == 2 and field.encode() in proc.stderr, proc.stderr[-2000:]
        assert len(proc.stderr.strip().splitlines()) == 1
        outputs[f"{field} stdout"], outputs[f"{field} stderr"] = proc.stdout, proc.stderr

    # a whole run: shards and checkpoints on S3 with the Secret block's keys, MLflow over HTTP with a password
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            "--config",
            "configs/debug.toml",
            "--json",
            "--set",
            f"data.output=s3://shardline/{unique_prefix}/shards",
            "--set",
            f"train.storage_path=s3://shardline/{unique_prefix}/ckpt",
            "--set",
            "canary.enabled=false",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:].decode(errors="replace")
    assert f"s3://shardline/{unique_prefix}/ckpt/".encode() in proc.stdout  # checkpoints went to S3
    outputs["run stdout"], outputs["run stderr"] = proc.stdout, proc.stderr

    url = get_current_settings().server.database.connection_url.get_secret_value()
    prefect_db = Path(url.split(":///", 1)[1]).parent
    planted = [ENV_SECRET, BLOCK_SECRET, MLFLOW_PASSWORD, *(p for _, p in CONFIG_PASSWORDS.values())]
    texts = dict(outputs)
    ray_logs = _ray_session_logs(home)
    assert ray_logs, "the Ray head's session logs were not found"
    private = home / "secrets"  # the credential files replicas and workers read (like ~/.aws/credentials)
    for path in _files(mlflow_db, mlflow_artifacts, prefect_db, home) + ray_logs:
        if private in path.parents:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
            continue
        texts[str(path)] = path.read_bytes()
    os.environ.update(
        {"AWS_ENDPOINT_URL": s3_service.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    )
    for entry in storage.list_prefix(f"s3://shardline/{unique_prefix}"):
        if entry.size < 1 << 20:
            texts[entry.uri] = storage.read_bytes(entry.uri)
    searched = {Path(k).name for k in texts}
    assert {"prefect-test.db", "mlflow-server.db", "manifest.json", "MLmodel"} <= searched, searched  # really searched
    assert _leaks(planted, texts) == []
    # the key ids are not secrets, but they do not belong in logs either
    assert _leaks([ENV_KEY_ID, BLOCK_KEY_ID], {k: v for k, v in texts.items() if "stdout" in k or "stderr" in k}) == []
