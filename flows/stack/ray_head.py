"""The Ray part: the long-lived local Ray head (infra.head) that runs use for training and serving."""

from __future__ import annotations

from flows.stack.procs import Proc, _start_ticks, is_ours
from flows.stack.state import PartState
from infra.config import ClusterConfig


def start(cluster: ClusterConfig, recorded: PartState | None) -> PartState:
    """Start the head, or reuse the one infra.head recorded; `down` stops it only if this `up` started it.

    A reused head is ours only while a process `up` recorded for it still runs and is one of the head's: when the
    head `up` started died and a `shardline run` started another, that one is its owner's, not the stack's.
    """
    from infra.head import ensure_head, read_head

    before = read_head()
    head = ensure_head(cluster)
    started = before is None or (recorded is not None and _ours_among(recorded, head.pids))
    procs = [Proc(pid=pid, start_ticks=ticks) for pid in head.pids if (ticks := _start_ticks(pid)) is not None]
    return PartState(
        name="ray", url=head.dashboard_url, procs=procs, started_by_us=started, detail={"gcs_address": head.gcs_address}
    )  # the dashboard wants Ray's token: up = PIDs alive


def _ours_among(part: PartState, pids: list[int]) -> bool:
    """True if this stack started the part and a process it recorded is still that process and one of `pids`."""
    return part.started_by_us and any(p.pid in pids and is_ours(p) for p in part.procs)


def stop(part: PartState) -> bool:
    """Stop the head through infra.head (its recorded PIDs), only when this stack started it and a process `up`
    recorded for it still runs: a head that replaced it (a later `shardline run` after it died) is not ours."""
    if not part.started_by_us:
        return False
    from infra.head import stop_head

    return stop_head(owned=[p.pid for p in part.procs if is_ours(p)])
