"""The router's pure parts: the challenger's effective weight (lease = dead man's switch) and request validation
against the OpenAI completions protocol (every refusal a 400 with OpenAI's error object naming the parameter)."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest

from deployments.openai_api import ApiError, CompletionRequest, ScoreRequest, parse_json, shown, validate
from deployments.router_config import RouterConfig
from deployments.serve_app import Router

NOW = 1_000_000.0
CFG = RouterConfig(model_name="m", champion="1", max_prompt_bytes=16, max_tokens_cap=32)


def _canary(**kw) -> RouterConfig:
    return RouterConfig(model_name="m", champion="1", challenger="2", challenger_percent=50, **kw)


def test_no_challenger_gets_no_traffic():
    assert RouterConfig(model_name="m", champion="1").effective_percent(NOW) == 0
    # a weight without a challenger to send it to is still nothing
    assert (
        RouterConfig(model_name="m", champion="1", challenger_percent=50, lease_expires_at=NOW + 60).effective_percent(
            NOW
        )
        == 0
    )


def test_a_fresh_lease_gives_the_challenger_its_weight():
    assert _canary(lease_expires_at=NOW + 20).effective_percent(NOW) == 50
    assert _canary(lease_expires_at=NOW + 0.001).effective_percent(NOW) == 50


def test_a_lapsed_lease_sends_everything_to_the_champion():
    # the canary's driver died or hung: without renewal the router falls back by itself
    cfg = _canary(lease_expires_at=NOW + 20)
    assert cfg.effective_percent(NOW + 20) == 0
    assert cfg.effective_percent(NOW + 3600) == 0
    assert _canary().effective_percent(NOW) == 0  # a challenger without any lease never gets traffic


def test_a_driver_clock_ahead_of_the_replica_cannot_stretch_the_lease():
    # the driver's clock is an hour ahead: its epoch deadline alone would hold the challenger's weight for an hour
    cfg = _canary(lease_expires_at=NOW + 3600, lease_s=20)
    assert cfg.effective_percent(NOW, held_s=19.9) == 50
    assert cfg.effective_percent(NOW, held_s=20) == 0  # 20 s after this replica got it, by its own clock
    # the epoch deadline still ends it first when the driver's clock is behind
    assert _canary(lease_expires_at=NOW + 5, lease_s=20).effective_percent(NOW + 5, held_s=1) == 0


def test_the_router_times_the_lease_from_its_last_renewal():
    router = Router("shardline-m", {})
    lease = {"model_name": "m", "champion": "1", "challenger": "2", "challenger_percent": 50, "lease_s": 20.0}
    router.reconfigure(lease | {"lease_expires_at": NOW + 3600})
    assert router.percent_now(router.cfg) == 0  # NOW is long past: the epoch deadline (time.time() is today)
    far = time.time() + 3600
    router.reconfigure(lease | {"lease_expires_at": far})
    assert router.percent_now(router.cfg) == 50
    router.lease_at -= 21  # 21 s without a renewal on this replica's clock
    assert router.percent_now(router.cfg) == 0
    router.reconfigure(lease | {"lease_expires_at": far, "epoch": 1})  # not a renewal: the same deadline
    assert router.percent_now(router.cfg) == 0
    router.reconfigure(lease | {"lease_expires_at": far + 1})  # a renewal restarts the replica's timer
    assert router.percent_now(router.cfg) == 50


def _parse(endpoint: str, body: object, cfg: RouterConfig = CFG):
    """The request object, or (status, message) of the ApiError it raised."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        return validate(endpoint, parse_json(raw), cfg.max_prompt_bytes, cfg.max_tokens_cap)
    except ApiError as e:
        assert e.body()["error"]["message"] == e.message and e.body()["error"]["type"]
        return e.status, e.message


@pytest.mark.parametrize(
    "endpoint,body,status,message",
    [
        ("completions", b'{"prompt": ', 400, "body is not JSON: Expecting value at position 11"),
        ("score", b"text=hello", 400, "body is not JSON: Expecting value at position 0"),
        ("completions", [1, 2], 400, "body: must be a JSON object, not list"),
        ("completions", {}, 400, "prompt: Field required"),
        ("completions", {"prompt": 5}, 400, "prompt: Input should be a valid string"),
        ("completions", {"prompt": ""}, 400, "prompt: String should have at least 1 character"),
        (
            "completions",
            {"prompt": ["a", "b"]},
            400,
            "prompt: only one prompt string per request is supported (no batches or token ids)",
        ),
        (
            "completions",
            {"prompt": [1, 2]},
            400,
            "prompt: only one prompt string per request is supported (no batches or token ids)",
        ),
        ("completions", {"prompt": "ab", "max_tokens": "8"}, 400, "max_tokens: Input should be a valid integer"),
        ("completions", {"prompt": "ab", "max_tokens": True}, 400, "max_tokens: Input should be a valid integer"),
        (
            "completions",
            {"prompt": "ab", "max_tokens": -1},
            400,
            "max_tokens: Input should be greater than or equal to 0",
        ),
        ("completions", {"prompt": "ab", "max_tokens": 33}, 400, "max_tokens: 33 > serve.max_tokens_cap=32"),
        (
            "completions",
            {"prompt": "ab", "temperature": 9},
            400,
            "temperature: Input should be less than or equal to 2",
        ),
        ("completions", {"prompt": "ab", "top_p": -0.5}, 400, "top_p: Input should be greater than or equal to 0"),
        ("completions", {"prompt": "ab", "logprobs": 6}, 400, "logprobs: Input should be less than or equal to 5"),
        ("completions", {"prompt": "ab", "seed": 1.5}, 400, "seed: Input should be a valid integer"),
        ("completions", {"prompt": "ab", "n": 2}, 400, "n: only 1 is supported, got 2"),
        ("completions", {"prompt": "ab", "best_of": 3}, 400, "best_of: only 1 is supported, got 3"),
        ("completions", {"prompt": "ab", "suffix": "z"}, 400, "suffix: only None is supported, got 'z'"),
        (
            "completions",
            {"prompt": "ab", "presence_penalty": 0.5},
            400,
            "presence_penalty: only 0 is supported, got 0.5",
        ),
        ("completions", {"prompt": "ab", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop: at most 4 non-empty strings"),
        (
            "completions",
            {"prompt": "ab", "stream_options": {"include_usage": True}},
            400,
            "stream_options: only allowed with stream: true",
        ),
        ("completions", {"prompt": "ab", "functions": []}, 400, "functions: unsupported parameter"),
        ("completions", {"prompt": "x" * 17}, 400, "prompt: 17 bytes > serve.max_prompt_bytes=16"),
        ("completions", {"prompt": "é" * 9}, 400, "prompt: 18 bytes > serve.max_prompt_bytes=16"),  # 9 chars, 18 bytes
        ("score", {"text": "€" * 6}, 400, "text: 18 bytes > serve.max_prompt_bytes=16"),
        ("score", {"text": "a"}, 400, "text: needs at least 2 bytes (the first byte is never predicted)"),
        ("score", {"text": ""}, 400, "text: String should have at least 1 character"),
        ("score", {"text": ["ab"]}, 400, "text: Input should be a valid string"),
        ("score", {"prompt": "ab"}, 400, "text: Field required"),
        ("score", {"text": "ab", "temperature": 1}, 400, "temperature: unsupported parameter"),
        # what a fuzzer sent: Python's own limit on a number's digits, a non-UTF-8 body, half a surrogate pair,
        # a stop of the wrong type (named as OpenAI's one field, not pydantic's branch `stop.str`)
        (
            "completions",
            b'{"prompt": "ab", "max_tokens": ' + b"9" * 5000 + b"}",
            400,
            "body is not JSON this endpoint accepts: Exceeds the limit (4300 digits) for integer string conversion: "
            "value has 5000 digits",
        ),
        ("completions", b'{"prompt": "\xff"}', 400, "body is not UTF-8 JSON: byte 12 is not UTF-8"),
        ("completions", b'{"prompt": "a\xed\xa0\x80"}', 400, "body is not UTF-8 JSON: byte 13 is not UTF-8"),
        ("completions", '{"prompt": "ab"}'.encode("utf-16"), 400, "body is not UTF-8 JSON: byte 0 is not UTF-8"),
        (
            "completions",
            b'{"prompt": "a\\ud800b"}',
            400,
            "prompt: holds an unpaired UTF-16 surrogate (\\ud800-\\udfff), not text",
        ),
        ("completions", {"prompt": "ab", "stop": 5}, 400, "stop: a string or a list of at most 4 strings, got 5"),
        (
            "completions",
            {"prompt": "ab", "stop": ["a", 1]},
            400,
            'stop: a string or a list of at most 4 strings, got ["a", 1]',
        ),
        # unknown keys that read like pydantic's names of a union's members are still named
        ("completions", {"prompt": "ab", "list": 1}, 400, "list: unsupported parameter"),
        ("completions", {"prompt": "ab", "foo[0]": 1}, 400, "foo[0]: unsupported parameter"),
        # a client's value is quoted short
        (
            "completions",
            {"prompt": "ab", "suffix": "z" * 5000},
            400,
            f"suffix: only None is supported, got '{'z' * 56}...",
        ),
    ],
)
def test_bad_requests_get_a_status_and_a_one_line_cause(endpoint, body, status, message):
    assert _parse(endpoint, body) == (status, message)
    assert "\n" not in message


def test_a_stop_nested_near_the_parsers_depth_limit_is_a_400_at_every_depth():
    # past some depth the parser refuses the body; just short of it, quoting the value in the message would recurse
    # too deep: every depth is a 400, none an exception (a 500)
    limit = sys.getrecursionlimit()
    answers = {
        _parse("completions", ('{"prompt": "ab", "stop": ' + "[" * depth + "]" * depth + "}").encode())
        for depth in range(limit - 200, limit + 10)
    }
    assert {status for status, _ in answers} == {400}
    assert {message.split(":")[0] for _, message in answers} == {"stop", "body is not JSON this endpoint accepts"}
    assert shown([[[]]]) == "[[[]]]"
    nested: list = []
    for _ in range(limit):
        nested = [nested]
    assert shown(nested) == "a deeply nested list"


def test_good_requests_become_request_objects():
    req = _parse("completions", {"prompt": "hello", "max_tokens": 32, "temperature": 0, "seed": 3})
    assert isinstance(req, CompletionRequest)
    assert (req.prompt, req.max_tokens, req.temperature, req.seed) == ("hello", 32, 0.0, 3)
    assert _parse("completions", {"prompt": "a"}) == CompletionRequest(prompt="a")  # a 1-byte prompt can be continued
    assert _parse("completions", {"prompt": "é" * 8}).prompt == "é" * 8  # exactly 16 bytes
    req = _parse("score", {"text": "é"})  # one character, two bytes: one byte is predicted
    assert isinstance(req, ScoreRequest) and req.text == "é"
    assert _parse("score", b'{"text": "\\u00e9\\u00e9"}') == ScoreRequest(text="éé")
    # OpenAI clients send these; the neutral values and a one-prompt list are accepted
    req = _parse(
        "completions",
        {
            "model": "m",
            "prompt": ["hi"],
            "n": 1,
            "best_of": 1,
            "logit_bias": {},
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "user": "u",
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": 2,
            "echo": True,
            "top_p": 0.9,
            "top_k": 5,
        },
    )
    assert isinstance(req, CompletionRequest)
    assert (req.model, req.prompt, req.stops(), req.logprobs, req.stream) == ("m", "hi", ["\n"], 2, True)


def test_an_explicit_null_is_the_parameters_default_as_in_openais_api():
    # OpenAI's optional parameters are nullable; tools built on its API send null for what they leave unset
    nulls = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs", "echo", "stream"]
    nulls += ["stream_options", "user", "n", "best_of", "suffix", "logit_bias", "presence_penalty", "model"]
    assert _parse("completions", {"prompt": "ab", **dict.fromkeys(nulls)}) == CompletionRequest(prompt="ab")
    req = _parse("completions", {"prompt": "ab", "stream": True, "stream_options": {"include_usage": None}})
    assert isinstance(req, CompletionRequest) and req.stream_options and req.stream_options.include_usage is False
    # a required field sent as null is still missing, and an unknown one still unsupported
    assert _parse("completions", {"prompt": None}) == (400, "prompt: Field required")
    assert _parse("score", {"text": None}) == (400, "text: Field required")
    assert _parse("completions", {"prompt": "ab", "functions": None}) == (400, "functions: unsupported parameter")


def test_openais_ranges_are_accepted_at_their_edges():
    # max_tokens 0 with echo and logprobs scores the prompt; top_p 0 is greedy; a seed is any int64
    req = _parse("completions", {"prompt": "ab", "max_tokens": 0, "echo": True, "logprobs": 1, "top_p": 0})
    assert isinstance(req, CompletionRequest) and (req.max_tokens, req.top_p) == (0, 0.0)
    assert _parse("completions", {"prompt": "ab", "seed": -(2**63)}).seed == -(2**63)
    assert _parse("completions", {"prompt": "ab", "seed": -(2**63) - 1})[0] == 400
    streamed = {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}
    assert _parse("completions", {"prompt": "ab", **streamed}).stream_options.include_usage


def test_top_k_minus_one_is_vllms_disabled_and_samples_from_every_token():
    req = _parse("completions", {"prompt": "ab", "top_k": -1})
    assert isinstance(req, CompletionRequest) and req.top_k == -1
    status, message = _parse("completions", {"prompt": "ab", "top_k": -2})
    assert status == 400 and message.startswith("top_k:")


def test_limits_come_from_the_router_config():
    roomy = CFG.model_copy(update={"max_prompt_bytes": 4096, "max_tokens_cap": 256})
    assert isinstance(_parse("completions", {"prompt": "x" * 17, "max_tokens": 200}, roomy), CompletionRequest)


def test_deeply_nested_json_is_a_400():
    body = b"[" * 5000 + b"]" * 5000  # 10 KB, well under serve.max_request_bytes
    assert _parse("completions", body)[0] == 400


def test_a_seed_the_model_cannot_use_is_a_400():
    assert _parse("completions", {"prompt": "ab", "seed": 2**64})[0] == 400


def test_a_temperature_too_small_to_divide_by_is_greedy():
    """1e-40 would overflow the scaled logits to inf (a NaN softmax: the request failing as the version's fault)."""
    import torch

    from deployments.generation import pick

    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    for temperature in (1e-40, 5e-324, 1e-6):
        assert pick(logits, temperature, 0, 1.0, torch.Generator().manual_seed(0)) == 1


def test_the_token_check_takes_the_scheme_in_any_case_and_answers_as_openai_does():
    import hashlib

    from deployments.http_io import check_token

    digest = hashlib.sha256(b"s3cret").hexdigest()
    for header in ("Bearer s3cret", "bearer s3cret", "BEARER  s3cret"):
        check_token({"authorization": header}, digest)
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic s3cret"}):
        with pytest.raises(ApiError) as err:
            check_token(headers, digest)
        assert (err.value.status, err.value.body()["error"]["type"], err.value.code) == (
            401, "invalid_request_error", "invalid_api_key",
        )  # fmt: skip


def test_a_configured_token_with_a_newline_or_non_ascii_text_is_matched_as_the_client_sends_it():
    """A secret made with `kubectl create secret --from-file` ends in a newline, and a header carries UTF-8 bytes
    that the ASGI server hands over decoded as latin-1: neither token could ever authenticate."""
    from starlette.requests import Request

    from deployments.http_io import check_token
    from deployments.serving import token_digest

    pairs = [("s3cret\n", "s3cret"), ("pässwort-1", "pässwort-1"), ("voilà", "voilà"), ("мех", "мех")]
    pairs += [("abc\xa0", "abc\xa0"), ("s3cret\u3000", "s3cret\u3000")]  # UTF-8 ending in 0xA0/0x85, Unicode spaces
    for configured, sent in pairs:
        raw = [(b"authorization", b"Bearer " + sent.encode())]  # the bytes curl sends
        headers = dict(Request({"type": "http", "method": "POST", "path": "/", "headers": raw}).headers)
        check_token(headers, token_digest(configured))
    for wrong in ("", " ", "s3cre", "s3cret x"):
        with pytest.raises(ApiError):
            check_token({"authorization": f"Bearer {wrong}"}, token_digest("s3cret\n"))
    assert token_digest("") == "" and token_digest(" \n") not in ("", token_digest(""))  # whitespace fails closed
    with pytest.raises(ApiError):
        check_token({"authorization": "Bearer "}, token_digest(" \n"))


def test_the_api_token_is_read_without_the_newline_a_secret_file_ends_in(monkeypatch):
    """The canary's own requests send it: httpx refuses a header ending in a newline, so every warm-up and probe
    request failed, and its error quoted the header."""
    from deployments.config import ServeConfig
    from deployments.serving import api_token

    monkeypatch.setenv("SHARDLINE_TEST_TOKEN", "s3cret\n")
    assert api_token(ServeConfig(auth_token_env="SHARDLINE_TEST_TOKEN")) == "s3cret"
    monkeypatch.setenv("SHARDLINE_TEST_TOKEN", "voilà\xa0")  # Unicode space is the token's own
    assert api_token(ServeConfig(auth_token_env="SHARDLINE_TEST_TOKEN")) == "voilà\xa0"


def test_a_content_length_that_is_not_ascii_digits_is_read_as_absent():
    """'²' is a digit to str.isdigit but not to int(): the body is then read and bounded as it streams."""
    from starlette.requests import Request

    from deployments.http_io import read_body

    async def receive():
        return {"type": "http.request", "body": b'{"text": "ab"}', "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"content-length", "²".encode("latin-1"))]}
    assert asyncio.run(read_body(Request(scope, receive), 1024)) == b'{"text": "ab"}'
    with pytest.raises(ApiError, match="request body over serve.max_request_bytes=4"):
        asyncio.run(read_body(Request(scope, receive), 4))
    huge = {**scope, "headers": [(b"content-length", b"1" + b"0" * 23)]}  # refused before a byte is read
    with pytest.raises(ApiError, match="request body over serve.max_request_bytes=1024"):
        asyncio.run(read_body(Request(huge, receive), 1024))
    assert _parse("score", b'\xef\xbb\xbf{"text": "ab"}') == ScoreRequest(text="ab")  # a UTF-8 BOM is UTF-8


def test_an_unknown_model_is_quoted_short():
    from deployments.openai_api import model_not_found

    err = model_not_found("m" * 5000, ["alpha"])
    assert err.status == 404 and err.message == "model: '" + "m" * 56 + "... is not served here; served: alpha"


def test_a_router_reached_directly_quotes_an_unknown_model_short():
    """A router's own route (KubeRay exposes it) answers a 404 of its own, clipped as the gateway's is."""
    router = Router("shardline-m", {})
    router.reconfigure({"model_name": "m", "champion": "1"})
    body = json.dumps({"model": "x" * 5000, "prompt": "ab"}).encode()
    reply = asyncio.run(router.respond("POST", "/v1/completions", {}, body))
    error = json.loads(reply["body"])["error"]
    assert reply["status"] == 404 and error["code"] == "model_not_found"
    assert error["message"] == "model: '" + "x" * 56 + "... is not served here (this is 'm')"
