"""Credentials reach a run's workers on the long-lived head through a 0600 file, never through Ray's runtime env
(Ray logs runtime envs in clear)."""

from __future__ import annotations

import json
import os
import stat

from infra.credentials import WORKER_SECRETS_ENV, adopt_worker_secrets, split_secrets, write_worker_secrets


def test_secrets_are_split_from_plain_settings_by_name_and_by_value():
    plain, secret = split_secrets(
        {
            "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
            "AWS_ACCESS_KEY_ID": "AKIA1",
            "AWS_SECRET_ACCESS_KEY": "s",
            "AZURE_STORAGE_CONNECTION_STRING": "AccountName=a;AccountKey=k",
            "MLFLOW_TRACKING_USERNAME": "me",
            "MLFLOW_TRACKING_PASSWORD": "pw",
            "MLFLOW_TRACKING_URI": "https://me:pw@mlflow.example/",
            "SHARDLINE_S3_SECRET_BLOCK": "store-creds",
            "PREFECT_API_URL": "https://api.prefect.cloud/api/accounts/a/workspaces/w",
            "PREFECT_API_KEY": "pnu_abc",
            "PREFECT_API_AUTH_STRING": "admin:pass",
            "AZURE_STORAGE_KEY": "k==",
            "AZURE_AUTHORITY_HOST": "https://login.microsoftonline.com",  # plain: a remote job needs these
            "MLFLOW_TRACKING_AUTH": "my_auth_plugin",
        }
    )
    assert sorted(plain) == [
        "AWS_ENDPOINT_URL",
        "AZURE_AUTHORITY_HOST",
        "MLFLOW_TRACKING_AUTH",
        "MLFLOW_TRACKING_USERNAME",
        "PREFECT_API_URL",
    ]
    assert sorted(secret) == [
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_STORAGE_KEY",
        "MLFLOW_TRACKING_PASSWORD",
        "MLFLOW_TRACKING_URI",
        "PREFECT_API_AUTH_STRING",
        "PREFECT_API_KEY",
        "SHARDLINE_S3_SECRET_BLOCK",
    ]


def test_a_worker_adopts_the_drivers_secrets_from_a_private_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path))
    path = write_worker_secrets({"AWS_SECRET_ACCESS_KEY": "s3cr3t"})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads(open(path).read()) == {"AWS_SECRET_ACCESS_KEY": "s3cr3t"}
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.setenv(WORKER_SECRETS_ENV, path)
    adopt_worker_secrets()
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == "s3cr3t"


def test_files_of_drivers_that_died_are_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path))
    dead = tmp_path / "secrets" / "999999999-abc.json"
    dead.parent.mkdir(mode=0o700)
    dead.write_text("{}")
    write_worker_secrets({"K": "v"})
    assert not dead.exists()


def test_a_passphrase_or_private_key_is_a_secret_though_not_named_password():
    plain, secret = split_secrets(
        {
            "MLFLOW_CRYPTO_KEK_PASSPHRASE": "correct horse battery staple 42",
            "SNOWFLAKE_PRIVATE_KEY": "-----BEGIN PRIVATE KEY-----",
            "MLFLOW_TRACKING_INSECURE_TLS": "false",
        }
    )
    assert sorted(secret) == ["MLFLOW_CRYPTO_KEK_PASSPHRASE", "SNOWFLAKE_PRIVATE_KEY"]
    assert plain == {"MLFLOW_TRACKING_INSECURE_TLS": "false"}
