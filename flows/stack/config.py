"""StackConfig: where the local stack's services listen and what they store; the `[stack]` table of a config file."""

from __future__ import annotations

import ipaddress
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

# RFC 1123 host name: dot-separated labels of letters, digits and inner hyphens
_HOST_NAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


class StackConfig(BaseModel):
    """The services `shardline up` starts on this machine. Ports are each service's usual default."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound never fails a check

    host: str = Field("127.0.0.1", description="Address every service binds to; 127.0.0.1 unless you mean otherwise.")
    prefect_port: int = Field(4200, ge=1, le=65535, description="Prefect server API and UI port.")
    mlflow_port: int = Field(5000, ge=1, le=65535, description="MLflow tracking server (and UI) port.")
    mlflow_workers: int = Field(2, ge=1, description="MLflow server worker processes (each imports MLflow: ~200 MB).")
    backend: str = Field(
        "",
        description="PostgreSQL server for the MLflow backend store and the Prefect database, e.g. "
        "'postgresql://shardline@db:5432/shardline': databases NAME_mlflow and NAME_prefect are created there if "
        "missing. A password is taken from PGPASSWORD, never from this string's log or state. Empty: SQLite files "
        "under $SHARDLINE_HOME.",
    )
    artifacts: str = Field(
        "",
        description="Where the MLflow server stores artifacts: a local path, 's3://bucket/prefix' or an Azure "
        "'wasbs://' URI. Empty: $SHARDLINE_HOME/mlartifacts.",
    )
    work_pool: str = Field("shardline-process", description="Name of the process work pool the deployments use.")
    worker_limit: int = Field(4, ge=1, description="Flow runs the worker runs at once (each trains on Ray).")
    ray: bool = Field(True, description="Start (or reuse) the long-lived local Ray head training and serving use.")
    endpoint: bool = Field(True, description="Start the model endpoint (serves the registry's champion).")
    prometheus: bool = Field(
        True,
        description="Start a Prometheus server scraping the endpoint's /metrics and the Ray head's nodes "
        "(training's gauges). Without a `prometheus` binary `up` skips it with a note saying how to install it.",
    )
    prometheus_port: int = Field(
        9095,
        ge=1,
        le=65535,
        description="Prometheus UI and API port; not Prometheus's usual 9090, where Debian's "
        "prometheus package (which `make test-system` installs) runs a system server.",
    )
    prometheus_scrape_s: float = Field(
        10.0,
        gt=0,
        description="How often Prometheus scrapes the endpoint and the Ray nodes (Ray's own template: 10).",
    )
    deploy: bool = Field(True, description="Deploy prefect.yaml to the Prefect server once it answers.")
    start_timeout_s: float = Field(180.0, gt=0, description="How long `up` waits for each service to answer.")

    @field_validator("host")
    @classmethod
    def _ipv4_or_name(cls, host: str) -> str:
        """Refused here, in one line naming stack.host: the services' URLs are written `http://{host}:{port}`, so
        an IPv6 literal gave a bare InvalidURL (or a wrong port) deep in `up`, and no part of the stack takes one."""
        try:
            ipaddress.IPv4Address(host)
            return host
        except ValueError:
            pass
        if _HOST_NAME.fullmatch(host) is None:
            raise ValueError("not an IPv4 address or a host name (IPv6 is not supported; e.g. 127.0.0.1 or 0.0.0.0)")
        return host
