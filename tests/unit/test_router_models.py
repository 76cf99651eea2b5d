"""GET /v1/models and /v1/models/NAME straight on a model's router (a route without the gateway): OpenAI's list,
one model's card (the official client's `models.retrieve`), and model_not_found for another name."""

from __future__ import annotations

import json

from deployments.router_config import RouterConfig
from deployments.serve_app import Router


def _get(path: str) -> tuple[int, dict]:
    router = Router("shardline-m", {})
    router.cfg = RouterConfig(model_name="m", champion="3")
    out = router._prepare("GET", path, {}, b"")
    assert isinstance(out, dict)
    return out["status"], json.loads(out["body"])


def test_the_router_lists_its_model_and_answers_for_it_by_name():
    status, listed = _get("/v1/models")
    assert status == 200 and [(c["id"], c["champion_version"]) for c in listed["data"]] == [("m", "3")]
    status, card = _get("/v1/models/m/")
    assert status == 200 and (card["id"], card["object"], card["champion_version"]) == ("m", "model", "3")
    status, error = _get("/v1/models/other")
    assert status == 404 and error["error"]["code"] == "model_not_found" and "served: m" in error["error"]["message"]
