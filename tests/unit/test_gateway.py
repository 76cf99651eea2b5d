"""Which failures of a model's router the gateway sends a request again for: only a replica that died after
accepting it (Serve resends what a dying replica never accepted). One that may still answer, or a router that
raised, is not resent: the request would run twice."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from deployments.gateway import _replica_gone
from deployments.openai_api import ApiError


def test_only_a_router_replica_that_died_is_sent_the_request_again():
    assert _replica_gone(ActorDiedError())
    assert not _replica_gone(ActorUnavailableError("unreachable for now", None))  # it may still answer
    raised = RayTaskError("respond", "Traceback ...", ActorDiedError()).as_instanceof_cause()
    assert isinstance(raised, ActorDiedError) and not _replica_gone(raised)  # the router raised what it called
    assert not _replica_gone(ValueError("a bad request"))


def test_a_request_routes_on_the_list_it_has_while_a_stale_one_is_re_read_beside_it(monkeypatch):
    """Re-reading the served models means RPCs to Serve and every router: a request on its way to a model uses the
    list the gateway has and one refresh runs in the background; listing models and an empty list wait for it."""
    import asyncio

    from deployments import gateway as gw_module
    from deployments.gateway import Gateway

    reads = []

    def router_apps(own: str) -> list[str]:  # what Serve's status says: no model application any more
        reads.append(own)
        return []

    monkeypatch.setattr(gw_module, "_router_apps", router_apps)

    async def scenario() -> None:
        gw = Gateway("shardline-gateway")
        gw.models = {"m": {"app": "shardline-m", "champion": "1", "created": 0.0}}  # read long ago: stale
        assert await gw._app_for("m") == "shardline-m"  # answered from the list it had
        first = gw._reloading
        assert first is not None and not first.done() and gw.models  # the refresh runs beside the request
        assert await gw._app_for("m") == "shardline-m" and gw._reloading is first  # one refresh at a time
        await first
        assert gw.models == {} and reads == ["shardline-gateway"]
        gw.models, gw.refreshed_at = {"m": {"app": "shardline-m", "champion": "1", "created": 0.0}}, 0.0
        await gw._refresh()  # /v1/models and /healthz wait for the list they show
        assert gw.models == {} and len(reads) == 2

    asyncio.run(scenario())


def test_when_serves_status_cannot_be_read_the_gateway_answers_from_its_last_list_or_a_503(monkeypatch):
    """Serve's controller restarting: the status read raised out of the gateway (a bare 500 from Serve) on
    /healthz, /v1/models, /metrics and a request naming a model it did not know."""
    import asyncio
    import json

    from starlette.requests import Request

    from deployments import gateway as gw_module
    from deployments.gateway import Gateway

    reads = []

    def router_apps(own: str) -> list[str]:
        reads.append(own)
        raise RuntimeError("the Serve controller is unavailable")

    monkeypatch.setattr(gw_module, "_router_apps", router_apps)

    def get(path: str) -> Request:
        return Request({"type": "http", "method": "GET", "path": path, "headers": [], "query_string": b""})

    async def scenario() -> None:
        gw = Gateway("shardline-gateway")
        refused = await gw(get("/v1/models"))  # nothing read yet: nothing to answer from
        error = json.loads(refused.body)["error"]
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert error["code"] == "serve_unavailable" and error["message"] == (
            "the served models could not be read from Ray Serve: RuntimeError: the Serve controller is unavailable"
        )
        gw.models = {"m": {"app": "shardline-m", "champion": "1", "created": 0.0}}  # read long ago: stale
        listed = await gw(get("/v1/models"))
        assert listed.status_code == 200 and [c["id"] for c in json.loads(listed.body)["data"]] == ["m"]
        assert len(reads) == 2 and (await gw(get("/v1/models"))).status_code == 200
        assert len(reads) == 2  # a failed re-read counts as one: the next waits REFRESH_S, not every request
        with pytest.raises(ApiError) as unknown:  # a model it does not know forces a re-read: it fails too
            await gw._app_for("typo")
        assert unknown.value.status == 404 and unknown.value.code == "model_not_found" and len(reads) == 3

    asyncio.run(scenario())


def test_past_its_queue_the_gateway_refuses_in_openai_s_error_object_and_counts_every_request_out():
    """The gateway holds FORWARDING + serve.max_queued_requests model requests; the next gets a 503 with Retry-After
    and OpenAI's error object. A request refused on its way in (here a body over the limit) is counted out again."""
    import asyncio
    import json

    from starlette.requests import Request

    from deployments.gateway import FORWARDING, Gateway

    gw = Gateway("shardline-gateway")
    gw.reconfigure({"max_queued_requests": 3, "max_request_bytes": 256})

    def post(body: bytes) -> Request:
        async def receive() -> dict:
            return {"type": "http.request", "body": body, "more_body": False}

        headers = [(b"content-length", str(len(body)).encode())]
        return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}, receive)

    too_big = asyncio.run(gw(post(b"x" * 300)))
    assert too_big.status_code == 413 and gw.waiting == 0
    gw.waiting = FORWARDING + 3  # as many as it holds wait on their routers
    refused = asyncio.run(gw(post(b'{"prompt": "hi"}')))
    error = json.loads(refused.body)["error"]
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert (error["type"], error["code"]) == ("server_error", "overloaded")
    assert "serve.max_queued_requests=3" in error["message"] and gw.waiting == FORWARDING + 3


def test_refusals_are_counted_by_endpoint_from_a_fixed_set_not_by_the_url_a_client_sent():
    """A label per raw path would make a series per URL a scanner tries, even before the token check. On
    /metrics they carry the gateway replica's label: a scrape reaches one of several."""
    import asyncio
    import time

    from starlette.requests import Request

    from deployments.gateway import Gateway
    from deployments.http_io import endpoint_of

    assert [endpoint_of(p) for p in ("/v1/chat/completions", "/x/v1/completions", "/v1/score", "/v1/models/m")] == [
        "chat",
        "completions",
        "score",
        "models",
    ]
    gw = Gateway("shardline-gateway")
    for n in range(5):
        asyncio.run(gw(Request({"type": "http", "method": "GET", "path": f"/probe-{n}", "headers": []})))
    asyncio.run(gw(Request({"type": "http", "method": "GET", "path": "/v1/chat/completions", "headers": []})))
    text = gw.metrics.exposition()[0].decode()
    refused = sorted(ln for ln in text.splitlines() if ln.startswith("shardline_rejected_requests_total{"))
    assert refused == [
        'shardline_rejected_requests_total{endpoint="chat",model="",status="405"} 1.0',
        'shardline_rejected_requests_total{endpoint="none",model="",status="404"} 5.0',
    ]
    gw.refreshed_at = time.monotonic()  # the model list (empty) is fresh: the scrape asks Serve for nothing
    scraped = asyncio.run(gw._metrics()).body.decode()
    assert f'endpoint="none",gateway_replica="{gw.replica}",model="",status="404"}} 5.0' in scraped


def test_a_wrong_method_gets_405_with_allow_and_echoed_paths_and_variants_are_quoted_short():
    import asyncio
    import json

    from starlette.requests import Request

    from deployments.gateway import Gateway
    from deployments.serve_app import Router

    def request(method: str, path: str, headers: list[tuple[bytes, bytes]] | None = None) -> Request:
        async def receive() -> dict:
            return {"type": "http.request", "body": b'{"prompt": "ab"}', "more_body": False}

        return Request({"type": "http", "method": method, "path": path, "headers": headers or []}, receive)

    gw = Gateway("shardline-gateway")
    for method, path, allow in (("GET", "/v1/completions", "POST"), ("POST", "/v1/models", "GET")):
        answer = asyncio.run(gw(request(method, path)))
        assert answer.status_code == 405 and answer.headers["allow"] == allow
        assert json.loads(answer.body)["error"]["message"] == f"{path} takes {allow}"
    long_path = "/" + "p" * 5000
    missing = json.loads(asyncio.run(gw(request("GET", long_path))).body)["error"]["message"]
    assert missing == f"no such endpoint: GET /{'p' * 96}..."
    router = Router("shardline-m", {})
    router.reconfigure({"model_name": "m", "champion": "1"})
    variant = [(b"x-shardline-variant", b"v" * 5000)]
    refused = asyncio.run(router(request("POST", "/v1/completions", variant)))
    assert refused.status_code == 400
    assert json.loads(refused.body)["error"]["message"] == (
        f"x-shardline-variant: '{'v' * 56}... is not champion or challenger"
    )


def test_concurrent_requests_for_an_unknown_model_share_re_reads_instead_of_queueing_one_each(monkeypatch):
    """Each request naming a model the gateway does not know forces a re-read (it may have been deployed a moment
    ago); those that queued on the lock behind a read that began after they asked take its answer: 8 concurrent
    requests for a mistyped name were 8 reads one after another, now 2 (the first, and one for all who asked during
    it). A later request still reads again."""
    import asyncio
    import time

    from deployments import gateway as gw_module
    from deployments.gateway import Gateway

    reads = []

    def router_apps(own: str) -> list[str]:
        reads.append(own)
        time.sleep(0.05)  # Serve's status read takes a while; requests pile up behind it
        return []

    monkeypatch.setattr(gw_module, "_router_apps", router_apps)

    async def scenario() -> None:
        gw = Gateway("shardline-gateway")
        gw.models = {"m": {"app": "shardline-m", "champion": "1", "created": 0.0}}
        answers = await asyncio.gather(*(gw._app_for("typo") for _ in range(8)), return_exceptions=True)
        assert all(isinstance(a, ApiError) and a.code == "model_not_found" for a in answers)
        assert len(reads) == 2
        with pytest.raises(ApiError):
            await gw._app_for("typo")
        assert len(reads) == 3

    asyncio.run(scenario())


def test_a_head_health_check_is_answered_like_a_get_even_with_a_token_set(monkeypatch):
    """Load balancers often check health with HEAD: it was a 401 (token required) or a 404 at the gateway and a 404
    at a router that is the ingress; it gets GET's status and headers (the HTTP server drops the body)."""
    import asyncio
    import hashlib

    from starlette.requests import Request

    from deployments import gateway as gw_module
    from deployments.gateway import Gateway
    from deployments.serve_app import Router

    monkeypatch.setattr(gw_module, "_router_apps", lambda own: [])

    def head(path: str) -> Request:
        return Request({"type": "http", "method": "HEAD", "path": path, "headers": [], "query_string": b""})

    gw = Gateway("shardline-gateway")
    gw.reconfigure({"token_sha256": hashlib.sha256(b"secret-token").hexdigest()})
    assert asyncio.run(gw(head("/healthz"))).status_code == 200
    assert asyncio.run(gw(head("/metrics"))).status_code == 200
    assert asyncio.run(gw(head("/v1/models"))).status_code == 401  # the API itself still asks for the token
    router = Router("shardline-m", {})
    router.reconfigure({"model_name": "m", "champion": "1"})
    answer = asyncio.run(router(head("/healthz")))
    assert answer.status_code == 200 and answer.headers["x-shardline-model-version"] == "1"
    assert asyncio.run(router(head("/metrics"))).status_code == 200
