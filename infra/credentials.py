"""Where object-store endpoints and credentials come from, and the cached clients built from them.

S3: the standard AWS variables (AWS_ENDPOINT_URL[_S3], AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
AWS_DEFAULT_REGION, AWS_PROFILE) or a Prefect Secret block named by $SHARDLINE_S3_SECRET_BLOCK holding a JSON object
with aws_access_key_id, aws_secret_access_key and optionally aws_session_token, endpoint_url, region_name.
Azure Blob: AZURE_STORAGE_CONNECTION_STRING, or a Prefect Secret block named by $SHARDLINE_AZURE_SECRET_BLOCK
holding the connection string. Never from config files; nothing here is logged.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any


class CredentialsError(OSError):
    """No way to reach the store was configured."""


def _secret_block(env_name: str) -> Any:
    """The value of the Prefect Secret block named by $env_name, or None when the variable is unset."""
    name = os.environ.get(env_name, "")
    if not name:
        return None
    from prefect.blocks.system import Secret

    return Secret.load(name).get()


def _s3_settings() -> tuple[tuple[str, str], ...]:
    keys = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_PROFILE", "SHARDLINE_S3_SECRET_BLOCK")
    # The pid is part of the key: a forked DataLoader worker must not share the parent's connection pool.
    return (("pid", str(os.getpid())),) + tuple((k, os.environ.get(k, "")) for k in keys)


@functools.lru_cache(maxsize=8)
def _s3_client_for(settings: tuple[tuple[str, str], ...]) -> Any:
    import boto3
    from botocore.config import Config

    env = dict(settings)
    kwargs: dict[str, Any] = {}
    secret = _secret_block("SHARDLINE_S3_SECRET_BLOCK")
    if secret:
        values = json.loads(secret) if isinstance(secret, str) else dict(secret)
        for name in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token", "endpoint_url", "region_name"):
            if values.get(name):
                kwargs[name] = values[name]
    endpoint = env["AWS_ENDPOINT_URL_S3"] or env["AWS_ENDPOINT_URL"]
    if endpoint and "endpoint_url" not in kwargs:
        kwargs["endpoint_url"] = endpoint
    kwargs.setdefault("region_name", env["AWS_DEFAULT_REGION"] or "us-east-1")
    # Our own backoff is the one retry loop; botocore's is kept short so an outage fails fast into it.
    config = Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 2, "mode": "standard"})
    return boto3.session.Session().client("s3", config=config, **kwargs)


def s3_client() -> Any:
    """A boto3 S3 client for the current environment (cached per settings and process)."""
    return _s3_client_for(_s3_settings())


@functools.lru_cache(maxsize=8)
def _azure_service_for(conn_env: str, block_env: str, pid: int) -> Any:
    from azure.storage.blob import BlobServiceClient

    conn = _secret_block("SHARDLINE_AZURE_SECRET_BLOCK") or conn_env
    if not conn:
        raise CredentialsError(
            "az://: no credentials: set AZURE_STORAGE_CONNECTION_STRING or SHARDLINE_AZURE_SECRET_BLOCK"
        )
    return BlobServiceClient.from_connection_string(
        conn, retry_total=0, connection_timeout=5, read_timeout=60
    )


def azure_service() -> Any:
    """An azure-storage-blob BlobServiceClient for the current environment (cached per settings and process)."""
    return _azure_service_for(
        os.environ.get("AZURE_STORAGE_CONNECTION_STRING", ""), os.environ.get("SHARDLINE_AZURE_SECRET_BLOCK", ""),
        os.getpid(),
    )
