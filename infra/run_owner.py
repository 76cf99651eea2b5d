"""MLflow runs left RUNNING by a process that died: who owns a run, and ending the runs whose owner is gone.

A SIGKILLed `shardline run` (or a flow process a crashed Prefect worker took with it) cannot close its MLflow runs,
so they would stay RUNNING forever. Every parent run records its owner, `host/boot id/pid/start time` of the process
executing the flow (`shardline.owner`). When a later flow opens its parent run in the same experiment, RUNNING
parent runs whose owner ran on this host and no longer exists (no such pid with that start time, or the host has
rebooted since) are ended as KILLED together with their RUNNING stage runs, each tagged `shardline.ended_by` with
the run that found them and why. Runs owned on another host are left alone: their process cannot be checked from
here (they are ended by the next run on their own host). Without a boot id (not Linux) nothing is ended. The start
time is in clock ticks since boot (infra.process), so owner tags written by earlier versions compare as before.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from infra import process
from infra.names import TAG_ENDED_BY, TAG_OWNER, TAG_PARENT  # noqa: F401 - TAG_OWNER re-exported

SCAN_LIMIT = 200  # RUNNING parent runs looked at per call: a bound on the cost of opening a run


def current_owner() -> str:
    """This process as a run owner: host/boot id/pid/start time (pid alone is reused)."""
    me = process.inspect(os.getpid())
    return f"{socket.gethostname()}/{process.boot_id()}/{os.getpid()}/{me.start_ticks if me else ''}"


def owner_alive(owner: str) -> bool | None:
    """Whether the owning process still runs: True/False on this host, None when it cannot be told here."""
    parts = owner.split("/")
    if len(parts) != 4 or parts[0] != socket.gethostname() or not parts[1] or not parts[3]:
        return None
    host_boot = process.boot_id()
    if not host_boot or not parts[2].isdigit():
        return None
    if parts[1] != host_boot:
        return False  # the host rebooted since: every process of then is gone
    return process.is_same(int(parts[2]), parts[3])


def end_orphaned_runs(client: Any, experiment_id: str, found_by: str) -> list[str]:
    """End as KILLED the RUNNING parent runs of `experiment_id` whose owner died on this host, and their RUNNING
    stage runs; return the ids ended. `found_by` names the run that noticed (tagged on each).

    A parent run is any run with an owner tag (only parent runs get one), whatever its stage tag: a command run
    outside a flow (`shardline shard`) retags its parent's stage with the command's name (flows.run_context), and
    selecting stage 'pipeline' only left such a run RUNNING forever once its process was killed."""
    ended: list[str] = []
    parents = client.search_runs(
        [experiment_id],
        max_results=SCAN_LIMIT,
        filter_string=f"attributes.status = 'RUNNING' and tags.`{TAG_OWNER}` LIKE '%'",
    )
    for parent in parents:
        owner = parent.data.tags.get(TAG_OWNER, "")
        if parent.info.run_id == found_by or not owner or owner_alive(owner) is not False:
            continue
        stages = client.search_runs(
            [experiment_id],
            filter_string=(f"attributes.status = 'RUNNING' and tags.`{TAG_PARENT}` = '{parent.info.run_id}'"),
        )
        for run in [*stages, parent]:
            client.set_tag(run.info.run_id, TAG_ENDED_BY, f"run {found_by}: owner process {owner} is gone")
            client.set_terminated(run.info.run_id, "KILLED")
            ended.append(run.info.run_id)
    return ended
