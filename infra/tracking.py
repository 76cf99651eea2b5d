"""The MLflow run tree: one parent run per flow run, one child run per stage, and the lineage tag names."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from infra.names import TAG_ENDED_BY, TAG_FLOW_RUN_ID, TAG_GIT_COMMIT, TAG_PARENT, TAG_STAGE
from infra.paths import quiet_telemetry, shardline_home
from infra.redact import redact
from infra.run_owner import TAG_OWNER, current_owner, end_orphaned_runs


class Lineage(BaseModel):
    """What every stage receives to log under the flow run's MLflow run tree."""

    tracking_uri: str
    experiment: str
    parent_run_id: str
    flow_run_id: str = ""


STAGES = ("shard_dataset", "provision_cluster", "train_fsdp", "validate_checkpoint", "promote_model", "canary_deploy")


def registry_client(tracking_uri: str) -> Any:
    """An MlflowClient whose tracking and registry are both `tracking_uri`."""
    quiet_telemetry()
    import mlflow

    return mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///PATH` tracking URI (its query dropped); None for any other URI."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///").partition("?")[0])


def resolve_tracking_uri(configured: str = "") -> str:
    """The tracking URI: the configured one, else $MLFLOW_TRACKING_URI, else SQLite in $SHARDLINE_HOME.

    A `user:password@` part (only possible from the environment: configs refuse credentials) is moved into
    MLflow's own MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD variables of this process, and the URI
    returned without it, so the password never travels inside task parameters, tags, logs or Ray configs.
    """
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri:
        return f"sqlite:///{shardline_home() / 'mlflow.db'}"
    return _credentials_to_environment(uri)


def _credentials_to_environment(uri: str) -> str:
    from urllib.parse import unquote, urlsplit, urlunsplit

    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(user)
    if password:
        os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(password)
    clean = urlunsplit(parts._replace(netloc=host))
    if os.environ.get("MLFLOW_TRACKING_URI") == uri:
        os.environ["MLFLOW_TRACKING_URI"] = clean  # child processes (Ray workers) see the clean URI + variables
    return clean


def setup_tracking(tracking_uri: str, experiment: str) -> str:
    """Point this process's MLflow at `tracking_uri` and make sure `experiment` exists; return its id.

    A new experiment on a local (SQLite/file) store keeps artifacts in $SHARDLINE_HOME/mlartifacts, not ./mlruns.
    """
    quiet_telemetry()
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    client = mlflow.MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is not None:
        return exp.experiment_id
    location = None
    if tracking_uri.startswith(("sqlite:", "file:")) or "://" not in tracking_uri:
        location = (shardline_home() / "mlartifacts").as_uri()
    try:
        return client.create_experiment(experiment, artifact_location=location)
    except Exception:  # created concurrently by another process
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise
        return exp.experiment_id


def _find_run(client: Any, experiment_id: str, filter_string: str) -> Any | None:
    runs = client.search_runs([experiment_id], filter_string=filter_string, max_results=1)
    return runs[0] if runs else None


def open_parent_run(tracking_uri: str, experiment: str, flow_run_id: str, flow_run_name: str) -> str:
    """Get or create the parent run of a Prefect flow run (idempotent on the flow run id); return its id.

    The run records this process as its owner (a retried flow run takes its run over, RUNNING again); parent
    runs of the experiment whose owner died on this host are then ended as KILLED (infra/run_owner.py).
    """
    import mlflow

    experiment_id = setup_tracking(tracking_uri, experiment)
    client = mlflow.MlflowClient(tracking_uri)
    found = _find_run(
        client, experiment_id, f"tags.`{TAG_FLOW_RUN_ID}` = '{flow_run_id}' and tags.`{TAG_STAGE}` = 'pipeline'"
    )
    if found is not None:
        run_id = found.info.run_id
        client.set_tag(run_id, TAG_OWNER, current_owner())
        _forget_ended_by(client, found)
        if found.info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
    else:
        run_id = client.create_run(
            experiment_id,
            run_name=flow_run_name,
            tags={TAG_FLOW_RUN_ID: flow_run_id, TAG_STAGE: "pipeline", TAG_OWNER: current_owner(), **git_tags()},
        ).info.run_id
    try:
        ended = end_orphaned_runs(client, experiment_id, run_id)
    except Exception as err:  # noqa: BLE001 - tidying up after dead runs must never fail this one
        logging.getLogger(__name__).warning("could not end the runs of dead processes: %s", redact(str(err)))
    else:
        if ended:
            logging.getLogger(__name__).info(
                "ended %d MLflow run(s) whose process died (KILLED): %s", len(ended), ", ".join(ended)
            )
    return run_id


def _forget_ended_by(client: Any, run: Any) -> None:
    """Drop TAG_ENDED_BY from a run taken over again: it was ended as KILLED when its process was gone, and a retry
    resumes it; left, the tag would say a run that then finishes was killed."""
    if TAG_ENDED_BY in (run.data.tags or {}):
        client.delete_tag(run.info.run_id, TAG_ENDED_BY)


def close_run(tracking_uri: str, run_id: str, ok: bool) -> None:
    """Mark a run FINISHED or FAILED."""
    import mlflow

    mlflow.MlflowClient(tracking_uri).set_terminated(run_id, "FINISHED" if ok else "FAILED")


def child_run_id(tracking_uri: str, parent_run_id: str, stage: str) -> str:
    """Get or create the child run of `stage` under `parent_run_id`: a retried stage reuses its run."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    parent = client.get_run(parent_run_id)
    found = _find_run(
        client,
        parent.info.experiment_id,
        f"tags.`{TAG_PARENT}` = '{parent_run_id}' and tags.`{TAG_STAGE}` = '{stage}'",
    )
    if found is not None:
        _forget_ended_by(client, found)
        return found.info.run_id
    tags = {TAG_PARENT: parent_run_id, TAG_STAGE: stage}
    flow_run = parent.data.tags.get(TAG_FLOW_RUN_ID)
    if flow_run:
        tags[TAG_FLOW_RUN_ID] = flow_run
    return client.create_run(parent.info.experiment_id, run_name=stage, tags=tags).info.run_id


def stage_seconds(tracking_uri: str, parent_run_id: str) -> dict[str, float]:
    """Wall seconds of each finished stage run under `parent_run_id` (first start to last end, so a retried stage
    counts its retries), in pipeline order; stages that overlapped each count their own time."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    parent = client.get_run(parent_run_id)
    runs = client.search_runs([parent.info.experiment_id], filter_string=f"tags.`{TAG_PARENT}` = '{parent_run_id}'")
    spans = {
        r.data.tags.get(TAG_STAGE, ""): (r.info.end_time - r.info.start_time) / 1000.0
        for r in runs
        if r.info.end_time and r.info.start_time
    }
    order = {stage: i for i, stage in enumerate(STAGES)}
    return {k: round(spans[k], 2) for k in sorted(spans, key=lambda k: (order.get(k, len(order)), k))}


@contextlib.contextmanager
def stage_run(lineage: Lineage, stage: str) -> Iterator[str]:
    """Make the stage's child run the active MLflow run of this thread; FINISHED on exit, FAILED on error.

    Yields:
        The child run id, to tag downstream products with.
    """
    import mlflow

    mlflow.set_tracking_uri(lineage.tracking_uri)
    mlflow.set_registry_uri(lineage.tracking_uri)
    run_id = child_run_id(lineage.tracking_uri, lineage.parent_run_id, stage)
    with mlflow.start_run(run_id=run_id) as run:
        try:
            yield run.info.run_id
        except BaseException:
            mlflow.end_run("FAILED")
            raise


def git_tags() -> dict[str, str]:
    """The git commit the code runs from, when it runs from a git checkout; {} otherwise."""
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {TAG_GIT_COMMIT: sha} if len(sha) == 40 else {}


def flat_params(prefix: str, model: Any) -> dict[str, str]:
    """A pydantic config as MLflow params `prefix.key`, every value redacted (configs refuse credentials; this
    is the second line of defence)."""
    from infra.redact import redact

    return {f"{prefix}.{key}": redact(value)[:500] for key, value in model.model_dump().items()}


def safe_tags(tags: dict[str, Any]) -> dict[str, str]:
    """Lineage tags with every value redacted: use for any tag that holds a URI or an address."""
    from infra.redact import redact

    return {k: redact(v) for k, v in tags.items()}
