"""The live endpoint's control side: desired state in, Ray Serve application out.

Each model has its own application (no route of its own) behind the stack's gateway (gateway_control), which
`reconcile` keeps deployed on serve.route_prefix. The registry's `champion` alias is the desired state.
`reconcile` observes what the application serves, diffs it with the registry and acts: it deploys the champion at
100%, switches the router first and drains a replaced version before removing it, and removes a challenger that a
dead canary left behind. `apply` deploys an AppSpec, built by deployments/serve_build
(used by the rollout driver for each ramp step); every change to weights is a lightweight `user_config` update,
and a served version's deployment keeps one fixed Serve version, so no step restarts its replicas.
Ray must be initialised (the driver is connected to the cluster) before any of this is called.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pydantic import BaseModel

from deployments.config import ServeConfig
from deployments.gateway_control import (
    GATEWAY_APP,
    MODEL_APP_PREFIX,
    QUIET,
    EndpointConflict,
    drop_stale_serve_client,
    ensure_gateway,
    gateway_name,
    prefix_holder,
    remove_gateway_if_unused,
    sanitised,
    serve_run,
)
from deployments.registry import CHAMPION, client_for, mark_serving, read_aliases
from deployments.router_config import ROUTER, RouterConfig
from deployments.serve_build import AppSpec, app_name_for, build_app, router_config

log = logging.getLogger(__name__)


class EndpointError(RuntimeError):
    """The application could not be deployed or does not answer; the message says which and why."""


def start_proxy(serve: ServeConfig) -> None:
    """Start Serve's controller and HTTP proxy on serve.host:serve.port unless Serve already runs here."""
    from ray import serve as rs

    drop_stale_serve_client()
    rs.start(http_options={"host": serve.host, "port": serve.port}, logging_config=QUIET)


def endpoint_url(serve: ServeConfig) -> str:
    """Where clients reach the application: serve.public_url, else the address the proxy really listens on."""
    if serve.public_url:
        return serve.public_url.rstrip("/")
    host, port = serve.host, serve.port
    try:  # Serve keeps the HTTP options of a proxy already running in this cluster; ask where it listens
        from ray.serve.context import _get_global_client

        client = _get_global_client()
        if client is not None:
            host, port = client.http_config.host, int(client.http_config.port)
    except Exception:  # noqa: BLE001 - private API; the configured address is the best guess
        pass
    if host in ("0.0.0.0", "::"):
        import ray

        host = ray.util.get_node_ip_address()
    prefix = serve.route_prefix.rstrip("/")
    return f"http://{host}:{port}{prefix}"


def router_handle(app_name: str) -> Any:
    from ray import serve as rs

    return rs.get_deployment_handle(ROUTER, app_name)


def read_state(app_name: str) -> dict[str, Any] | None:
    """The router's state ({"config", "replica_id", "inflight", ...}); None when the application does not run."""
    from ray import serve as rs

    drop_stale_serve_client()
    try:
        if app_name not in rs.status().applications:
            return None
        return router_handle(app_name).get_state.remote().result(timeout_s=30)
    except Exception as e:  # noqa: BLE001 - a dead or deleted app reads as "not running"
        log.debug("reading %s: %s", app_name, e)
        return None


def apply(
    spec: AppSpec, serve: ServeConfig, runtime_env: dict[str, Any] | None = None, timeout_s: float = 300.0
) -> None:
    """Deploy the spec and wait until every replica is healthy and the router runs the new config.

    Raises:
        EndpointError: the application did not become healthy in time (the cause from Serve's status).
    """

    start_proxy(serve)
    try:  # no route: the gateway forwards this model's requests to its router's handle
        serve_run(lambda: build_app(spec, serve, runtime_env), spec.app_name, None)
    except Exception as e:  # noqa: BLE001 - Serve raises RuntimeError with the failing replica's traceback
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
        raise EndpointError(
            f"application {spec.app_name}: deploying versions {spec.versions} failed: {first}"
            f"{_deployment_causes(spec.app_name)}"
        ) from None
    deadline = time.monotonic() + timeout_s
    want = spec.router.model_dump()
    while True:
        state = read_state(spec.app_name)
        if state is not None and state["config"] == want:
            return
        if time.monotonic() > deadline:
            raise EndpointError(f"application {spec.app_name}: the router did not take its new config in {timeout_s} s")
        time.sleep(0.2)


def _deployment_causes(app_name: str) -> str:
    """The last line of each unhealthy deployment's message in Serve's status (the replica's exception)."""
    from ray import serve as rs

    try:
        app = rs.status().applications.get(app_name)
        causes = [
            f"{name}: {(d.message.strip().splitlines() or [''])[-1][:300]}"
            for name, d in (app.deployments.items() if app else [])
            if d.message and d.status != "HEALTHY"
        ]
    except Exception:  # noqa: BLE001 - only enriches an error message
        return ""
    return f" ({'; '.join(causes)})" if causes else ""


def drain(app_name: str, version: str, timeout_s: float) -> None:
    """Wait until the router has no request in flight to `version` (already routed elsewhere), or timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = read_state(app_name)
        if state is None or not state["inflight"].get(version):
            return
        time.sleep(0.1)


def served_versions(app_name: str) -> list[str]:
    """Versions with a deployment in the application, from Serve's own status."""
    from ray import serve as rs

    app = rs.status().applications.get(app_name)
    if app is None:
        return []
    return sorted(name[1:] for name in app.deployments if name.startswith("v") and name[1:].isdigit())


class Reconciled(BaseModel):
    """What reconcile found and did."""

    app_name: str
    url: str
    champion: str | None
    removed: list[str] = []  # every version taken out: replaced champions and orphaned challengers
    orphaned: list[str] = []  # of those, challengers a canary left routed (it died undecided): only these were canaried
    action: str


def reconcile(
    serve: ServeConfig,
    model_name: str,
    tracking_uri: str,
    token_sha256: str = "",
    runtime_env: dict[str, Any] | None = None,
) -> Reconciled:
    """Make the application serve the registry's champion at 100%, and nothing else.

    No champion: nothing to serve (an existing application is left as it is). The same champion: only an orphaned
    challenger (a canary that died) is taken out of routing and removed. Another champion: the new one is deployed
    next to the old, the router switches, in-flight requests to the old one drain, then it is removed.
    """
    app_name = app_name_for(serve, model_name)
    if app_name.startswith(GATEWAY_APP):
        raise EndpointConflict(
            f"registry.model_name={model_name!r}: its application {app_name!r} would be taken "
            "for the gateway's; set serve.app_name"
        )
    champion = read_aliases(client_for(tracking_uri), model_name).get(CHAMPION)
    if champion is None:
        return Reconciled(app_name=app_name, url="", champion=None, action="no champion in the registry")
    state = read_state(app_name)
    _refuse_another_models(app_name, state, model_name)
    current = state["config"] if state else None
    existing = served_versions(app_name) if state else []
    target = router_config(serve, model_name, champion, token_sha256)
    stale = [v for v in existing if v != champion]
    if current is not None and current["champion"] != champion and current["champion"] in existing:
        # switch first (both deployed), then drain the old champion, then remove it below
        apply(
            AppSpec(app_name=app_name, tracking_uri=tracking_uri, versions=[champion, *stale], router=target),
            serve,
            runtime_env,
        )
        for v in stale:
            drain(app_name, v, serve.drain_timeout_s)
    elif current is not None and current.get("challenger") and current["challenger"] in existing:
        # an orphaned challenger: out of routing at once, then removed
        apply(
            AppSpec(app_name=app_name, tracking_uri=tracking_uri, versions=[champion, *stale], router=target),
            serve,
            runtime_env,
        )
        for v in stale:
            drain(app_name, v, serve.drain_timeout_s)
    spec = AppSpec(app_name=app_name, tracking_uri=tracking_uri, versions=[champion], router=target)
    client = client_for(tracking_uri)
    try:
        action = _serve_champion(spec, serve, current, existing, runtime_env, token_sha256)
    except (EndpointError, EndpointConflict) as e:  # the registry says champion; say why nothing serves it
        mark_serving(client, model_name, gateway_name(serve), f"{type(e).__name__}: {e}")
        raise
    mark_serving(client, model_name, gateway_name(serve))
    _retire_unhashed_app(serve, model_name)
    return Reconciled(
        app_name=app_name,
        url=endpoint_url(serve),
        champion=champion,
        removed=stale,
        orphaned=[v for v in stale if current is not None and v == current.get("challenger")],
        action=action + (f"; removed {', '.join('v' + v for v in stale)}" if stale else ""),
    )


def _refuse_another_models(app_name: str, state: dict[str, Any] | None, model_name: str) -> None:
    """EndpointConflict when the application's router serves another model: acting on it would replace that model's
    versions with this one's, or delete them (serve.app_name set to another model's application, or a model whose
    name is another's application name with its hash)."""
    other = ((state or {}).get("config") or {}).get("model_name")
    if other is not None and other != model_name:
        raise EndpointConflict(
            f"application {app_name!r} serves model {other!r}, not registry.model_name={model_name!r}; "
            "set serve.app_name to an application of its own"
        )


def _serve_champion(
    spec: AppSpec,
    serve: ServeConfig,
    current: dict[str, Any] | None,
    existing: list[str],
    runtime_env: dict[str, Any] | None,
    token_sha256: str,
) -> str:
    """Deploy the champion-only spec unless it already runs, with the gateway in front; what was done."""
    app_name, champion = spec.app_name, spec.versions[0]
    holder = prefix_holder(serve)  # an application of an older shardline, routed itself, moves behind the gateway
    if current == spec.router.model_dump() and existing == [champion] and holder != app_name:
        action = "already serving the champion"
    else:
        apply(spec, serve, runtime_env)
        action = f"serving v{champion} at 100%"
    if holder is not None and holder.startswith(GATEWAY_APP):
        # the gateway of an older shardline on this prefix, named before a prefix changed by serve_safe got its
        # hash: it gives the prefix up to this one's (the models behind it move as each is reconciled)
        from ray import serve as rs

        log.warning("replacing %s on %s by %s", holder, serve.route_prefix, gateway_name(serve))
        rs.delete(holder, _blocking=True)
    elif holder is not None and holder != app_name:
        _move_behind_gateway(holder, serve, spec.tracking_uri, runtime_env)
    ensure_gateway(serve, token_sha256, runtime_env)
    return action


def unanswering_holder(serve: ServeConfig, app_name: str) -> EndpointConflict:
    """The conflict of a shardline application holding the route prefix whose router does not answer, naming the
    command that removes it."""
    return EndpointConflict(
        f"serve.route_prefix={serve.route_prefix}: held by {app_name!r}, whose router does "
        "not answer; remove it with `shardline serve --stop` for its model"
    )


def _move_behind_gateway(
    app_name: str, serve: ServeConfig, tracking_uri: str, runtime_env: dict[str, Any] | None
) -> None:
    """Redeploy another model's application, as it is, without a route of its own (it was deployed by a shardline
    from before the gateway). Its models are assumed to be in this stack's registry, `tracking_uri`."""
    state = read_state(app_name)
    if state is None or not state.get("config"):
        raise unanswering_holder(serve, app_name)
    log.info("moving %s behind the gateway", app_name)
    router = RouterConfig.model_validate(state["config"]).model_copy(update={"gateway": gateway_name(serve)})
    apply(
        AppSpec(app_name=app_name, tracking_uri=tracking_uri, versions=served_versions(app_name), router=router),
        serve,
        runtime_env,
    )


def _retire_unhashed_app(serve: ServeConfig, model_name: str) -> bool:
    """Delete this model's application under the name an older shardline gave it, 'shardline-' and its name with
    the characters Serve dislikes replaced but no hash (serve_build.app_name_for), when its router serves this
    model: the gateway would see the model twice. Another model's application of that name is left alone."""
    from ray import serve as rs

    old = MODEL_APP_PREFIX + sanitised(model_name)
    if serve.app_name or old == app_name_for(serve, model_name):
        return False
    state = read_state(old)
    if state is None or (state.get("config") or {}).get("model_name") != model_name:
        return False
    log.info("removing %s, %s's application under its name before the hash", old, model_name)
    rs.delete(old, _blocking=True)
    return True


def remove(serve: ServeConfig, model_name: str) -> bool:
    """Delete this model's application, and the gateway once no model is left behind it (never Serve itself, an
    application shardline did not start, or one whose router serves another model: EndpointConflict)."""
    from ray import serve as rs

    app_name = app_name_for(serve, model_name)
    drop_stale_serve_client()
    retired = _retire_unhashed_app(serve, model_name)
    if app_name not in rs.status().applications:
        if retired:
            remove_gateway_if_unused(serve)
        return retired
    _refuse_another_models(app_name, read_state(app_name), model_name)
    rs.delete(app_name, _blocking=True)
    remove_gateway_if_unused(serve)
    return True
