"""The Ray part: the long-lived local Ray head (infra.head) that runs use for training and serving."""

from __future__ import annotations

from flows.stack.procs import Proc, _start_ticks, is_ours
from flows.stack.state import PartState
from infra.config import ClusterConfig


def start(cluster: ClusterConfig, recorded: PartState | None) -> PartState:
    """Start the head, or reuse the one infra.head recorded; `down` stops it only if this `up` started it."""
    from infra.head import ensure_head, read_head

    before = read_head()
    head = ensure_head(cluster)
    started = before is None or (recorded is not None and recorded.started_by_us)
    procs = [Proc(pid=pid, start_ticks=ticks) for pid in head.pids if (ticks := _start_ticks(pid)) is not None]
    return PartState(
        name="ray", url=head.dashboard_url, procs=procs, started_by_us=started, detail={"gcs_address": head.gcs_address}
    )  # the dashboard wants Ray's token: up = PIDs alive


def stop(part: PartState) -> bool:
    """Stop the head through infra.head (its recorded PIDs), only when this stack started it and a process `up`
    recorded for it still runs: a head that replaced it (a later `shardline run` after it died) is not ours."""
    if not part.started_by_us:
        return False
    from infra.head import stop_head

    return stop_head(owned=[p.pid for p in part.procs if is_ours(p)])
