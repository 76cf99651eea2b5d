"""Requests routed by model behind one gateway, the gateway's own settings, and an address shardline cannot
host (a route prefix held by an application shardline did not start, or a port held by a process that is not Ray
Serve), refused before anything else happens."""

from __future__ import annotations

import http.server
import json
import subprocess
import threading

import httpx
import openai
import pytest

from deployments import endpoint
from deployments.config import ServeConfig
from deployments.gateway_control import EndpointConflict, check_endpoint_free, prefix_holder
from deployments.registry import read_aliases
from infra.cluster import free_port

from . import MODELS

pytestmark = pytest.mark.slow


def test_two_models_answer_by_model_behind_one_route(world):
    serve = world["serve"]
    urls = {endpoint.reconcile(serve, name, world["uri"]).url for name in MODELS}
    assert len(urls) == 1
    url = urls.pop()
    champions = {name: read_aliases(world["client"], name)["champion"] for name in MODELS}  # v1 if run first
    with httpx.Client(timeout=60) as http:
        listed = http.get(f"{url}/v1/models").json()
        assert {m["id"]: m["champion_version"] for m in listed["data"]} == champions
        assert [m["id"] for m in listed["data"]] == list(MODELS)
        for name in MODELS:
            r = http.post(f"{url}/v1/completions", json={"model": name, "prompt": "def f():", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["model"] == name
            s = http.post(f"{url}/v1/score", json={"model": name, "text": "import sys"})
            assert s.status_code == 200 and s.json()["model"] == name
        # no model named and two served: a 400 that lists them; an unknown one: OpenAI's model_not_found
        r = http.post(f"{url}/v1/score", json={"text": "import sys"})
        assert r.status_code == 400 and MODELS[0] in r.json()["error"]["message"]
        r = http.post(f"{url}/v1/score", json={"model": "gamma", "text": "import sys"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert http.get(f"{url}/healthz").json()["models"] == champions
        assert http.get(f"{url}/healthz", params={"model": MODELS[1]}).json()["champion"] == champions[MODELS[1]]
    # the official client, streaming included
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    done = client.completions.create(model=MODELS[0], prompt="import os", max_tokens=6, temperature=0)
    assert done.model == MODELS[0] and (done.usage.prompt_tokens, done.usage.completion_tokens) == (9, 6)  # bytes
    assert done.choices[0].finish_reason == "length"
    # what a client leaves unset it may send as null (OpenAI's parameters are nullable): the defaults answer
    nulls = client.completions.create(
        model=MODELS[0], prompt="import os", max_tokens=6, temperature=0, top_p=None, seed=None, stop=None, n=None
    )
    assert nulls.choices[0].text == done.choices[0].text
    # logprobs through the router, whole and streamed: one entry per token of the answer, at the same offsets
    scored = client.completions.create(
        model=MODELS[0], prompt="import os", max_tokens=6, temperature=0, logprobs=1, echo=True
    )
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == "import os" + done.choices[0].text and len(lp.tokens) == 9 + 6
    assert lp.text_offset == list(range(15)) and lp.token_logprobs[0] is None  # ASCII bytes: one character each
    chunks = list(
        client.completions.create(
            model=MODELS[0], prompt="import os", max_tokens=6, temperature=0, logprobs=1, echo=True, stream=True
        )
    )
    pieces = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]  # the last chunk has no text
    assert [o for p in pieces for o in p.text_offset] == lp.text_offset
    card = client.models.retrieve(MODELS[1])
    assert (card.id, card.object, card.owned_by) == (MODELS[1], "model", "shardline")
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        client.models.retrieve("gamma")
    pieces = list(
        client.completions.create(
            model=MODELS[0],
            prompt="import os",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(p.choices[0].text for p in pieces if p.choices) == done.choices[0].text
    assert (pieces[-1].usage.prompt_tokens, pieces[-1].usage.completion_tokens) == (9, 6) and not pieces[-1].choices
    # and with `curl -N` (no buffering), as the README shows it: server-sent events, one chunk per token, then [DONE]
    body = {"model": MODELS[0], "prompt": "import os", "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    curl = subprocess.run(
        ["curl", "-sS", "-N", "--max-time", "60", "-H", "Content-Type: application/json", "-d", json.dumps(body),
         f"{url}/v1/completions"],
        capture_output=True, text=True, timeout=90, check=True,
    )  # fmt: skip
    events = [line.removeprefix("data: ") for line in curl.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", curl.stdout
    *chunks, totals = [json.loads(e) for e in events[:-1]]
    # as OpenAI's: every chunk has "usage": null, and one more chunk, without choices, has the totals
    assert all("usage" in c and c["usage"] is None for c in chunks), curl.stdout
    assert totals["choices"] == [] and totals["usage"]["completion_tokens"] == 6, curl.stdout
    assert len(chunks) >= 3 and {c["object"] for c in chunks} == {"text_completion"}, curl.stdout  # pieces, not one
    assert "".join(c["choices"][0]["text"] for c in chunks) == done.choices[0].text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    with pytest.raises(openai.BadRequestError, match="n: only 1 is supported"):
        client.completions.create(model=MODELS[0], prompt="x", n=2)
    with pytest.raises(openai.BadRequestError, match="has no chat template"):
        client.chat.completions.create(model=MODELS[0], messages=[{"role": "user", "content": "hi"}])
    # with serve.chat_template, the chat API answers what a completion of the rendered prompt answers
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    endpoint.reconcile(serve.model_copy(update={"chat_template": template}), MODELS[0], world["uri"])
    messages = [{"role": "system", "content": "python"}, {"role": "user", "content": "import"}]
    chat = client.chat.completions.create(model=MODELS[0], messages=messages, max_tokens=6, temperature=0)
    rendered = "system: python\nuser: import\nassistant:"
    plain = client.completions.create(model=MODELS[0], prompt=rendered, max_tokens=6, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text and chat.choices[0].finish_reason == "length"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(rendered), 6)  # the rendered bytes
    parts = list(
        client.chat.completions.create(
            model=MODELS[0],
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == chat.choices[0].message.content
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "length"
    assert parts[-1].usage.completion_tokens == 6 and not parts[-1].choices
    with pytest.raises(openai.BadRequestError, match="logprobs: only False is supported"):
        client.chat.completions.create(model=MODELS[0], messages=messages, logprobs=True)
    # a default model takes requests that name none
    with_default = serve.model_copy(update={"default_model": MODELS[1]})
    endpoint.reconcile(with_default, MODELS[1], world["uri"])
    r = httpx.post(f"{url}/v1/score", json={"text": "import sys"}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == MODELS[1]


def test_a_changed_gateway_setting_alone_redeploys_the_gateway(world):
    """serve.gateway_replicas (or the queue, or the CPUs) changed with nothing else: the gateway follows."""
    import time

    from ray import serve as rs

    from deployments.gateway_control import gateway_name

    def running(serve: ServeConfig) -> int:
        status = rs.status().applications[gateway_name(serve)].deployments["gateway"]
        return int(status.replica_states.get("RUNNING", 0))

    def settle(serve: ServeConfig, want: int) -> int:
        url = endpoint.reconcile(serve, MODELS[0], world["uri"]).url
        deadline = time.monotonic() + 120
        while running(serve) != want and time.monotonic() < deadline:
            time.sleep(0.5)
        r = httpx.post(f"{url}/v1/score", json={"model": MODELS[0], "text": "import sys"}, timeout=60)
        assert r.status_code == 200, r.text
        return running(serve)

    serve = world["serve"]
    assert settle(serve, 1) == 1
    try:
        assert settle(serve.model_copy(update={"gateway_replicas": 2}), 2) == 2
    finally:
        assert settle(serve, 1) == 1


def test_an_address_shardline_cannot_host_is_refused_in_one_line(world):
    from ray import serve as rs

    serve = world["serve"]
    endpoint.start_proxy(serve)  # Serve's proxy on this test's port (also when this test runs alone)
    check_endpoint_free(serve)  # nothing or shardline's own gateway holds it: fine
    # a route prefix held by an application shardline did not start
    foreign = serve.model_copy(update={"route_prefix": "/theirs"})

    @rs.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0.1})
    class Theirs:
        async def __call__(self, request):
            return "not shardline"

    rs.run(Theirs.bind(), name="their-app", route_prefix="/theirs")
    try:
        for check in (check_endpoint_free, prefix_holder):
            with pytest.raises(EndpointConflict) as e:
                check(foreign)
            assert "'their-app'" in str(e.value) and "\n" not in str(e.value)
    finally:
        rs.delete("their-app", _blocking=True)
    # a port held by a process that is not Ray Serve
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(EndpointConflict, match=f"serve.port={server.server_port}: .* not Ray Serve"):
            check_endpoint_free(ServeConfig(port=server.server_port))
    finally:
        server.shutdown()
    check_endpoint_free(ServeConfig(port=free_port()))  # nothing listens: Serve will bind it
