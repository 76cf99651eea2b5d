"""Every router replica's metrics in every scrape, though a scrape reaches one of them.

Prometheus scrapes the gateway's /metrics, and the gateway asks each model's router over a deployment handle, which
picks one router replica. With autoscaled routers, each scrape would carry one replica's counters, a different one each
time: series missing from most scrapes, and counters that seem to reset whenever the replica changes. So each router
replica, once it has served a request, sends its exposition to the application's Evidence deployment (one replica,
deployments/evidence.py) every PUSH_S when it changed and every HEARTBEAT_S regardless; the replica a scrape reaches
sends its own exposition as of now and answers what the Evidence deployment then holds of every replica, each series
labelled with its replica (REPLICA_LABEL), as Prometheus would label pods it scraped one by one. Every scrape reads one
store, and the store keeps a replica's later exposition only (each carries a sequence number), so a counter never reads
lower than in an earlier scrape: answering "this one as of now, the others as last sent" did, whenever the next scrape
reached another replica, and rate() read it as a reset. A replica not heard from for STALE_S (it stopped, or was scaled
down) drops out, its series with it; a restarted replica is a new one whose counters start at zero, which Prometheus'
rate() reads as what it is. Without an Evidence deployment (a router built alone), or when it does not answer, a scrape
carries the replica it reached.
A mixin of deployments.serve_app.Router, which owns `evidence`, `replica_id` and `metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from infra.redact import first_line

log = logging.getLogger(__name__)
PUSH_S = 2.0  # how stale another replica's counters can be in a scrape (Prometheus scrapes every 15 s by default)
HEARTBEAT_S = 15.0  # an idle replica still says it is alive this often
STALE_S = 4 * HEARTBEAT_S  # past this without a word from a replica, its series leave the scrape
REPLICA_LABEL = "router_replica"
EVIDENCE_TIMEOUT_S = 2.0  # a send or a scrape's read waits this long for the Evidence deployment, then goes without


def merge_expositions(parts: list[tuple[str, dict[str, str]]]) -> bytes:
    """One Prometheus exposition from several (the gateway's own, each router replica's), each (text, labels added
    to its every sample, {} for none): families of the same name are joined."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Any] = {}
    for text, labels in parts:
        for fam in text_string_to_metric_families(text):
            if labels:
                fam.samples = [s._replace(labels={**s.labels, **labels}) for s in fam.samples]
            if fam.name in families:
                families[fam.name].samples.extend(fam.samples)
            else:
                families[fam.name] = fam

    class _Merged:
        def collect(self) -> list[Any]:
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())  # a duck-typed collector, as the registry takes
    return generate_latest(registry)


def replica_label(replica_id: str) -> str:
    """The label value of a router replica's series: enough of its id to tell replicas apart."""
    return replica_id[:12]


def labelled(texts: dict[str, str]) -> list[tuple[str, dict[str, str]]]:
    """metrics_texts' answer as merge_expositions' parts: each replica's text with its REPLICA_LABEL."""
    return [(text, {REPLICA_LABEL: replica}) for replica, text in sorted(texts.items())]


class MetricsSharing:
    """Sends this replica's exposition to the Evidence deployment; answers every replica's."""

    evidence: Any
    replica_id: str
    metrics: Any
    _metrics_task: asyncio.Task[None] | None
    _metrics_seq: int

    def metrics_text(self) -> str:
        """This replica's Prometheus exposition."""
        text: bytes = self.metrics.exposition()[0]
        return text.decode()

    async def _put_metrics(self, text: str, answer: bool) -> dict[str, str]:
        """Send this replica's exposition `text`, read just now; with `answer`, every live replica's as the Evidence
        deployment then holds them. Bounded by EVIDENCE_TIMEOUT_S: a scrape must not outwait Prometheus'."""
        self._metrics_seq += 1  # taken with the text, before any await: the order the texts were read in
        call = self.evidence.put_metrics.remote(self.replica_id, self._metrics_seq, text, STALE_S, answer)
        return await asyncio.wait_for(call, EVIDENCE_TIMEOUT_S)

    def _share_metrics(self) -> None:
        """Start this replica's sends, from a request (where the replica's event loop runs); again if they ended."""
        if self.evidence is not None and (self._metrics_task is None or self._metrics_task.done()):
            self._metrics_task = asyncio.get_running_loop().create_task(self._send_metrics())

    async def _send_metrics(self) -> None:
        sent, sent_at = "", float("-inf")
        while True:
            try:
                text, now = self.metrics_text(), time.monotonic()
                if text != sent or now - sent_at >= HEARTBEAT_S:
                    await self._put_metrics(text, answer=False)
                    sent, sent_at = text, now
            except Exception as e:  # noqa: BLE001 - a scrape missing this replica for a while, never a failed request
                log.warning("router metrics not shared: %s: %s", type(e).__name__, first_line(e))
            await asyncio.sleep(PUSH_S)

    async def metrics_texts(self) -> dict[str, str]:
        """Every live router replica's exposition by replica label, this one's as of now (the gateway merges them
        into its /metrics)."""
        self._share_metrics()
        if self.evidence is not None:
            try:
                texts = await self._put_metrics(self.metrics_text(), answer=True)
                return {replica_label(r): text for r, text in texts.items()}
            except Exception as e:  # noqa: BLE001 - the other replicas' series are missing from this scrape only
                log.warning("other router replicas' metrics not read: %s: %s", type(e).__name__, first_line(e))
        return {replica_label(self.replica_id): self.metrics_text()}

    async def metrics_exposition(self) -> bytes:
        """The router's own /metrics over HTTP (an application with a route of its own, as on KubeRay): every live
        replica's series, labelled as the gateway labels them."""
        return merge_expositions(labelled(await self.metrics_texts()))
