"""MLflow runs left RUNNING by a process that died: who owns a run, and ending the runs whose owner is gone.

A SIGKILLed `shardline run` (or a flow process a crashed Prefect worker took with it) cannot close its MLflow runs,
so they would stay RUNNING forever. Every parent run records its owner, `host/boot id/pid/start time` of the process
executing the flow (`shardline.owner`). When a later flow opens its parent run in the same experiment, RUNNING
parent runs whose owner ran on this host and no longer exists (no such pid with that start time, or the host has
rebooted since) are ended as KILLED together with their RUNNING stage runs, each tagged `shardline.ended_by` with
the run that found them and why. Runs owned on another host are left alone: their process cannot be checked from
here (they are ended by the next run on their own host). Without /proc (not Linux) nothing is ended.
"""
from __future__ import annotations

import os
import socket
from typing import Any

TAG_OWNER = "shardline.owner"
TAG_ENDED_BY = "shardline.ended_by"
TAG_STAGE = "shardline.stage"  # = infra.tracking.TAG_STAGE (that module imports this one)
TAG_PARENT = "mlflow.parentRunId"
SCAN_LIMIT = 200  # RUNNING parent runs looked at per call: a bound on the cost of opening a run


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> str:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); "" if there is none."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            stat = fh.read()
    except OSError:
        return ""
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": comm may hold spaces and parentheses
    return fields[19] if len(fields) > 19 else ""


def current_owner() -> str:
    """This process as a run owner: host/boot id/pid/start time (pid alone is reused)."""
    pid = os.getpid()
    return f"{socket.gethostname()}/{_boot_id()}/{pid}/{_start_ticks(pid)}"


def owner_alive(owner: str) -> bool | None:
    """Whether the owning process still runs: True/False on this host, None when it cannot be told here."""
    parts = owner.split("/")
    if len(parts) != 4 or parts[0] != socket.gethostname() or not parts[1] or not parts[3]:
        return None
    host_boot = _boot_id()
    if not host_boot or not parts[2].isdigit():
        return None
    if parts[1] != host_boot:
        return False  # the host rebooted since: every process of then is gone
    return _start_ticks(int(parts[2])) == parts[3]


def end_orphaned_runs(client: Any, experiment_id: str, found_by: str) -> list[str]:
    """End as KILLED the RUNNING parent runs of `experiment_id` whose owner died on this host, and their RUNNING
    stage runs; return the ids ended. `found_by` names the run that noticed (tagged on each)."""
    ended: list[str] = []
    parents = client.search_runs([experiment_id], max_results=SCAN_LIMIT,
                                 filter_string=f"attributes.status = 'RUNNING' and tags.`{TAG_STAGE}` = 'pipeline'")
    for parent in parents:
        owner = parent.data.tags.get(TAG_OWNER, "")
        if parent.info.run_id == found_by or not owner or owner_alive(owner) is not False:
            continue
        stages = client.search_runs([experiment_id], filter_string=(
            f"attributes.status = 'RUNNING' and tags.`{TAG_PARENT}` = '{parent.info.run_id}'"))
        for run in [*stages, parent]:
            client.set_tag(run.info.run_id, TAG_ENDED_BY, f"run {found_by}: owner process {owner} is gone")
            client.set_terminated(run.info.run_id, "KILLED")
            ended.append(run.info.run_id)
    return ended
