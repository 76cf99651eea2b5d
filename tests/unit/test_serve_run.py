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


def test_an_unanswering_holder_of_the_prefix_names_the_flag_that_removes_it():
    """The conflict tells the operator what to run: the command it names must be one the CLI takes."""
    import re

    from deployments import endpoint
    from deployments.config import ServeConfig
    from flows.cli.root import build_parser

    raised = endpoint.unanswering_holder(ServeConfig(), "shardline-old")
    assert "held by 'shardline-old'" in str(raised)
    command = re.search(r"`shardline ([^`]+)`", str(raised))
    assert command is not None and "\n" not in str(raised)
    args = build_parser().parse_args(command.group(1).split())  # an unknown flag exits 2
    assert args.command == "serve" and args.stop


def _cli_config(uri: str, model: str, serve=None):
    """What serve_down reads of a loaded config, on a remote cluster already connected (nothing to start or stop)."""
    import types

    from deployments.config import ServeConfig

    return types.SimpleNamespace(
        cluster=types.SimpleNamespace(mode="remote"),
        serve=serve or ServeConfig(),
        registry=types.SimpleNamespace(model_name=model, tracking_uri=uri),
    )


def test_a_registry_that_does_not_answer_leaves_the_mark_and_says_so(tmp_path, monkeypatch, caplog):
    """The registry's store cannot be opened (its folder is a file): the stop goes on, says in one line that the
    model stays marked as served, and reports `unmarked` False."""
    from deployments.serving import serve_down

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    config = _cli_config(f"sqlite:///{blocked / 'mlflow.db'}", "A")
    config.cluster.mode = "local"  # no head recorded here: nothing to remove or stop
    assert serve_down(config, wait_for_lock_s=0.2) == {"app_removed": False, "head_stopped": False, "unmarked": False}
    warned = [r.getMessage() for r in caplog.records if "stays marked as served" in r.getMessage()]
    assert (
        len(warned) == 1
        and warned[0].startswith("A stays marked as served in the registry (")
        and "\n" not in warned[0]
    )


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
