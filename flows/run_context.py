"""The frame every shardline run goes through: guards first, then the MLflow parent run; Ray and the run closed after.

The three flows and `shardline shard` differ only in their stages; what surrounds the stages lives here, once, so
a new flow cannot leave out the guards (masked logs, refused credentials) that a UI run depends on.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flows import log_hygiene
from flows.config import (
    ConfigError,
    PipelineConfig,
    check_no_credentials,
    check_remote_storage,
    check_serving,
)
from infra import orphans
from infra.names import TAG_STAGE
from infra.tracking import Lineage, close_run, open_parent_run, resolve_tracking_uri

if TYPE_CHECKING:
    from infra.cluster import ClusterInfo


@dataclass
class ShardlineRun:
    """What a run's stages receive: the MLflow run tree, the tracking URI, a logger, the cluster once provisioned."""

    tracking_uri: str
    lineage: Lineage
    logger: logging.Logger | logging.LoggerAdapter
    cluster: ClusterInfo | None = None  # set by the run when it provisions; disconnected when the run ends


def check_parameters(origin: str, **parameters: Any) -> None:
    """ConfigError when a parameter beside the config (a shard set URI, a version) holds a credential.

    Flow parameters are stored by Prefect and shown in its UI, like the config; the message masks the credential.
    """
    from infra.redact import find_credential, redact

    def walk(name: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{name}.{k}", v)
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(f"{name}[{i}]", v)
        elif isinstance(value, str) and (what := find_credential(value)):
            raise ConfigError(
                f"{origin}: {name}={redact(value)!r} holds {what}; parameters are stored by Prefect "
                "and logged, so give credentials through the environment or a Prefect Secret block "
                "(see README)"
            )

    for name, value in parameters.items():
        walk(name, value)


def _parent_key(name: str) -> tuple[str, str, str]:
    """(key, run name, stage tag) of the parent run: the Prefect flow run's, so a retried flow run takes its run
    over; outside a flow run (`shardline shard`) a fresh key, tagged with `name` so it is not taken for a pipeline."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()  # not $PREFECT__FLOW_RUN_ID: a command started from a flow's process inherits it
    if context is not None and context.flow_run is not None:
        return str(context.flow_run.id), str(context.flow_run.name or name), "pipeline"
    return f"{name}-{uuid.uuid4().hex[:12]}", name, name


def _logger(name: str) -> logging.Logger | logging.LoggerAdapter:
    from prefect import get_run_logger
    from prefect.context import FlowRunContext

    return get_run_logger() if FlowRunContext.get() is not None else logging.getLogger(f"shardline.{name}")


@contextmanager
def shardline_run(
    config: PipelineConfig,
    name: str,
    *,
    origin: str = "flow parameter",
    uses_ray: bool = True,
    serves: bool = True,
    **parameters: Any,
) -> Iterator[ShardlineRun]:
    """Refuse a bad config before anything starts, open the run's MLflow parent run, and close all of it after.

    In order: masked logs and one-line expected failures (also in a worker's process), the orphan record, the
    credential, remote-storage and serving checks (ConfigError, one line), the parent run. At the end, also on
    failure: the Ray driver is disconnected (the cluster and its Serve app keep running), the parent run is
    closed FINISHED or FAILED, and the orphan record is dropped.

    Args:
        config: the run's PipelineConfig (a flow parameter, or the CLI's loaded config).
        name: the flow's name; names the parent run when there is no Prefect flow run (`shardline shard`).
        origin: how the config reached the run, for messages ("flow parameter", "config").
        uses_ray: the run connects to Ray (every flow; `shardline shard` only with data.engine='ray').
        serves: the run may serve on serve.port, which is then probed (not `shardline shard`, not canary control).
        **parameters: the run's other parameters; refused like the config when one holds a credential.
    """
    log_hygiene.install()  # masked credentials, one-line expected failures (also when a worker runs the flow)
    orphans.record_children()  # e.g. Prefect's temporary server: a rerun stops it if this process is killed
    try:
        check_no_credentials(config, origin)
        check_parameters(origin, **parameters)
        logger = _logger(name)
        tracking_uri = resolve_tracking_uri(config.registry.tracking_uri)
        check_remote_storage(config, origin, tracking_uri)  # before anything is submitted to a remote cluster
        check_serving(config, origin, probe=serves)
        key, run_name, stage = _parent_key(name)
        parent = open_parent_run(tracking_uri, config.registry.experiment, key, run_name)
        if stage != "pipeline":
            import mlflow

            mlflow.MlflowClient(tracking_uri).set_tag(parent, TAG_STAGE, stage)
        run = ShardlineRun(
            tracking_uri=tracking_uri,
            logger=logger,
            lineage=Lineage(
                tracking_uri=tracking_uri, experiment=config.registry.experiment, parent_run_id=parent, flow_run_id=key
            ),
        )
        logger.info("MLflow parent run %s (%s)", parent, tracking_uri.split("://")[0])

        ok = False
        try:
            yield run
            ok = True
        finally:
            if uses_ray:
                from infra.cluster import teardown

                teardown(run.cluster)
            close_run(tracking_uri, parent, ok)
    finally:
        orphans.forget()
