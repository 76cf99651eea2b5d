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

    return Secret.load(name).get()  # type: ignore[union-attr]  # sync context: a Secret, not a coroutine


def _s3_settings() -> tuple[tuple[str, str], ...]:
    keys = (
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_DEFAULT_REGION",
        "AWS_PROFILE",
        "SHARDLINE_S3_SECRET_BLOCK",
    )
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
    return BlobServiceClient.from_connection_string(conn, retry_total=0, connection_timeout=5, read_timeout=60)


def azure_service() -> Any:
    """An azure-storage-blob BlobServiceClient for the current environment (cached per settings and process)."""
    return _azure_service_for(
        os.environ.get("AZURE_STORAGE_CONNECTION_STRING", ""),
        os.environ.get("SHARDLINE_AZURE_SECRET_BLOCK", ""),
        os.getpid(),
    )


def _connection_string_fields(conn: str) -> dict[str, str]:
    fields = {}
    for part in conn.split(";"):
        key, sep, value = part.partition("=")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def arrow_filesystem(uri: str) -> tuple[Any, str] | None:
    """(pyarrow filesystem, path without scheme) for an s3:// or az:// URI, built from the same credentials as
    the shard store (environment or Secret block); None for a local path.

    Ray Train takes this as RunConfig(storage_filesystem=..., storage_path=path): without it, pyarrow would look
    only at its own defaults (no Secret block) and would refuse az:// (it knows Azure as abfs).
    """
    import pyarrow.fs as pafs

    scheme, sep, path = uri.partition("://")
    if not sep or scheme == "file":
        return None
    if scheme == "s3":
        env = dict(_s3_settings())
        kwargs: dict[str, Any] = {}
        secret = _secret_block("SHARDLINE_S3_SECRET_BLOCK")
        values = (json.loads(secret) if isinstance(secret, str) else dict(secret)) if secret else {}
        key_id = values.get("aws_access_key_id") or env["AWS_ACCESS_KEY_ID"]
        if key_id:
            kwargs["access_key"] = key_id
            kwargs["secret_key"] = values.get("aws_secret_access_key") or env["AWS_SECRET_ACCESS_KEY"]
            token = values.get("aws_session_token") or env["AWS_SESSION_TOKEN"]
            if token:
                kwargs["session_token"] = token
        endpoint = values.get("endpoint_url") or env["AWS_ENDPOINT_URL_S3"] or env["AWS_ENDPOINT_URL"]
        if endpoint:
            ep_scheme, _, authority = endpoint.rpartition("://")
            kwargs["endpoint_override"] = authority.rstrip("/")
            kwargs["scheme"] = ep_scheme or "https"
        kwargs["region"] = values.get("region_name") or env["AWS_DEFAULT_REGION"] or "us-east-1"
        return pafs.S3FileSystem(**kwargs), path
    if scheme in ("az", "abfs", "abfss"):
        conn = _secret_block("SHARDLINE_AZURE_SECRET_BLOCK") or os.environ.get("AZURE_STORAGE_CONNECTION_STRING", "")
        if not conn:
            raise CredentialsError(
                f"{scheme}://: no credentials: set AZURE_STORAGE_CONNECTION_STRING or SHARDLINE_AZURE_SECRET_BLOCK"
            )
        f = _connection_string_fields(conn)
        kwargs = {"account_name": f.get("AccountName", "")}
        if f.get("AccountKey"):
            kwargs["account_key"] = f["AccountKey"]
        if f.get("SharedAccessSignature"):
            kwargs["sas_token"] = f["SharedAccessSignature"]
        if f.get("BlobEndpoint"):  # e.g. Azurite: http://127.0.0.1:10000/<account>
            ep_scheme, _, rest = f["BlobEndpoint"].partition("://")
            authority = rest.split("/", 1)[0]
            kwargs.update(
                blob_storage_authority=authority,
                dfs_storage_authority=authority,
                blob_storage_scheme=ep_scheme,
                dfs_storage_scheme=ep_scheme,
            )
        elif f.get("EndpointSuffix"):
            ep_scheme = f.get("DefaultEndpointsProtocol", "https")
            kwargs.update(
                blob_storage_authority=f"blob.{f['EndpointSuffix']}",
                dfs_storage_authority=f"dfs.{f['EndpointSuffix']}",
                blob_storage_scheme=ep_scheme,
                dfs_storage_scheme=ep_scheme,
            )
        return pafs.AzureFileSystem(**kwargs), path
    return None


# ------------------------------------------------------------------------------------------------------------
# Credentials for a run's workers on the long-lived local head. Its processes were started by an earlier run, so
# the driver hands its settings to its Ray job. Plain settings travel in the job's runtime env; Ray writes runtime
# envs to its logs in clear, so secrets travel in a 0600 file on this machine whose path is in the runtime env,
# read by each worker (adopt_worker_secrets) and removed when the driver disconnects.
# ------------------------------------------------------------------------------------------------------------
WORKER_SECRETS_ENV = "SHARDLINE_WORKER_SECRETS"
NO_SECRETS = "-"  # the variable's value when there is no file (an empty value may be dropped by Ray)
# secret by name: too narrow puts an API key in a runtime env Ray logs in clear; too wide keeps a plain setting from
# a remote cluster's job (only plain settings travel there): AZURE_AUTHORITY_HOST and MLFLOW_TRACKING_AUTH (a plugin
# name) are plain, PREFECT_API_KEY, PREFECT_API_AUTH_STRING and AZURE_STORAGE_KEY are not; PASSPHRASE is not a
# PASSWORD (MLFLOW_CRYPTO_KEK_PASSPHRASE, the key to MLflow's encrypted secrets, went to the runtime env in clear)
_SECRET_NAME = (
    "SECRET",
    "PASSWORD",
    "PASSPHRASE",
    "PRIVATE_KEY",
    "TOKEN",
    "ACCESS_KEY",
    "API_KEY",
    "ACCOUNT_KEY",
    "STORAGE_KEY",
    "AUTH_STRING",
    "SESSION",
    "CONNECTION_STRING",
    "CREDENTIAL",
    "SAS",
)


def split_secrets(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(plain, secret) settings: secret by name (…_SECRET…, …PASSWORD…, …TOKEN…, …API_KEY…, …AUTH_STRING…, ...)
    or by value (a URI password)."""
    from infra.redact import find_credential

    plain: dict[str, str] = {}
    secret: dict[str, str] = {}
    for key, value in env.items():
        is_secret = any(mark in key.upper() for mark in _SECRET_NAME) or bool(find_credential(value))
        (secret if is_secret else plain)[key] = value
    return plain, secret


def _secrets_folder() -> Any:
    from infra.paths import shardline_home

    folder = shardline_home() / "secrets"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def write_secrets_file(name: str, secret: dict[str, str]) -> str:
    """Write `secret` to $SHARDLINE_HOME/secrets/<name>, readable by its owner only (replaced atomically)."""
    folder = _secrets_folder()
    tmp = folder / f".{name}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(secret, fh)
    os.replace(tmp, folder / name)
    return str(folder / name)


def write_worker_secrets(secret: dict[str, str]) -> str:
    """A new secrets file for this driver's run; the files of drivers that died are removed first."""
    import uuid

    for old in _secrets_folder().glob("*.json"):
        pid = old.name.split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            old.unlink(missing_ok=True)
    return write_secrets_file(f"{os.getpid()}-{uuid.uuid4().hex}.json", secret)


def adopt_worker_secrets(required: bool = True) -> None:
    """In a Ray worker of a run on the local head: take the driver's secrets into this process's environment.

    `required=False` (Serve replicas, which outlive runs): a missing file is skipped, since Ray merges in the
    variables of whichever run's job started Serve's controller, whose file is gone by then.
    """
    path = os.environ.get(WORKER_SECRETS_ENV, "")
    if not path or path == NO_SECRETS:
        return
    try:
        with open(path, encoding="utf-8") as fh:
            os.environ.update(json.load(fh))
    except FileNotFoundError:
        if required:
            raise CredentialsError(f"{WORKER_SECRETS_ENV}={path}: the driver's credentials file is gone") from None
    except (OSError, ValueError) as e:
        raise CredentialsError(f"{WORKER_SECRETS_ENV}={path}: the driver's credentials are unreadable: {e}") from None
