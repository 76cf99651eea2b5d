"""`up`, `down`, `status` of the whole local stack, in dependency order, recorded in $SHARDLINE_HOME/stack.json."""

from __future__ import annotations

import os
from collections.abc import Callable

from flows.stack import deploy, endpoint, mlflow_server, prefect_server, prometheus, ray_head, worker
from flows.stack.config import StackConfig
from flows.stack.postgres import Backend, ensure_databases, parse_backend
from flows.stack.procs import StackError, is_ours
from flows.stack.service import stop_part
from flows.stack.state import (
    PARTS,
    PartState,
    StackState,
    dump_status,
    read_state,
    stack_lock,
    state_path,
    write_state,
)
from infra.paths import quiet_telemetry, shardline_home
from infra.redact import first_line


def up(cfg: StackConfig, pipeline_config, say: Callable[[str], None] = print) -> StackState:
    """Bring every part up (keeping those already answering), record each as it comes, deploy prefect.yaml.

    Idempotent: a second `up` finds every part answering and changes nothing but the deployments. Runs under the
    stack lock (state.stack_lock): an `up` or `down` already running makes this one fail at once.

    Raises:
        StackBusy: another `up` or `down` runs on this $SHARDLINE_HOME (a StackError; nothing was started).
        StackError: a part did not come up; the parts started before it stay recorded, so `down` stops them.
    """
    quiet_telemetry()
    # Before anything imports prefect: its settings are read from the environment once, at import. The head and
    # the endpoint (serve_up takes the release lock on this Prefect server) must see the stack's servers.
    os.environ["PREFECT_API_URL"] = prefect_server.api_url(cfg)
    os.environ["MLFLOW_TRACKING_URI"] = mlflow_server.tracking_url(cfg)
    with stack_lock():
        return _up(cfg, pipeline_config, say)


def _up(cfg: StackConfig, pipeline_config, say: Callable[[str], None]) -> StackState:
    """`up` with the stack lock held: the record is read here, after any other `up` or `down` wrote its last."""
    home = shardline_home()
    old = read_state()
    state = StackState(home=str(home), parts=dict(old.parts) if old and old.home == str(home) else {})

    def record(part: PartState) -> PartState:
        state.parts[part.name] = part
        write_state(state)
        how = "started" if part.started_by_us else "kept (already running)"
        say(f"  {part.name:<9} {part.url or '-':<45} {how}")
        return part

    backend = parse_backend(cfg.backend) if cfg.backend else None
    if backend is not None:
        record(postgres_part(backend, ensure_databases(backend)))
    else:
        state.parts.pop("postgres", None)
    prefect = record(prefect_server.start(cfg, home, state.parts.get("prefect"), backend))
    mlflow = record(mlflow_server.start(cfg, home, state.parts.get("mlflow"), backend))
    record(worker.start(cfg, home, state.parts.get("worker"), prefect.url, mlflow.url))
    if cfg.ray:
        record(ray_head.start(pipeline_config.cluster, state.parts.get("ray")))
    if cfg.endpoint:
        record(endpoint.start(pipeline_config, state.parts.get("endpoint")))
    if cfg.prometheus:  # last: it scrapes the endpoint and the Ray head. An observer only, so never fatal to `up`
        try:
            record(prometheus.start(cfg, home, state.parts.get("prometheus"), pipeline_config.serve))
        except prometheus.Unavailable as e:
            say(f"  prometheus SKIPPED: {e}")
            forget_unless_running(state, "prometheus", say)
    if cfg.deploy:
        commit = deploy.deploy_all(prefect.url)
        prefect.detail["deployed_commit"] = commit
        write_state(state)
        say(f"  deployed  prefect.yaml at commit {commit[:12]} to pool {cfg.work_pool!r}")
    return state


def postgres_part(backend: Backend, created: list[str]) -> PartState:
    """The record of the PostgreSQL backend: no process of the stack's, so `status` dials its host and port."""
    return PartState(
        name="postgres",
        url=backend.display,
        port=backend.port,
        detail={
            "host": backend.host,
            "databases": ",".join(backend.databases.values()),
            "created": ",".join(created) or "none",
        },
    )


def forget_unless_running(state: StackState, name: str, say: Callable[[str], None]) -> None:
    """Drop a skipped part's record, unless a process this stack started for it still runs: that one stays
    recorded, so `down` stops it (dropped, it would run on where no `down` ever finds it)."""
    part = state.parts.get(name)
    if part is not None and part.started_by_us and any(is_ours(p) for p in part.procs):
        say(f"  {name:<9} the one an earlier `up` started still runs: kept on record, so `shardline down` stops it")
        return
    state.parts.pop(name, None)
    write_state(state)


def down(pipeline_config, say: Callable[[str], None] = print) -> list[str]:
    """Stop what `up` started, by the PIDs it recorded, in reverse order; return the parts stopped.

    Parts that were already running when `up` came (started_by_us false) are left alone, and so is every process
    that `up` did not record. A part that fails to stop is reported in one line and stays recorded, and the parts
    after it are still stopped. The state file is removed once nothing recorded is left running. Runs under the
    stack lock (state.stack_lock): an `up` or `down` already running makes this one fail at once.

    Raises:
        StackBusy: another `up` or `down` runs on this $SHARDLINE_HOME (a StackError; nothing was stopped).
        StackError: some part could not be stopped (named); it stays recorded for the next `down`.
    """
    with stack_lock():
        return _down(pipeline_config, say)


def _down(pipeline_config, say: Callable[[str], None]) -> list[str]:
    """`down` with the stack lock held, so no `up` records a part after this read the record."""
    state = read_state()
    if state is None:
        say("no stack recorded in " + str(state_path()))
        return []
    stopped = []
    failed = []
    for name in reversed(PARTS):
        part = state.parts.get(name)
        if part is None:
            continue
        try:
            if name == "endpoint":
                done = endpoint.stop(part, pipeline_config)
            elif name == "ray":
                done = ray_head.stop(part)
            else:
                done = stop_part(part)
        except Exception as e:  # noqa: BLE001 - one part's failure must not leave the others running
            say(f"  {name:<9} could not be stopped: {type(e).__name__}: {first_line(e)}")
            failed.append(name)
            continue
        if done:
            stopped.append(name)
        what = (
            "stopped"
            if done
            else "was not running"
            if part.started_by_us
            else "left running (not started by shardline up)"
        )
        say(f"  {name:<9} {what}")
        state.parts.pop(name)
        write_state(state)
    if not state.parts:
        state_path().unlink(missing_ok=True)
    if failed:
        raise StackError(f"could not stop {', '.join(failed)}; still recorded, so `shardline down` tries again")
    return stopped


def status() -> dict:
    """Each recorded part: up or down, URL, PIDs, and whether `up` started it; {} when no stack is recorded."""
    state = read_state()
    return dump_status(state) if state is not None else {}
