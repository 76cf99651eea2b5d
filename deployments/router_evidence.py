"""The router's canary evidence: one observation per request, kept where the rollout driver reads it.

A mixin of deployments.serve_app.Router (which owns `evidence`, `observations`, `seq`, `replica_id`, `metrics` and
`_pushes`): with the application's Evidence deployment (deployments/evidence.py) every router replica sends its
observations there during a canary; without one, the replica keeps them itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from deployments.evidence import step_observations
from deployments.router_config import Job

log = logging.getLogger(__name__)


class EvidenceRecorder:
    """Records observations and answers the driver's reads of them."""

    evidence: Any
    observations: deque[dict[str, Any]]
    seq: int
    replica_id: str
    metrics: Any
    _pushes: set[Any]

    async def get_observations(self, canary_id: str, epoch: int, since: int = 0) -> dict[str, Any]:
        """Requests recorded at step `epoch` of canary `canary_id` with sequence number >= since: every router
        replica's, from the application's Evidence deployment (this replica's own when there is none)."""
        if self.evidence is not None:
            return await self.evidence.get.remote(canary_id, epoch, since)
        items = step_observations(self.observations, canary_id, epoch, since)
        return {"replica_id": self.replica_id, "next": self.seq, "items": items}

    def _record(
        self,
        job: Job,
        to_challenger: bool,
        served: dict,
        shadow: dict | None,
        failed: dict | None,
        total_ms: float,
        mirror: dict | None = None,
    ) -> None:
        """One observation per request: the challenger's call (also when it failed and the champion answered),
        the champion's served call, and the champion's shadow score of the same text."""
        cfg, endpoint = job.cfg, job.endpoint
        fallback = failed is not None
        challenger_call = failed if fallback else (served if to_challenger else None)
        champion_call = served if (not to_challenger or fallback) and served is not shadow else None
        if mirror is not None:  # shadow mode: the challenger's copy, and the champion's call that served the client
            challenger_call, champion_call = mirror, served

        def slim(call: dict | None) -> dict | None:
            if call is None:
                return None
            return {k: call.get(k) for k in ("version", "ok", "bits", "bytes", "latency_ms", "error")}

        observation = {
            "seq": self.seq,
            "canary_id": cfg.canary_id,
            "epoch": cfg.epoch,
            "t": time.time(),
            "endpoint": endpoint,
            "probe": job.probe,
            "request_id": job.request_id,
            "router_replica": self.replica_id,
            "op": "complete" if endpoint in ("completions", "chat") else "score",
            # who answered the client: the champion in shadow mode, whose failures say nothing of the challenger
            "role": "challenger" if to_challenger and mirror is None else "champion",
            "challenger": slim(challenger_call),
            "champion": slim(champion_call),
            "shadow": slim(shadow),
            "fallback": fallback,
            "client_ok": bool(served.get("ok")),
            "total_ms": total_ms,
        }
        self.seq += 1
        if self.evidence is None:
            self.observations.append(observation)
        elif cfg.canary_id:  # only a canary needs evidence; sent without holding up the client's answer
            task = asyncio.ensure_future(self._push(observation))
            self._pushes.add(task)
            task.add_done_callback(self._pushes.discard)

    async def _push(self, observation: dict[str, Any]) -> None:
        try:
            await self.evidence.add.remote(observation)
        except Exception as e:  # noqa: BLE001 - a lost observation is less evidence, never a failed request
            self.metrics.rejected("evidence", 500)
            log.warning("evidence not recorded: %s: %s", type(e).__name__, e)
