"""Training as a Ray Job on a remote cluster: what the job carries, submitting it once, finding it again, following it.

A job submitted to the cluster's job server runs on the cluster whatever happens to the process that submitted it;
that process only follows it. Its id is recorded in MLflow (TAG_RAY_JOB_ID on the training run) before it is
submitted, so a restarted follower finds the job of the same training key and re-attaches instead of submitting a
second one. The job carries the project's code in its runtime env (`working_dir`) and reads its inputs from a JSON
file on the run's shared storage; it writes its TrainResult beside them. Credentials never travel in the runtime
env (Ray logs runtime envs): the cluster's nodes use their own environment/IAM, or the secrets file named by
cluster.job_secrets_file.
"""

from __future__ import annotations

import json
import shlex
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from infra.config import ClusterConfig
from infra.names import TAG_JOB_TRAIN_RUN_ID, TAG_RAY_JOB_ID, TAG_TRAIN_KEY  # noqa: F401 - re-exported

ENTRY_MODULE = "training.job_entry"
ROOT = Path(__file__).resolve().parent.parent
# Shipped: the project's packages and top-level files. Left behind: state, data, environments, tests, VCS.
EXCLUDES = [
    "/.shardline",
    "/.venv",
    "node_modules",
    "/tests",
    "/bench",
    "/.git",
    "/data",
    "/mlruns",
    "/mlartifacts",
    "*.egg-info",
    "/.*_cache",
    "__pycache__",
    "*.pyc",
]
_DRIVER_ONLY = ("SHARDLINE_HOME", "PYTHONPATH")  # paths on the driver's machine, meaningless on the cluster
ACTIVE, DONE = ("PENDING", "RUNNING"), "SUCCEEDED"
SUBMIT_WAIT_S = 60.0  # how long a just-started head may take before its job agent accepts submissions


def local_excludes(root: Path) -> list[str]:
    """The patterns of the checkout's `.git/info/exclude`: what git ignores on this machine only. Ray's packaging
    honours `.gitignore` files but not this one, so a large local folder ignored there would be uploaded with every
    job. Negations (`!pattern`) are left out: an exclude list cannot re-include."""
    path = root / ".git" / "info" / "exclude"
    if not path.is_file():  # not a checkout, or a worktree whose .git is a file
        return []
    lines = (line.strip() for line in path.read_text(errors="replace").splitlines())
    return [line for line in lines if line and not line.startswith(("#", "!"))]


class JobFailed(RuntimeError):
    """The Ray job ended without success; the message names the job id, its status and Ray's reason."""


def job_client(address: str) -> Any:
    """A JobSubmissionClient for the job server at `address`, authenticated with Ray's token when auth is on.

    Raises:
        ClusterError: the job server does not answer.
    """
    from infra.paths import quiet_telemetry
    from infra.ray_env import ClusterError, use_token_auth

    quiet_telemetry()
    use_token_auth()
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except Exception as e:  # noqa: BLE001 - requests, Ray and auth errors alike: the user needs address and cause
        raise ClusterError(f"cannot reach the Ray job server at cluster.address={address!r}: {e}") from None


def job_runtime_env(cfg: ClusterConfig) -> dict[str, Any]:
    """The job's runtime env: the project's code as `working_dir`, plain settings only, cluster.job_pip if any.

    pip requirements are added only when configured: installing torch and ray into every job's env would take
    minutes and pull a second copy of what the cluster's image already has.
    """
    from infra.credentials import NO_SECRETS, WORKER_SECRETS_ENV, split_secrets
    from infra.ray_env import forwarded_env

    plain, _secrets = split_secrets(forwarded_env())  # the secrets stay here: Ray writes runtime envs to its logs
    env = {k: v for k, v in plain.items() if k not in _DRIVER_ONLY}
    env[WORKER_SECRETS_ENV] = cfg.job_secrets_file or NO_SECRETS
    excludes = EXCLUDES + local_excludes(ROOT)
    runtime: dict[str, Any] = {"working_dir": str(ROOT), "excludes": excludes, "env_vars": env}
    if cfg.job_pip:
        runtime["pip"] = list(cfg.job_pip)
    return runtime


def new_job_id(train_key: str) -> str:
    """A fresh submission id for the training `train_key` (readable in `ray job list`)."""
    return f"shardline-train-{train_key[:12]}-{uuid.uuid4().hex[:8]}"


def job_folder(storage_root: str, job_id: str) -> str:
    """Where a job's inputs.json and result.json live on the run's shared storage."""
    from infra import storage

    return storage.join(storage_root, "shardline-jobs", job_id)


def _credential_in(value: Any, field: str = "") -> tuple[str, str, str] | None:
    """(field, what, masked value) of the first input value that holds a credential, depth first; None if none."""
    from infra.redact import find_credential, redact

    if isinstance(value, dict):
        items: Iterator[tuple[str, Any]] = ((f"{field}.{k}" if field else str(k), v) for k, v in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"{field}[{i}]", v) for i, v in enumerate(value))
    else:
        what = find_credential(value) if isinstance(value, str) else None
        return (field, what, redact(value)) if what else None
    for name, item in items:
        found = _credential_in(item, name)
        if found:
            return found
    return None


def submit(
    client: Any, cfg: ClusterConfig, job_id: str, inputs: dict[str, Any], storage_root: str, metadata: dict[str, str]
) -> None:
    """Write the job's inputs next to its result-to-be and submit `python -m training.job_entry <inputs>`.

    Raises:
        infra.remote.RemoteConfigError: an input holds a credential (a postgresql://user:password@ tracking URI from
            $MLFLOW_TRACKING_URI): inputs.json lies in clear on shared storage every reader of the bucket sees, so
            nothing is written. The job's workers take credentials from the cluster's environment or from
            cluster.job_secrets_file (training.job_entry adopts that file before it reads its inputs).
    """
    from infra import storage
    from infra.remote import RemoteConfigError

    found = _credential_in(inputs)
    if found:
        field, what, shown = found
        raise RemoteConfigError(
            f"job input {field}={shown!r} holds {what}, and the job's inputs are stored in clear on shared storage; "
            "drop the credential from it and give it to the cluster's own environment or cluster.job_secrets_file "
            "(PostgreSQL reads PGUSER and PGPASSWORD)"
        )
    inputs_uri = storage.join(job_folder(storage_root, job_id), "inputs.json")
    storage.write_bytes(inputs_uri, json.dumps(inputs, sort_keys=True).encode())
    deadline = time.monotonic() + SUBMIT_WAIT_S
    while True:
        try:
            client.submit_job(
                entrypoint=f"python -m {ENTRY_MODULE} {shlex.quote(inputs_uri)}",
                submission_id=job_id,
                runtime_env=job_runtime_env(cfg),
                metadata=metadata,
            )
            return
        except RuntimeError as e:
            # A head that has just started answers 500 until its node agent registered; a retry whose first
            # attempt did reach the server finds the id taken, which means submitted.
            if "already" in str(e) and job_id in str(e):
                return
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def reattachable(client: Any, job_ids: list[str]) -> str:
    """The first of `job_ids` still pending/running or already succeeded on this cluster; '' when there is none.

    A recorded id the cluster does not know (the follower died between recording and submitting, or the cluster
    was replaced) and a failed or stopped job are skipped: a new job resumes from the training's checkpoints.
    """
    for job_id in job_ids:
        try:
            status = str(client.get_job_status(job_id))
        except RuntimeError as e:
            if "does not exist" not in str(e):  # a busy or restarting job server: no guess, the retry asks again
                raise
            continue
        if status.rsplit(".", 1)[-1] in (*ACTIVE, DONE):
            return job_id
    return ""


def recorded_job_ids(tracking_uri: str, experiment: str, train_key: str, address: str) -> list[str]:
    """Job ids that training runs of `train_key` on the cluster at `address` recorded, newest first."""
    from mlflow import MlflowClient

    from infra.names import TAG_CLUSTER_ADDRESS

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = client.search_runs(
        [exp.experiment_id], f"tags.`{TAG_TRAIN_KEY}` = '{train_key}'", order_by=["attributes.start_time DESC"]
    )
    return [
        r.data.tags[TAG_RAY_JOB_ID]
        for r in runs
        if r.data.tags.get(TAG_RAY_JOB_ID) and r.data.tags.get(TAG_CLUSTER_ADDRESS) == address
    ]


def follow(
    client: Any, job_id: str, on_log: Callable[[str], None], on_poll: Callable[[], object], poll_s: float = 2.0
) -> None:
    """Wait for the job to end, passing each new complete line of its log (credentials masked) to `on_log`.

    Raises:
        JobFailed: the job ended FAILED or STOPPED.
    """
    from infra.redact import redact

    seen = 0
    while True:
        status = str(client.get_job_status(job_id)).rsplit(".", 1)[-1]
        logs = client.get_job_logs(job_id)
        end = logs.rfind("\n") + 1  # whole lines only; the rest comes with the next poll
        for line in logs[seen:end].splitlines():
            on_log(redact(line))
        seen = max(seen, end)
        if status not in ACTIVE:
            break
        on_poll()
        time.sleep(poll_s)
    if status != DONE:
        message = redact(client.get_job_info(job_id).message or "")
        raise JobFailed(f"Ray job {job_id} ended {status}: {message.splitlines()[-1] if message else 'no reason'}")


def read_result(storage_root: str, job_id: str) -> dict[str, Any]:
    """The TrainResult fields the job wrote when it succeeded."""
    from infra import storage

    return json.loads(storage.read_bytes(storage.join(job_folder(storage_root, job_id), "result.json")))


@contextmanager
def stopped_when_interrupted(client: Any, job_id: str, log: Callable[[str], None]) -> Iterator[None]:
    """Stop the job when the follower is cancelled, interrupted or timed out; not on an ordinary error.

    Flow-run cancellation reaches the task as Prefect's TerminationSignal (SIGTERM), Ctrl-C as KeyboardInterrupt,
    the task's timeout as TimeoutError. A lost connection to the job server, by contrast, leaves the job running
    for the retry to re-attach to.
    """
    try:
        yield
    except BaseException as e:
        if isinstance(e, Exception) and not isinstance(e, TimeoutError):
            raise
        log(f"stopping Ray job {job_id}: the stage was interrupted ({type(e).__name__})")
        try:
            client.stop_job(job_id)
        except Exception as stop_error:  # noqa: BLE001 - the interruption is what the caller must see
            log(f"could not stop Ray job {job_id}: {stop_error}")
        raise
