"""serve_run: deploys of one driver take turns, and cloudpickle's pickle-by-value race is deployed again.

`build` is the caller's own code (it builds the application), so a build that raises is no stand-in for Ray: the
race surfaces from building the deployment options as well as from serve.run, and no cluster is needed to see
what serve_run decides about each error.
"""

from __future__ import annotations

import pytest

from deployments.gateway_control import PICKLE_RACE, PICKLE_RACE_TRIES, serve_run


def test_the_pickle_race_is_built_and_deployed_again_until_it_clears():
    calls: list[int] = []

    def build():
        calls.append(1)
        if len(calls) < PICKLE_RACE_TRIES:  # raced every time but the last: still deployed
            raise ValueError(f"<module 'ray.serve._private.request_router'> {PICKLE_RACE}")
        raise LookupError("the last build fails for its own reason")

    with pytest.raises(LookupError, match="its own reason"):
        serve_run(build, "shardline-x", None)
    assert len(calls) == PICKLE_RACE_TRIES


def test_a_race_that_never_clears_is_raised_after_the_last_try():
    calls: list[int] = []

    def build():
        calls.append(1)
        raise ValueError(PICKLE_RACE)

    with pytest.raises(ValueError, match=PICKLE_RACE):
        serve_run(build, "shardline-x", None)
    assert len(calls) == PICKLE_RACE_TRIES


def test_any_other_error_is_raised_at_once():
    calls: list[int] = []

    def build():
        calls.append(1)
        raise RuntimeError("replica failed to start")

    with pytest.raises(RuntimeError, match="replica failed"):
        serve_run(build, "shardline-x", None)
    assert calls == [1]


# ---- the endpoint's control side (deployments/endpoint.py) with Serve replaced by a dict of applications ----


def test_an_unanswering_holder_of_the_prefix_names_the_flag_that_removes_it(monkeypatch):
    """The conflict tells the operator what to run: the command it names must be one the CLI takes."""
    import re

    from deployments import endpoint
    from deployments.config import ServeConfig
    from deployments.gateway_control import EndpointConflict
    from flows.cli.root import build_parser

    monkeypatch.setattr(endpoint, "read_state", lambda app: None)
    with pytest.raises(EndpointConflict, match="held by 'shardline-old'") as raised:
        endpoint._move_behind_gateway("shardline-old", ServeConfig(), "sqlite:///x.db", None)
    command = re.search(r"`shardline ([^`]+)`", str(raised.value))
    assert command is not None and "\n" not in str(raised.value)
    args = build_parser().parse_args(command.group(1).split())  # an unknown flag exits 2
    assert args.command == "serve" and args.stop


class FakeServe:
    """Ray Serve as the control side sees it: applications by name, each with its router's config and the versions
    it has a deployment for. `apply` deploys what it is given at once; deleting an application is recorded."""

    def __init__(self) -> None:
        self.apps: dict[str, dict] = {}
        self.versions: dict[str, list[str]] = {}
        self.deleted: list[str] = []

    def apply(self, spec, serve, runtime_env=None, timeout_s=300.0) -> None:
        self.apps[spec.app_name] = spec.router.model_dump()
        self.versions[spec.app_name] = sorted(spec.versions)

    def delete(self, name: str, _blocking: bool = True) -> None:
        self.deleted.append(name)
        self.apps.pop(name, None)
        self.versions.pop(name, None)


@pytest.fixture
def fake_serve(monkeypatch) -> FakeServe:
    import types

    import ray.serve

    from deployments import endpoint

    fake = FakeServe()
    state = lambda app: {"config": fake.apps[app], "inflight": {}} if app in fake.apps else None  # noqa: E731
    monkeypatch.setattr(endpoint, "read_state", state)
    monkeypatch.setattr(endpoint, "served_versions", lambda app: fake.versions.get(app, []))
    monkeypatch.setattr(endpoint, "apply", fake.apply)
    monkeypatch.setattr(endpoint, "drain", lambda *a: None)
    monkeypatch.setattr(endpoint, "prefix_holder", lambda serve: None)
    monkeypatch.setattr(endpoint, "ensure_gateway", lambda *a: "shardline-gateway")
    monkeypatch.setattr(endpoint, "endpoint_url", lambda serve: "http://127.0.0.1:8000")
    monkeypatch.setattr(endpoint, "drop_stale_serve_client", lambda: None)
    monkeypatch.setattr(endpoint, "remove_gateway_if_unused", lambda serve: False)
    monkeypatch.setattr(ray.serve, "status", lambda: types.SimpleNamespace(applications=dict.fromkeys(fake.apps)))
    monkeypatch.setattr(ray.serve, "delete", fake.delete)
    return fake


def _champions(uri: str, *names: str) -> None:
    """Each model registered with version 1 as its champion."""
    from deployments.registry import client_for

    client = client_for(uri)
    for name in names:
        client.create_registered_model(name)
        client.create_model_version(name, source="/tmp/nowhere")
        client.set_registered_model_alias(name, "champion", "1")


def _cli_config(uri: str, model: str, serve=None):
    """What serve_down reads of a loaded config, on a remote cluster already connected (nothing to start or stop)."""
    import types

    from deployments.config import ServeConfig

    return types.SimpleNamespace(
        cluster=types.SimpleNamespace(mode="remote"),
        serve=serve or ServeConfig(),
        registry=types.SimpleNamespace(model_name=model, tracking_uri=uri),
    )


def test_serve_stop_of_a_model_is_not_undone_by_serving_another(mlflow_store, fake_serve, monkeypatch):
    """`shardline serve --stop` for A, then `shardline serve` for B: B's run serves every other model still marked
    as served; A must no longer be, or its application comes straight back."""
    import ray

    from deployments import endpoint
    from deployments.config import ServeConfig
    from deployments.registry import client_for, served_champions
    from deployments.serving import reconcile_others, serve_down
    from infra.names import TAG_SERVE_ERROR, TAG_SERVED_BY

    uri, _ = mlflow_store
    _champions(uri, "A", "B")
    serve = ServeConfig()
    endpoint.reconcile(serve, "A", uri)
    endpoint.reconcile(serve, "B", uri)
    client_for(uri).set_registered_model_tag("A", TAG_SERVE_ERROR, "EndpointError: an earlier failure")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)

    out = serve_down(_cli_config(uri, "A", serve))
    assert out == {"app_removed": True, "head_stopped": False, "unmarked": True}
    tags = client_for(uri).get_registered_model("A").tags
    assert TAG_SERVED_BY not in tags and TAG_SERVE_ERROR not in tags
    assert list(served_champions(client_for(uri))) == ["B"]
    assert reconcile_others(serve, "B", uri, "", None) == {}
    assert sorted(fake_serve.apps) == ["shardline-B"]
    assert serve_down(_cli_config(uri, "A", serve))["unmarked"]  # again: nothing to remove, nothing marked
    assert serve_down(_cli_config(uri, "never-registered", serve))["unmarked"]


def test_a_registry_that_does_not_answer_leaves_the_mark_and_says_so(mlflow_store, fake_serve, monkeypatch, caplog):
    import ray

    from deployments import registry
    from deployments.serving import serve_down

    uri, _ = mlflow_store

    def down(client, name):
        raise ConnectionError("connection refused\nand a second line")

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(registry, "unmark_serving", down)
    assert serve_down(_cli_config(uri, "A"))["unmarked"] is False
    warned = [r.getMessage() for r in caplog.records if "stays marked as served" in r.getMessage()]
    assert len(warned) == 1 and "ConnectionError: connection refused" in warned[0] and "\n" not in warned[0]


def test_names_serve_rewrites_get_a_hash_and_names_it_keeps_stay_as_they_were():
    """Two models (or route prefixes) whose names read alike once Serve's characters are replaced have two
    applications; a name that needed no change keeps the application name every earlier shardline gave it."""
    from deployments.config import ServeConfig
    from deployments.gateway_control import gateway_name
    from deployments.serve_build import app_name_for

    serve = ServeConfig()
    assert app_name_for(serve, "shardline-gpt") == "shardline-shardline-gpt"
    assert app_name_for(serve, "team-gpt") == "shardline-team-gpt"
    names = {app_name_for(serve, m) for m in ("team.gpt", "team-gpt", "team gpt", "team/gpt", "team_gpt")}
    assert len(names) == 5 and all(n.startswith("shardline-team") for n in names)
    assert app_name_for(ServeConfig(app_name="shardline-prod"), "team.gpt") == "shardline-prod"
    assert gateway_name(ServeConfig()) == "shardline-gateway"
    assert gateway_name(ServeConfig(route_prefix="/a-b")) == "shardline-gateway-a-b"
    prefixes = ("/a/b", "/a-b", "/a.b", "/a b")
    assert len({gateway_name(ServeConfig(route_prefix=p)) for p in prefixes}) == len(prefixes)


def test_one_model_never_takes_over_or_removes_an_application_serving_another(mlflow_store, fake_serve):
    """serve.app_name set to another model's application, or an application under a name an older shardline gave
    another model: reconcile and remove refuse it in one line naming both models, and it keeps serving."""
    from deployments import endpoint
    from deployments.config import ServeConfig
    from deployments.gateway_control import EndpointConflict

    uri, _ = mlflow_store
    _champions(uri, "team.gpt", "team-gpt")
    serve = ServeConfig()
    endpoint.reconcile(serve, "team.gpt", uri)
    endpoint.reconcile(serve, "team-gpt", uri)
    assert sorted(fake_serve.apps) == ["shardline-team-gpt", "shardline-team-gpt-b2e3a34e"]
    assert {a: c["model_name"] for a, c in fake_serve.apps.items()} == {
        "shardline-team-gpt": "team-gpt",
        "shardline-team-gpt-b2e3a34e": "team.gpt",
    }
    taken = ServeConfig(app_name="shardline-team-gpt")
    for act in (lambda: endpoint.reconcile(taken, "team.gpt", uri), lambda: endpoint.remove(taken, "team.gpt")):
        with pytest.raises(EndpointConflict) as e:
            act()
        assert str(e.value) == (
            "application 'shardline-team-gpt' serves model 'team-gpt', not registry.model_name='team.gpt'; "
            "set serve.app_name to an application of its own"
        )
    assert fake_serve.apps["shardline-team-gpt"]["model_name"] == "team-gpt" and fake_serve.deleted == []
    assert endpoint.remove(serve, "team.gpt") and fake_serve.deleted == ["shardline-team-gpt-b2e3a34e"]


def test_a_model_s_application_under_its_name_before_the_hash_is_replaced_not_kept_beside(mlflow_store, fake_serve):
    from deployments import endpoint
    from deployments.config import ServeConfig
    from deployments.serve_build import router_config

    uri, _ = mlflow_store
    _champions(uri, "team.gpt")
    serve = ServeConfig()
    fake_serve.apps["shardline-team-gpt"] = router_config(serve, "team.gpt", "1").model_dump()  # an older shardline's
    fake_serve.versions["shardline-team-gpt"] = ["1"]
    endpoint.reconcile(serve, "team.gpt", uri)
    assert sorted(fake_serve.apps) == ["shardline-team-gpt-b2e3a34e"] and fake_serve.deleted == ["shardline-team-gpt"]
    fake_serve.apps["shardline-team-gpt"] = router_config(serve, "team.gpt", "1").model_dump()
    assert endpoint.remove(serve, "team.gpt") and fake_serve.apps == {}  # `serve --stop` removes both


def test_an_older_shardline_s_gateway_on_the_prefix_gives_it_up_to_the_hashed_one(
    mlflow_store, fake_serve, monkeypatch
):
    from deployments import endpoint
    from deployments.config import ServeConfig

    uri, _ = mlflow_store
    _champions(uri, "m")
    serve = ServeConfig(route_prefix="/team/a")
    monkeypatch.setattr(endpoint, "prefix_holder", lambda s: "shardline-gateway-team-a")
    fake_serve.apps["shardline-gateway-team-a"] = {}
    endpoint.reconcile(serve, "m", uri)
    assert fake_serve.deleted == ["shardline-gateway-team-a"]
    assert fake_serve.apps["shardline-m"]["gateway"] == "shardline-gateway-team-a-65f838a2"


def test_serve_stop_waits_for_a_release_in_progress_and_then_refuses_in_one_line(mlflow_store, fake_serve, monkeypatch):
    """A canary mid-ramp holds the model's release lock: `serve --stop` removed its application under it."""
    import ray

    from deployments import endpoint
    from deployments.config import ServeConfig
    from deployments.endpoint import EndpointError
    from deployments.registry import client_for
    from deployments.release_lock import release_lock
    from deployments.serving import serve_down
    from infra.names import TAG_SERVED_BY

    uri, _ = mlflow_store
    _champions(uri, "m")
    endpoint.reconcile(ServeConfig(), "m", uri)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    with release_lock("m", uri, 1.0):  # the canary's
        with pytest.raises(EndpointError) as e:
            serve_down(_cli_config(uri, "m"), wait_for_lock_s=0.2)
    assert str(e.value) == "a release of m is in progress (its canary or promotion); try again when it ends"
    assert sorted(fake_serve.apps) == ["shardline-m"] and fake_serve.deleted == []
    assert TAG_SERVED_BY in client_for(uri).get_registered_model("m").tags
    assert serve_down(_cli_config(uri, "m"), wait_for_lock_s=0.2)["app_removed"]  # the release ended


def test_only_a_challenger_a_dead_canary_left_is_reported_orphaned_not_a_replaced_champion(mlflow_store, fake_serve):
    """serve_up tags what reconcile reports orphaned as an abandoned canary; a champion the operator replaced (a
    first champion, never canaried) was tagged so too."""
    from deployments import endpoint
    from deployments.config import ServeConfig
    from deployments.registry import client_for
    from deployments.rollout import tag_abandoned
    from deployments.serve_build import router_config
    from infra.names import TAG_CANARY_DECISION

    uri, _ = mlflow_store
    _champions(uri, "m")
    client = client_for(uri)
    for _ in range(2):
        client.create_model_version("m", source="/tmp/nowhere")
    serve = ServeConfig()
    endpoint.reconcile(serve, "m", uri)
    client.set_registered_model_alias("m", "champion", "2")  # the operator's move: v1 retires
    done = endpoint.reconcile(serve, "m", uri)
    assert (done.removed, done.orphaned) == (["1"], [])
    fake_serve.apps["shardline-m"] = router_config(serve, "m", "2", challenger="3", challenger_percent=10).model_dump()
    fake_serve.versions["shardline-m"] = ["2", "3"]  # a canary of v3 whose driver died
    done = endpoint.reconcile(serve, "m", uri)
    assert (done.removed, done.orphaned) == (["3"], ["3"])
    tag_abandoned(client, "m", done.orphaned)
    decided = {v: client.get_model_version("m", v).tags.get(TAG_CANARY_DECISION) for v in ("1", "3")}
    assert decided == {"1": None, "3": "abandoned"}


def test_serve_stop_goes_on_without_the_release_lock_when_its_store_does_not_answer(tmp_path, monkeypatch, caplog):
    """The lock's store down (here a lock file that cannot be made; a Prefect server or PostgreSQL that does not
    answer alike): `serve --stop` raised out of it and stopped nothing, not even the local Ray head."""
    from deployments import serving
    from infra import head

    blocked = tmp_path / "a-file"
    blocked.write_text("")  # the lock file's folder is a file
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    stopped = []
    monkeypatch.setattr(head, "stop_head", lambda: stopped.append(True) or True)
    config = _cli_config(f"sqlite:///{blocked / 'mlflow.db'}", "m")
    config.cluster.mode = "local"  # no head recorded: nothing to remove, the head is stopped all the same
    out = serving.serve_down(config, wait_for_lock_s=0.2)
    assert out == {"app_removed": False, "head_stopped": True, "unmarked": False} and stopped == [True]
    assert "stopping m without its release lock: its store did not answer (FileExistsError" in caplog.text
