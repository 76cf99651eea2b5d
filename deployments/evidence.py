"""A model's canary evidence, kept where every router replica adds to it and a restarted router loses nothing.

One small Serve deployment (`evidence`, one replica) per model application: each router replica sends it the
observation of every request it routes during a canary (deployments/serve_app.Router._record), and the rollout
driver reads a step's observations back through any router replica. It also keeps each router replica's latest
Prometheus exposition, so that a scrape reaching one router replica carries them all
(deployments/router_metrics_share.py). The class is plain (no Ray at import).
Serve runs a deployment's sync methods in a thread pool, so every method holds the store's lock: a read iterating
the deque while a push appends to it would fail, and two pushes of one request id could both be kept.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable
from typing import Any

MAX_ITEMS = 50000  # far above any step's min_requests; bounds memory if nobody reads


def step_observations(
    items: Iterable[dict[str, Any]], canary_id: str, epoch: int, since: int = 0
) -> list[dict[str, Any]]:
    """The observations of step `epoch` of canary `canary_id` numbered >= since (what a driver's read returns)."""
    return [o for o in items if o["canary_id"] == canary_id and o["epoch"] == epoch and o["seq"] >= since]


class Evidence:
    """Observations of the current canary, numbered in arrival order across router replicas."""

    def __init__(self) -> None:
        self.replica_id = uuid.uuid4().hex
        self.items: deque[dict[str, Any]] = deque(maxlen=MAX_ITEMS)
        self.canary_id = ""
        self.seq = 0
        self.request_ids: set[str] = set()  # of the observations in `items`
        self.expositions: dict[str, tuple[float, int, str]] = {}  # router replica id -> (time kept, seq, /metrics text)
        self.lock = threading.Lock()

    def add(self, observation: dict[str, Any]) -> bool:
        """Keep `observation`; False (and not kept) when one of the same gateway request id is already here: the
        gateway resent a request whose router replica died after recording it, and one request is one observation."""
        with self.lock:
            if observation["canary_id"] != self.canary_id:  # another canary: the last one's is not evidence for it
                self.items.clear()
                self.request_ids.clear()
                self.canary_id = observation["canary_id"]
            request_id = observation.get("request_id") or ""
            if request_id in self.request_ids:
                return False
            if len(self.items) == self.items.maxlen:  # the oldest one falls out of the deque: its id goes too
                self.request_ids.discard(self.items[0].get("request_id") or "")
            self.items.append({**observation, "seq": self.seq})
            if request_id:
                self.request_ids.add(request_id)
            self.seq += 1
            return True

    def get(self, canary_id: str, epoch: int, since: int = 0) -> dict[str, Any]:
        """Observations of step `epoch` of canary `canary_id` numbered >= since, and the next number."""
        with self.lock:
            items = step_observations(self.items, canary_id, epoch, since)
            return {"replica_id": self.replica_id, "next": self.seq, "items": items}

    def routers(self) -> list[str]:
        """The router replicas that sent observations of the current canary."""
        with self.lock:
            return sorted({o["router_replica"] for o in self.items if "router_replica" in o})

    def put_metrics(self, router_replica: str, seq: int, text: str, max_age_s: float, answer: bool) -> dict[str, str]:
        """Keep a router replica's exposition unless a later one (higher seq) arrived first, so that what is kept
        of a replica only grows; drop those not sent for max_age_s. With `answer` (a scrape), every replica's kept,
        by replica id; without (a replica's periodic send), {}. deployments/router_metrics_share.py sends them."""
        with self.lock:
            now = time.monotonic()
            if seq > self.expositions.get(router_replica, (0.0, -1, ""))[1]:
                self.expositions[router_replica] = (now, seq, text)
            self.expositions = {r: e for r, e in self.expositions.items() if now - e[0] <= max_age_s}
            return {r: text for r, (_, _, text) in self.expositions.items()} if answer else {}
