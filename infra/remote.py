"""What a remote Ray cluster needs from the rest of the config: storage every node reaches, and stages it can run.

Workers of a remote cluster run on other machines: a checkpoint folder or shard set on the driver's disk is
invisible to them (Ray Train would wait on files that never appear). So with `cluster.mode = "remote"` the
checkpoint storage, the shard output and a file-based MLflow store must be object storage (s3://, az://)
or a path under one of `cluster.shared_paths` (a mount every node has at the same place).
"""

from __future__ import annotations

from pathlib import Path

from infra.config import ClusterConfig

SHARED_SCHEMES = ("s3", "az")  # what infra.storage and Ray Train (infra.credentials) both read and write
SERVER_SCHEMES = ("http", "https", "postgresql", "mysql", "mssql", "databricks", "databricks-uc")
# MLflow's tracking URIs for Databricks with the default profile carry no '://': in a tracking URI field these are a
# server, not a relative folder (in train.storage_path a folder named "databricks" is still a local path)
TRACKING_SERVERS = ("databricks", "databricks-uc")


class RemoteConfigError(ValueError):
    """A setting a remote cluster cannot work with; the one-line message names the field and its value."""


def _local_path(value: str) -> Path | None:
    """The local path `value` names (plain, file:// or sqlite:///), None for object storage or a server."""
    scheme, sep, rest = value.partition("://")
    if not sep:
        return Path(value).expanduser().resolve()
    if scheme == "file":
        return Path(rest).resolve()
    if scheme == "sqlite":  # sqlite:///relative.db, sqlite:////absolute.db
        return Path(rest[1:]).resolve()
    return None


def _is_shared(path: Path, shared_paths: list[str]) -> bool:
    return any(path.is_relative_to(Path(p).expanduser().resolve()) for p in shared_paths)


def check_remote_config(
    cluster: ClusterConfig,
    settings: dict[str, tuple[str, str]],
    data_engine: str = "local",
    canary_enabled: bool = False,
) -> None:
    """Nothing for a local cluster; for mode=remote, RemoteConfigError on the first setting its nodes cannot use.

    Args:
        cluster: the cluster section.
        settings: field name -> (value as configured, what an empty value means), e.g.
            {"train.storage_path": ("", "/home/me/.shardline/checkpoints")}.
        data_engine: data.engine; 'ray' needs a Ray driver, which a job-server address does not give.
        canary_enabled: canary.enabled; the live endpoint needs a Ray driver too.
    """
    if cluster.mode != "remote":
        return
    where = f"cluster.mode='remote' (cluster.address={cluster.address!r})"
    if not cluster.address:
        raise RemoteConfigError(
            "cluster.address is empty; mode=remote needs the job-server URL, e.g. "
            "'http://head:8265' (or a GCS address 'head:6379' from a node of the cluster)"
        )
    for shared in cluster.shared_paths:
        if not Path(shared).expanduser().is_absolute():
            raise RemoteConfigError(f"cluster.shared_paths: {shared!r} is not an absolute path")
    for field, (value, default) in settings.items():
        # SQLAlchemy names a driver after the dialect: postgresql+psycopg2:// is a postgresql server
        scheme = value.partition("://")[0].partition("+")[0] if "://" in value else ""
        if scheme in SHARED_SCHEMES or scheme in SERVER_SCHEMES:
            continue
        if field.endswith("tracking_uri") and value in TRACKING_SERVERS:
            continue
        path = _local_path(value or default)
        if path is not None and _is_shared(path, cluster.shared_paths):
            continue
        shown = f"{field}={value!r}" + ("" if value else f" (the default, {default} on this machine)")
        raise RemoteConfigError(
            f"{where}: {shown} is not shared storage the cluster's nodes can reach; use "
            "s3:// or az://, or a mount listed in cluster.shared_paths"
        )
    if cluster.job_server and data_engine == "ray":
        raise RemoteConfigError(
            f"{where}: data.engine='ray' needs a Ray driver on the cluster; use "
            "data.engine='local' with a job-server address, or the GCS address 'head:6379'"
        )
    if cluster.job_server and canary_enabled:
        raise RemoteConfigError(
            f"{where}: the canary needs a Ray driver on the cluster (Ray Serve); set "
            "canary.enabled=false with a job-server address, or use the GCS address 'head:6379'"
        )
