"""The work pool and worker part: a process pool whose runs write to the stack's MLflow server and to a
$SHARDLINE_HOME that outlives them, and one worker polling it."""

from __future__ import annotations

import time
from pathlib import Path

from flows.stack.config import StackConfig
from flows.stack.procs import StackError, is_ours, spawn, stop, tail
from flows.stack.service import bin_path, service_env, stop_part
from flows.stack.state import PartState


def run_environment(home: Path, api_url: str, tracking_uri: str) -> dict[str, str]:
    """What every flow run of the pool gets: the stack's servers and state directory (absolute, outside the run's
    temporary clone) and telemetry off. Deployment `env` job variables are merged on top of these by Prefect."""
    return {
        "SHARDLINE_HOME": str(home),
        "MLFLOW_TRACKING_URI": tracking_uri,
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "RAY_USAGE_STATS_ENABLED": "0",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
    }


def base_job_template(env: dict[str, str]) -> dict:
    """Prefect's process-worker template with `env` as the pool's default environment."""
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    template["variables"]["properties"]["env"]["default"] = env
    return template


def ensure_pool(api_url: str, pool: str, env: dict[str, str]) -> None:
    """Create the process pool, or set its template on an existing one (a moved $SHARDLINE_HOME or port)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.settings import PREFECT_API_URL, temporary_settings

    template = base_job_template(env)
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=template))
        except ObjectAlreadyExists:
            client.update_work_pool(pool, WorkPoolUpdate(base_job_template=template))


def _worker_online(api_url: str, pool: str, name: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        workers = client.read_workers_for_work_pool(pool)
    return any(w.name == name and str(getattr(w.status, "value", w.status)).upper() == "ONLINE" for w in workers)


def pool_url(api_url: str, pool: str) -> str:
    """The work pool's page in the Prefect UI: the worker part's URL."""
    return f"{api_url.removesuffix('/api')}/work-pools/work-pool/{pool}"


def keeps(recorded: PartState, url: str, tracking_uri: str) -> bool:
    """Whether a running recorded worker serves this stack as configured: the same Prefect pool URL and MLflow. One
    of a moved Prefect or MLflow (another port or host) polls the old server and its runs log to the old MLflow:
    it is replaced, not kept."""
    return recorded.url == url and recorded.detail.get("tracking_uri") == tracking_uri


def start(cfg: StackConfig, home: Path, recorded: PartState | None, api_url: str, tracking_uri: str) -> PartState:
    """Set up the pool and start (or keep) one worker; wait until the server lists it online."""
    env = run_environment(home, api_url, tracking_uri)
    ensure_pool(api_url, cfg.work_pool, env)
    name = f"shardline-{cfg.work_pool}"
    url = pool_url(api_url, cfg.work_pool)
    if recorded is not None and recorded.procs and all(is_ours(p) for p in recorded.procs):
        if keeps(recorded, url, tracking_uri):
            return recorded
        stop_part(recorded)
    logs = home / "stack" / "logs"
    argv = [
        bin_path("prefect"),
        "worker",
        "start",
        "--pool",
        cfg.work_pool,
        "--type",
        "process",
        "--name",
        name,
        "--limit",
        str(cfg.worker_limit),
        "--install-policy",
        "never",
    ]
    # Poll every few seconds rather than Prefect's 10 s default: a UI run should not sit in Pending.
    proc = spawn(
        "worker",
        argv,
        service_env({**env, "PREFECT_HOME": str(home / "prefect"), "PREFECT_WORKER_QUERY_SECONDS": "3"}),
        logs,
    )
    deadline = time.monotonic() + cfg.start_timeout_s
    try:
        while not _worker_online(api_url, cfg.work_pool, name):
            if not is_ours(proc) or time.monotonic() > deadline:
                raise StackError(
                    f"worker: did not come online in pool {cfg.work_pool!r}; last log lines:\n"
                    f"{tail(logs / 'worker.log')}"
                )
            time.sleep(1.0)
    except BaseException:  # Ctrl-C, a refused poll too: the part is recorded only once this returns
        stop(proc)
        raise
    return PartState(
        name="worker",
        url=url,
        procs=[proc],
        started_by_us=True,
        detail={"pool": cfg.work_pool, "worker": name, "log": str(logs / "worker.log"), "tracking_uri": tracking_uri},
    )
