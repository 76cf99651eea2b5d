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
