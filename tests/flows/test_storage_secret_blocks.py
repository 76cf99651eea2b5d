"""Storage credentials from Prefect Secret blocks named by environment variables (real Prefect server)."""

from __future__ import annotations

import pytest

from infra import credentials, storage


@pytest.fixture
def no_store_env(monkeypatch):
    for key in (
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AZURE_STORAGE_CONNECTION_STRING",
    ):
        monkeypatch.delenv(key, raising=False)
    credentials._s3_client_for.cache_clear()
    credentials._azure_service_for.cache_clear()


def test_s3_endpoint_and_keys_from_a_secret_block(prefect_server, s3_service, no_store_env, monkeypatch, unique_prefix):
    from prefect.blocks.system import Secret

    Secret(
        value={
            "endpoint_url": s3_service.endpoint,
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
            "region_name": "us-east-1",
        }
    ).save("shardline-s3", overwrite=True)
    monkeypatch.setenv("SHARDLINE_S3_SECRET_BLOCK", "shardline-s3")
    uri = f"s3://shardline/{unique_prefix}/x.bin"
    storage.write_bytes(uri, b"via block")  # without the block's endpoint this would go to AWS (no network here)
    assert storage.read_bytes(uri) == b"via block"


def test_azure_connection_string_from_a_secret_block(
    prefect_server, azurite_service, no_store_env, monkeypatch, unique_prefix
):
    from prefect.blocks.system import Secret

    Secret(value=azurite_service).save("shardline-azure", overwrite=True)
    monkeypatch.setenv("SHARDLINE_AZURE_SECRET_BLOCK", "shardline-azure")
    uri = f"az://shardline/{unique_prefix}/x.bin"
    storage.write_bytes(uri, b"via block")
    assert storage.read_bytes(uri) == b"via block"
