"""The canary's evidence counts each request once. The gateway gives every request an id and resends a request
whose router replica died before answering; when that replica had already recorded it, the resend is recorded
again by another router replica, under the same id, and the Evidence deployment keeps only the first."""

from __future__ import annotations

import json
import threading
import time
from collections import deque

import pytest

from deployments.evidence import Evidence
from deployments.router_config import REQUEST_ID_HEADER, RouterConfig
from deployments.serve_app import Router


def _ob(request_id: str, canary: str = "c1", epoch: int = 0) -> dict:
    return {"canary_id": canary, "epoch": epoch, "request_id": request_id, "router_replica": "r"}


def test_a_resent_request_is_one_observation():
    ev = Evidence()
    assert ev.add(_ob("a")) and ev.add(_ob("b"))
    assert not ev.add(_ob("a"))  # the resend, recorded by the replacement router replica
    got = ev.get("c1", 0)
    assert [o["request_id"] for o in got["items"]] == ["a", "b"] and got["next"] == 2
    # requests that did not come through the gateway carry no id: each is its own observation
    assert ev.add(_ob("")) and ev.add(_ob(""))
    assert len(ev.get("c1", 0)["items"]) == 4


def test_ids_are_forgotten_with_their_canary_and_with_their_observation():
    ev = Evidence()
    ev.add(_ob("a"))
    assert ev.add(_ob("a", canary="c2"))  # another canary: the last one's observations and ids are gone
    assert [o["canary_id"] for o in ev.get("c2", 0)["items"]] == ["c2"] and ev.get("c1", 0)["items"] == []
    ev.items = deque(ev.items, maxlen=2)  # a bounded store: the oldest observation falls out, and its id with it
    ev.add(_ob("b", canary="c2"))
    ev.add(_ob("c", canary="c2"))
    assert ev.request_ids == {"b", "c"}
    assert ev.add(_ob("a", canary="c2"))


@pytest.mark.parametrize("round_", range(4))  # a race shows in some rounds only: four give it more chances
def test_concurrent_pushes_and_reads_keep_one_observation_per_request(round_):
    """Serve runs the deployment's sync methods in a thread pool: pushes of the same requests from several router
    replicas and the driver's reads run at once, and each request is still one observation."""
    ev, errors, n = Evidence(), [], 10000
    pushers = [threading.Thread(target=lambda: [ev.add(_ob(f"id-{i}")) for i in range(n)]) for _ in range(3)]

    def read() -> None:
        try:
            while any(t.is_alive() for t in pushers):
                ev.get("c1", 0)
                ev.routers()
                time.sleep(0.001)  # pushes go on between reads
        except RuntimeError as e:  # "deque mutated during iteration" without the lock
            errors.append(e)

    reader = threading.Thread(target=read)
    for t in [*pushers, reader]:
        t.start()
    for t in [*pushers, reader]:
        t.join()
    assert errors == []
    got = ev.get("c1", 0)["items"]
    assert len(got) == n and len({o["request_id"] for o in got}) == n and ev.seq == n


def test_the_router_records_the_gateways_request_id():
    router = Router("shardline-m", {})
    router.reconfigure(RouterConfig(model_name="m", champion="1").model_dump())
    body = json.dumps({"text": "hello"}).encode()
    job = router._prepare("POST", "/v1/score", {REQUEST_ID_HEADER: "f" * 80}, body)
    assert job.request_id == "f" * 64  # bounded: a header is the client's until the gateway replaces it
    served = {"version": "1", "ok": True, "bits": 8.0, "bytes": 5, "latency_ms": 1.0}
    router._record(job, False, served, None, None, 2.0)
    assert router.observations[-1]["request_id"] == "f" * 64
    assert router._prepare("POST", "/v1/score", {}, body).request_id == ""


def test_router_replicas_expositions_are_kept_latest_first_until_they_go_quiet():
    """Each router replica's latest /metrics text, by replica: a send that arrives after a later one of the same
    replica is not kept (what a scrape reads of a replica only grows); one not heard from for max_age_s drops out."""
    ev = Evidence()
    assert ev.put_metrics("r1", 1, "one", 60.0, True) == {"r1": "one"}
    assert ev.put_metrics("r2", 1, "two", 60.0, False) == {}  # a periodic send: nobody reads the answer
    assert ev.put_metrics("r1", 3, "one, later", 60.0, True) == {"r1": "one, later", "r2": "two"}
    assert ev.put_metrics("r1", 2, "one, sent between", 60.0, True)["r1"] == "one, later"  # arrived late: not kept
    t, seq, text = ev.expositions["r2"]
    ev.expositions["r2"] = (t - 61.0, seq, text)  # r2 stopped sending a minute ago
    assert ev.put_metrics("r1", 4, "one, latest", 60.0, True) == {"r1": "one, latest"} and "r2" not in ev.expositions


def test_a_routers_own_metrics_route_labels_its_series_by_replica():
    """GET /metrics on a router's own route (a KubeRay application, no gateway) answers the same series the gateway
    merges, under this replica's router_replica label; without an Evidence deployment, this replica's alone."""
    import asyncio

    from prometheus_client.parser import text_string_to_metric_families
    from starlette.requests import Request

    from deployments.router_metrics_share import replica_label

    router = Router("shardline-m", {}, model_name="m")
    router.metrics.request("1", "score", "live", ok=True)
    request = Request({"type": "http", "method": "GET", "path": "/metrics/", "headers": [], "query_string": b""})
    response = asyncio.run(router(request))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = [
        s
        for fam in text_string_to_metric_families(response.body.decode())
        for s in fam.samples
        if s.name == "shardline_requests_total" and s.labels["outcome"] == "ok"
    ]
    assert [(s.labels["router_replica"], s.value) for s in samples] == [(replica_label(router.replica_id), 1.0)]


def test_in_shadow_mode_a_request_the_champion_failed_leaves_the_step_inconclusive_not_the_challenger_rejected():
    """The router mirrors a copy of each request to the challenger; the champion answers the client. A request the
    champion failed was recorded as routed to the challenger: the step failed with "routed to the challenger got no
    model answer" and the version was rejected for good, though its mirror answered."""
    from deployments.config import CanaryConfig
    from deployments.rollout_gates import summarize_step

    router = Router("shardline-m", {})
    router.reconfigure(RouterConfig(model_name="m", champion="1", challenger="2", canary_id="k").model_dump())
    job = router._prepare("POST", "/v1/score", {}, json.dumps({"text": "hello"}).encode())

    def call(version: str, ok: bool = True) -> dict:
        if not ok:
            return {"version": version, "ok": False, "error": "RuntimeError: the champion's replica died"}
        return {"version": version, "ok": True, "bits": 200.0, "bytes": 100, "latency_ms": 10.0}

    for _ in range(20):
        router._record(job, True, call("1"), call("1"), None, 12.0, mirror=call("2"))
    router._record(job, True, call("1", ok=False), call("1"), None, 12.0, mirror=call("2"))
    assert router.observations[-1]["role"] == "champion" and not router.observations[-1]["client_ok"]
    step = summarize_step(10, list(router.observations), "1", "2", CanaryConfig(mode="shadow", min_requests=20))
    assert step.challenger.errors == 0 and not step.failures
    assert any("the champion alone answered" in why for why in step.inconclusive), step.inconclusive
