"""The live endpoint for real: logged pt2 models, the MLflow registry, Ray Serve over HTTP, loopback load.

One registry and one Ray session tell one story in file order: v1 (weak) is served; bad input never reaches a
model; v2 (good) is released into live traffic with zero failed requests; slow (v3), erroring (v4) and worse (v5)
challengers are each rolled back; a restarted router keeps its weights; a canary whose driver died stops getting
traffic when its lease runs out, and the next reconcile removes it.
"""

from __future__ import annotations

import time

import httpx
import pytest
from support.load import Load
from support.serve_support import NAME, bigram_logits, corpus, heldout_bpb, log_model, register, serving_world

from deployments import endpoint, serve_build
from deployments.config import CanaryConfig, ServeConfig
from deployments.registry import TAG_CANARY_DECISION, TAG_REJECTED, read_aliases
from deployments.rollout import run_rollout
from deployments.router_config import ROUTER

pytestmark = [pytest.mark.slow, pytest.mark.scenario]  # tests build on each other: see support/scenarios.py


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    fit, _ = corpus()
    good = bigram_logits(fit, smoothing=0.05)
    tables = {"weak": bigram_logits(fit, smoothing=50.0), "good": good, "bad": -good}
    with serving_world(tmp_path_factory.mktemp("home"), "endpoint-it", tables) as world:
        yield world


def _metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_the_endpoint_serves_the_champion_and_refuses_bad_input(world):
    done = endpoint.reconcile(world["serve"], NAME, world["uri"])
    url = done.url
    assert done.champion == "1" and url.startswith("http://127.0.0.1:")
    with httpx.Client(timeout=60) as http:
        r = http.post(f"{url}/v1/completions", json={"prompt": "import os\n", "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200 and r.json()["model_version"] == "1"
        assert r.headers["x-shardline-model-version"] == "1"
        answer = r.json()
        assert answer["object"] == "text_completion" and answer["model"] == NAME
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"] == {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22}
        assert len(answer["choices"][0]["text"].encode("utf-8", "surrogatepass")) >= 1
        # greedy decoding is deterministic
        again = http.post(
            f"{url}/v1/completions", json={"prompt": "import os\n", "max_tokens": 12, "temperature": 0}
        ).json()
        assert again["choices"][0]["text"] == answer["choices"][0]["text"]
        assert http.get(f"{url}/v1/models").json()["data"][0] | {"created": 0} == {
            "id": NAME,
            "object": "model",
            "created": 0,
            "owned_by": "shardline",
            "champion_version": "1",
        }
        text = world["texts"][0]
        s = http.post(f"{url}/v1/score", json={"text": text})
        assert s.status_code == 200 and s.headers["x-shardline-model-version"] == "1"
        # the endpoint's bits per byte are the model's real bits per byte on that text (same windowing rule)
        assert s.json()["bits_per_byte"] == pytest.approx(
            heldout_bpb(world["tables"]["weak"], [text.encode()]), rel=2e-3
        )
        calls_before = _metric(url, "shardline_model_calls_total")
        limit = world["serve"].max_request_bytes
        bad = [
            (413, {"content": b"x" * (limit + 1)}, "score"),
            (400, {"content": b"{not json"}, "score"),
            (400, {"json": {"text": 42}}, "score"),
            (400, {"json": {"text": "x"}}, "score"),
            (400, {"json": {"text": "ok", "extra": 1}}, "score"),
            (400, {"json": {"prompt": ""}}, "completions"),
            (400, {"json": {"prompt": "hi", "max_tokens": 10_000}}, "completions"),
            (400, {"json": {"prompt": "hi", "max_tokens": "3"}}, "completions"),
            (400, {"json": {"prompt": "é" * 3000}}, "completions"),
            (400, {"json": {"prompt": "hi", "n": 3}}, "completions"),
            (404, {"json": {"prompt": "hi", "model": "no-such-model"}}, "completions"),
        ]
        for status, kwargs, path in bad:
            r = http.post(f"{url}/v1/{path}", headers={"content-type": "application/json"}, **kwargs)
            assert r.status_code == status, (kwargs, r.text)
            error = r.json()["error"]  # OpenAI's error object
            assert list(r.json()) == ["error"] and set(error) == {"message", "type", "param", "code"}
            assert "\n" not in error["message"]
        assert http.get(f"{url}/v1/score").status_code == 405
        assert http.get(f"{url}/healthz").json()["champion"] == "1"
    assert _metric(url, "shardline_model_calls_total") == calls_before  # nothing reached a model
    assert _metric(url, "shardline_rejected_requests_total") >= len(bad)


def test_a_bearer_token_guards_the_api(world):
    import hashlib

    url = endpoint.reconcile(world["serve"], NAME, world["uri"], hashlib.sha256(b"s3cret").hexdigest()).url
    try:
        with httpx.Client(timeout=60) as http:
            assert http.post(f"{url}/v1/score", json={"text": "ab"}).status_code == 401
            assert (
                http.post(f"{url}/v1/score", json={"text": "ab"}, headers={"authorization": "Bearer wrong"}).status_code
                == 401
            )
            assert (
                http.post(
                    f"{url}/v1/score", json={"text": "ab"}, headers={"authorization": "Bearer s3cret"}
                ).status_code
                == 200
            )
            assert http.get(f"{url}/healthz").status_code == 200
    finally:
        endpoint.reconcile(world["serve"], NAME, world["uri"])


def _describe(version: str) -> dict:
    from ray import serve

    return (
        serve.get_deployment_handle(f"v{version}", serve_build.app_name_for(ServeConfig(), NAME))
        .describe.remote()
        .result(timeout_s=30)
    )


CFG = CanaryConfig(
    steps=[10, 50, 100],
    min_requests=6,
    bake_seconds=2.0,
    step_timeout_s=90,
    probe_rps=6.0,
    min_paired=5,
    seed=3,
    lease_s=15.0,
    latency_floor_ms=25.0,
)  # this box is shared: hiccups


def test_a_better_challenger_is_released_into_live_traffic_with_zero_failures(world):
    client = world["client"]
    promoted = register(client, *log_model(world["tables"]["good"], "good", world["exp"], client))
    assert (promoted.version, promoted.champion_version) == ("2", "1")
    url = endpoint.reconcile(world["serve"], NAME, world["uri"]).url
    champion_pid = _describe("1")["pid"]
    steps_seen, decisions, variant_seen = [], [], []

    def on_step(i, s):
        steps_seen.append((s.percent, _describe("1")["pid"]))
        if i == 0:  # the router that counted the warm-up is still the one answering (lightweight updates only)
            variant_seen.append(
                {
                    e: _metric(url, "shardline_requests_total", version="2", source="variant", endpoint=e)
                    for e in ("score", "completions")
                }
            )

    with Load(url, world["texts"], rps=6.0, max_seconds=400) as load:
        time.sleep(1.0)
        result = run_rollout(
            CFG,
            world["serve"],
            NAME,
            "1",
            "2",
            world["uri"],
            world["heldout"],
            on_step=on_step,
            log_decision=decisions.append,
        )
        time.sleep(1.5)  # a few requests after the promotion
    print(result.model_dump_json(indent=1))
    assert result.decision == "promoted", result.reason
    assert result.champion_version == "2" and read_aliases(client, NAME)["champion"] == "2"
    assert client.get_model_version(NAME, "2").tags[TAG_CANARY_DECISION] == "promoted"
    assert [s["percent"] for s in result.steps] == [10, 50, 100]
    # the challenger was warmed up before the first step, on both endpoints, and not one warm-up call was evidence
    warmup = decisions[0].warmup
    print(
        "warm-up ms",
        warmup.latency_ms,
        "first step's paired challenger ms",
        decisions[0].metrics[0].challenger_paired_ms,
    )
    assert (warmup.requests, warmup.failed, len(warmup.latency_ms)) == (CFG.warmup_requests, 0, CFG.warmup_requests)
    assert variant_seen == [{"score": CFG.warmup_requests / 2, "completions": CFG.warmup_requests / 2}]
    # no ramp step restarted the champion's replica (lightweight updates only)
    assert [pid for _, pid in steps_seen] == [champion_pid] * 3
    for step in result.steps:
        assert step["challenger"]["n"] >= CFG.min_requests and step["paired"] >= CFG.min_paired
        assert step["probe_requests"] > 0 and step["requests"] > step["probe_requests"]  # live traffic counted too
    last = result.steps[-1]
    assert last["challenger"]["bpb"] < last["champion"]["bpb"] - 0.3
    assert last["bpb_regression_upper"] < 0
    # zero failed requests; served versions move 1 -> 2 and end at 2
    assert load.answers and not load.failed, load.failed[:5]
    versions = [a.version for a in load.answers]
    assert versions[0] == "1" and versions[-1] == "2"
    first_two = versions.index("2")
    assert set(versions[:first_two]) == {"1"}
    assert all(v == "2" for v in versions[-3:])
    assert endpoint.served_versions(serve_build.app_name_for(world["serve"], NAME)) == ["2"]
    assert httpx.get(f"{url}/healthz", timeout=30).json()["champion"] == "2"


@pytest.mark.parametrize(
    "kind, behaviour, table, gate",
    [
        ("slow", "slow", "good", "latency"),
        ("erroring", "erroring", "good", "error rate"),
        ("worse", "plain", "bad", "bits/byte"),
    ],
)
def test_a_bad_challenger_is_rolled_back_with_zero_failed_requests(world, kind, behaviour, table, gate):
    client = world["client"]
    promoted = register(client, *log_model(world["tables"][table], kind, world["exp"], client, behaviour))
    champion = read_aliases(client, NAME)["champion"]
    assert promoted.champion_version == champion == "2"
    url = endpoint.reconcile(world["serve"], NAME, world["uri"]).url
    cfg = CFG.model_copy(update={"steps": [50, 100]})
    with Load(url, world["texts"], rps=6.0, max_seconds=300) as load:
        result = run_rollout(cfg, world["serve"], NAME, champion, promoted.version, world["uri"], world["heldout"])
        time.sleep(1.0)
    print(kind, result.reason)
    assert result.decision == "rejected" and gate in result.reason, result.reason
    if kind == "erroring":  # ended as soon as its errors failed the gate, not by canary.step_timeout_s
        assert len(result.steps) == 1 and result.steps[0]["challenger"]["n"] >= cfg.min_requests
        assert not any("step_timeout_s" in why for why in result.steps[0]["inconclusive"])
    assert read_aliases(client, NAME)["champion"] == "2" and result.champion_version == "2"
    assert client.get_model_version(NAME, promoted.version).tags[TAG_REJECTED] == result.reason
    assert not load.failed, load.failed[:5]  # the champion answered whatever the challenger failed
    after = [a.version for a in load.answers if a.t > time.time() - 0.9]
    assert set(after) <= {"2"}
    assert endpoint.served_versions(serve_build.app_name_for(world["serve"], NAME)) == ["2"]
    assert result.final_challenger_percent == 0


def _router_actor():
    import ray

    names = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "router" in a["name"] and serve_build.app_name_for(ServeConfig(), NAME) in a["name"]
    ]
    assert len(names) == 1, names
    return ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])


def test_a_restarted_router_keeps_its_weights_and_the_lease_switch_works(world):
    """Kill the router replica mid-canary, under load: the requests it held are sent again by the gateway, and
    every request is answered; the new replica reads the weights back. Then let the lease lapse."""
    import ray

    client = world["client"]
    promoted = register(client, *log_model(world["tables"]["good"], "again", world["exp"], client))
    serve = world["serve"]
    app = serve_build.app_name_for(serve, NAME)
    endpoint.reconcile(serve, NAME, world["uri"])
    lease = time.time() + 45
    router = serve_build.router_config(
        serve,
        NAME,
        "2",
        challenger=promoted.version,
        challenger_percent=100,
        epoch=7,
        lease_expires_at=lease,
        canary_id="restart-test",
    )
    endpoint.apply(
        serve_build.AppSpec(app_name=app, tracking_uri=world["uri"], versions=["2", promoted.version], router=router),
        serve,
    )
    before = endpoint.read_state(app)
    url = endpoint.endpoint_url(serve)
    # four clients back to back: requests are in the router when it dies (bounded: 60 s, 400 requests each)
    texts = ["import sys\n", "def main():\n    return 0\n", "class A:\n    pass\n", "for i in range(3):\n"]
    loads = [Load(url, texts[i:] + texts[:i], rps=50.0, max_requests=400, max_seconds=60) for i in range(4)]
    for load in loads:
        load.__enter__()
    try:
        time.sleep(1.0)
        ray.kill(_router_actor(), no_restart=False)
        deadline = time.monotonic() + 120
        while True:
            state = endpoint.read_state(app)
            if state is not None and state["replica_id"] != before["replica_id"]:
                break
            assert time.monotonic() < deadline, "the router replica did not come back"
            time.sleep(0.5)
        time.sleep(1.0)
    finally:
        for load in loads:
            load.__exit__(None, None, None)
    answers = [a for load in loads for a in load.answers]
    assert len(answers) >= 8 and [a for a in answers if a.status != 200] == []  # 500s before the gateway resent
    # the evidence counts each request once, by the id the gateway gave it (a resent request keeps its id); a
    # request the dying replica had recorded but not yet sent to the Evidence deployment is lost (one per client)
    from ray import serve as rs

    handle = rs.get_deployment_handle(ROUTER, app)
    time.sleep(1.0)
    ids = [o["request_id"] for o in handle.get_observations.remote("restart-test", 7).result()["items"]]
    assert "" not in ids and len(ids) == len(set(ids))
    assert len(answers) - 2 * len(loads) <= len(ids) <= len(answers)
    assert state["config"]["challenger_percent"] == 100 and state["config"]["epoch"] == 7
    with httpx.Client(timeout=60) as http:
        assert {
            http.post(f"{url}/v1/score", json={"text": "abcdef"}).headers["x-shardline-model-version"] for _ in range(4)
        } == {promoted.version}
        # the dead man's switch: nobody renews the lease, the router sends everything to the champion by itself
        while time.time() < lease + 0.5:
            time.sleep(0.5)
        assert {
            http.post(f"{url}/v1/score", json={"text": "abcdef"}).headers["x-shardline-model-version"] for _ in range(4)
        } == {"2"}
    done = endpoint.reconcile(serve, NAME, world["uri"])  # the next run or `shardline serve` removes the orphan
    assert done.removed == [promoted.version]
    assert endpoint.served_versions(app) == ["2"]
    assert read_aliases(client, NAME)["champion"] == "2"  # the registry never changed without a decision
