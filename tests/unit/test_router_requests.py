"""The router's pure parts: the challenger's effective weight (lease = dead man's switch) and request validation."""
from __future__ import annotations

import json

import pytest

from deployments.serve_app import CompletionRequest, Router, RouterConfig, ScoreRequest

NOW = 1_000_000.0
CFG = RouterConfig(model_name="m", champion="1", max_prompt_bytes=16, max_tokens_cap=32)


def _canary(**kw) -> RouterConfig:
    return RouterConfig(model_name="m", champion="1", challenger="2", challenger_percent=50, **kw)


def test_no_challenger_gets_no_traffic():
    assert RouterConfig(model_name="m", champion="1").effective_percent(NOW) == 0
    # a weight without a challenger to send it to is still nothing
    assert RouterConfig(model_name="m", champion="1", challenger_percent=50,
                        lease_expires_at=NOW + 60).effective_percent(NOW) == 0


def test_a_fresh_lease_gives_the_challenger_its_weight():
    assert _canary(lease_expires_at=NOW + 20).effective_percent(NOW) == 50
    assert _canary(lease_expires_at=NOW + 0.001).effective_percent(NOW) == 50


def test_a_lapsed_lease_sends_everything_to_the_champion():
    # the canary's driver died or hung: without renewal the router falls back by itself
    cfg = _canary(lease_expires_at=NOW + 20)
    assert cfg.effective_percent(NOW + 20) == 0
    assert cfg.effective_percent(NOW + 3600) == 0
    assert _canary().effective_percent(NOW) == 0  # a challenger without any lease never gets traffic


def _parse(endpoint: str, body: object, cfg: RouterConfig = CFG):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Router._parse(endpoint, raw, cfg)


@pytest.mark.parametrize("endpoint,body,status,message", [
    ("completions", b"{\"prompt\": ", 400, "body is not JSON: Expecting value at position 11"),
    ("score", b"text=hello", 400, "body is not JSON: Expecting value at position 0"),
    ("completions", [1, 2], 422, "body: Input should be a valid dictionary or instance of CompletionRequest"),
    ("completions", {}, 422, "prompt: Field required"),
    ("completions", {"prompt": 5}, 422, "prompt: Input should be a valid string"),
    ("completions", {"prompt": ""}, 422, "prompt: String should have at least 1 character"),
    ("completions", {"prompt": "ab", "max_tokens": "8"}, 422, "max_tokens: Input should be a valid integer"),
    ("completions", {"prompt": "ab", "max_tokens": True}, 422, "max_tokens: Input should be a valid integer"),
    ("completions", {"prompt": "ab", "max_tokens": 0}, 422, "max_tokens: Input should be greater than or equal to 1"),
    ("completions", {"prompt": "ab", "max_tokens": 33}, 422, "max_tokens: 33 > serve.max_tokens_cap=32"),
    ("completions", {"prompt": "ab", "temperature": 9}, 422, "temperature: Input should be less than or equal to 5"),
    ("completions", {"prompt": "ab", "seed": 1.5}, 422, "seed: Input should be a valid integer"),
    ("completions", {"prompt": "ab", "stream": True}, 422, "stream: Extra inputs are not permitted"),
    ("completions", {"prompt": "x" * 17}, 422, "prompt: 17 bytes > serve.max_prompt_bytes=16"),
    ("completions", {"prompt": "é" * 9}, 422, "prompt: 18 bytes > serve.max_prompt_bytes=16"),  # 9 chars, 18 bytes
    ("score", {"text": "€" * 6}, 422, "text: 18 bytes > serve.max_prompt_bytes=16"),
    ("score", {"text": "a"}, 422, "text: needs at least 2 bytes (the first byte is never predicted)"),
    ("score", {"text": ""}, 422, "text: String should have at least 1 character"),
    ("score", {"text": ["ab"]}, 422, "text: Input should be a valid string"),
    ("score", {"prompt": "ab"}, 422, "text: Field required"),
    ("score", {"text": "ab", "model": "2"}, 422, "model: Extra inputs are not permitted"),
])
def test_bad_requests_get_a_status_and_a_one_line_cause(endpoint, body, status, message):
    assert _parse(endpoint, body) == (status, message)
    assert "\n" not in message


def test_good_requests_become_request_objects():
    req = _parse("completions", {"prompt": "hello", "max_tokens": 32, "temperature": 0, "seed": 3})
    assert isinstance(req, CompletionRequest)
    assert (req.prompt, req.max_tokens, req.temperature, req.seed) == ("hello", 32, 0.0, 3)
    assert _parse("completions", {"prompt": "a"}) == CompletionRequest(prompt="a")  # a 1-byte prompt can be continued
    assert _parse("completions", {"prompt": "é" * 8}).prompt == "é" * 8  # exactly 16 bytes
    req = _parse("score", {"text": "é"})  # one character, two bytes: one byte is predicted
    assert isinstance(req, ScoreRequest) and req.text == "é"
    assert _parse("score", "{\"text\": \"\\u00e9\\u00e9\"}".encode()) == ScoreRequest(text="éé")


def test_limits_come_from_the_router_config():
    roomy = CFG.model_copy(update={"max_prompt_bytes": 4096, "max_tokens_cap": 256})
    assert isinstance(_parse("completions", {"prompt": "x" * 17, "max_tokens": 200}, roomy), CompletionRequest)


def test_deeply_nested_json_is_a_400():
    body = b"[" * 5000 + b"]" * 5000  # 10 KB, well under serve.max_request_bytes
    assert _parse("completions", body)[0] == 400


def test_a_seed_the_model_cannot_use_is_a_422():
    assert _parse("completions", {"prompt": "ab", "seed": 2**64})[0] == 422
