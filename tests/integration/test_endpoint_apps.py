"""Which Serve application is whose, on a real Ray Serve: two models whose names read alike once Serve's characters
are replaced (`team.gpt`, `team-gpt`) get one application each, and neither model's reconcile or `serve --stop`
takes over or removes the other's; an application or gateway under the name an older shardline gave it is
replaced, not kept beside; `serve --stop` waits for a release in progress and stays stopped; a reconcile reports
only a dead canary's challenger as orphaned, not a champion the operator replaced.

One registry and one Ray session, in file order (see support/scenarios.py).
"""

from __future__ import annotations

import types

import httpx
import pytest
from support.serve_support import bigram_logits, corpus, log_model, register, serving_world

from deployments import endpoint
from deployments.gateway_control import EndpointConflict
from deployments.serve_build import AppSpec, router_config

pytestmark = [pytest.mark.slow, pytest.mark.scenario]

DOTTED, DASHED = "team.gpt", "team-gpt"
DOTTED_APP, DASHED_APP = "shardline-team-gpt-b2e3a34e", "shardline-team-gpt"  # the hash keeps them two


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    fit, _ = corpus()
    tables = {"weak": bigram_logits(fit, smoothing=50.0), "good": bigram_logits(fit, smoothing=0.05)}
    with serving_world(tmp_path_factory.mktemp("home"), "endpoint-apps-it", tables, (DOTTED, DASHED)) as world:
        yield world


def _apps() -> set[str]:
    from ray import serve as rs

    return set(rs.status().applications)


def _model_of(app: str) -> str:
    return endpoint.read_state(app)["config"]["model_name"]


def _cli_config(world: dict, model: str):
    """What serve_down reads of a loaded config: the cluster this process is connected to (nothing to start)."""
    return types.SimpleNamespace(
        cluster=types.SimpleNamespace(mode="remote"),
        serve=world["serve"],
        registry=types.SimpleNamespace(model_name=model, tracking_uri=world["uri"]),
    )


def test_a_model_s_application_under_its_name_before_the_hash_is_replaced_not_kept_beside(world):
    serve, uri = world["serve"], world["uri"]
    old = AppSpec(app_name=DASHED_APP, tracking_uri=uri, versions=["1"], router=router_config(serve, DOTTED, "1"))
    endpoint.apply(old, serve)  # what an older shardline named team.gpt's application
    endpoint.reconcile(serve, DOTTED, uri)
    assert DOTTED_APP in _apps() and DASHED_APP not in _apps()
    endpoint.apply(old, serve)
    assert endpoint.remove(serve, DOTTED) and not {DOTTED_APP, DASHED_APP} & _apps()  # `serve --stop` removes both


def test_one_model_never_takes_over_or_removes_an_application_serving_another(world):
    serve, uri = world["serve"], world["uri"]
    endpoint.reconcile(serve, DOTTED, uri)
    done = endpoint.reconcile(serve, DASHED, uri)
    assert {_model_of(DOTTED_APP), _model_of(DASHED_APP)} == {DOTTED, DASHED} and _model_of(DASHED_APP) == DASHED
    with httpx.Client(timeout=60) as http:
        for model in (DOTTED, DASHED):
            r = http.post(f"{done.url}/v1/completions", json={"model": model, "prompt": "import ", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == model
    taken = serve.model_copy(update={"app_name": DASHED_APP})
    for act in (lambda: endpoint.reconcile(taken, DOTTED, uri), lambda: endpoint.remove(taken, DOTTED)):
        with pytest.raises(EndpointConflict) as e:
            act()
        assert str(e.value) == (
            f"application {DASHED_APP!r} serves model {DASHED!r}, not registry.model_name={DOTTED!r}; "
            "set serve.app_name to an application of its own"
        )
    assert _model_of(DASHED_APP) == DASHED
    assert endpoint.remove(serve, DOTTED) and DOTTED_APP not in _apps() and DASHED_APP in _apps()


def test_serve_stop_waits_for_a_release_in_progress_then_stays_stopped(world):
    """A canary mid-ramp holds the model's release lock: `serve --stop` removed its application under it. Once
    stopped, the next `shardline serve` of another model served it again (it was still marked as served)."""
    from deployments.endpoint import EndpointError
    from deployments.registry import served_champions
    from deployments.release_lock import release_lock
    from deployments.serving import reconcile_others, serve_down
    from infra.names import TAG_SERVE_ERROR, TAG_SERVED_BY

    serve, uri, client = world["serve"], world["uri"], world["client"]
    endpoint.reconcile(serve, DOTTED, uri)
    client.set_registered_model_tag(DOTTED, TAG_SERVE_ERROR, "EndpointError: an earlier failure")
    with release_lock(DOTTED, uri, 1.0):  # the canary's
        with pytest.raises(EndpointError) as e:
            serve_down(_cli_config(world, DOTTED), wait_for_lock_s=0.2)
    assert str(e.value) == f"a release of {DOTTED} is in progress (its canary or promotion); try again when it ends"
    assert DOTTED_APP in _apps() and TAG_SERVED_BY in client.get_registered_model(DOTTED).tags

    out = serve_down(_cli_config(world, DOTTED))
    assert out == {"app_removed": True, "head_stopped": False, "unmarked": True}
    tags = client.get_registered_model(DOTTED).tags
    assert TAG_SERVED_BY not in tags and TAG_SERVE_ERROR not in tags
    assert list(served_champions(client)) == [DASHED]
    assert reconcile_others(serve, DASHED, uri, "", None) == {} and DOTTED_APP not in _apps()
    assert serve_down(_cli_config(world, DOTTED))["unmarked"]  # again: nothing to remove, nothing marked


def test_only_a_challenger_a_dead_canary_left_is_reported_orphaned_not_a_replaced_champion(world):
    """serve_up tags what reconcile reports orphaned as an abandoned canary; a champion the operator replaced (a
    first champion, never canaried) was tagged so too."""
    from deployments.registry import CHALLENGER
    from deployments.rollout import tag_abandoned
    from infra.names import TAG_CANARY_DECISION

    serve, uri, client, exp = world["serve"], world["uri"], world["client"], world["exp"]
    v2, v3 = (
        register(client, *log_model(world["tables"]["good"], f"{DASHED}-{n}", exp, client), DASHED).version
        for n in ("v2", "v3")
    )
    client.delete_registered_model_alias(DASHED, CHALLENGER)
    client.set_registered_model_alias(DASHED, "champion", v2)  # the operator's move: v1 retires
    done = endpoint.reconcile(serve, DASHED, uri)
    assert (done.removed, done.orphaned) == (["1"], [])
    dead = router_config(serve, DASHED, v2, challenger=v3, challenger_percent=10)  # a canary whose driver died
    endpoint.apply(AppSpec(app_name=DASHED_APP, tracking_uri=uri, versions=[v2, v3], router=dead), serve)
    done = endpoint.reconcile(serve, DASHED, uri)
    assert (done.removed, done.orphaned) == ([v3], [v3])
    tag_abandoned(client, DASHED, done.orphaned)
    decided = {v: client.get_model_version(DASHED, v).tags.get(TAG_CANARY_DECISION) for v in ("1", v3)}
    assert decided == {"1": None, v3: "abandoned"}


def test_an_older_shardline_s_gateway_on_the_prefix_gives_it_up_to_the_hashed_one(world):
    from ray import serve as rs

    @rs.deployment
    class OldGateway:
        async def __call__(self, request) -> str:
            return "an older shardline's gateway"

    serve = world["serve"].model_copy(update={"route_prefix": "/team/a"})
    rs.run(OldGateway.bind(), name="shardline-gateway-team-a", route_prefix="/team/a")
    endpoint.reconcile(serve, DASHED, world["uri"])
    assert "shardline-gateway-team-a" not in _apps() and "shardline-gateway-team-a-65f838a2" in _apps()
    assert endpoint.read_state(DASHED_APP)["config"]["gateway"] == "shardline-gateway-team-a-65f838a2"
