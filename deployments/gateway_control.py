"""The gateway's control side: its name, deploying it, and who holds the route prefix and the port.

One gateway application per route prefix serves every model's application (which have no route of their own).
Before anything trains, `check_endpoint_free` asks whoever listens on the endpoint's address over HTTP: nothing,
Ray Serve with the prefix free or held by shardline, are fine; a prefix held by an application shardline did not
start, or a port held by a process that is not Ray Serve, is an EndpointConflict (a config error, never retried).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from deployments.config import ServeConfig
from infra.cluster import release_serve_handles

log = logging.getLogger(__name__)
QUIET = {"log_level": "WARNING", "enable_access_log": False}  # a line per request would flood every log
# serve.run is not thread-safe within one driver (two threads deploying at once race in cloudpickle's
# pickle-by-value registry: "module ... is not registered for pickle by value"); deploys of one process take turns
SERVE_RUN_LOCK = threading.Lock()
PICKLE_RACE = "is not registered for pickle by value"  # the same race with a thread of Ray's own: deploy again
PICKLE_RACE_TRIES = 5
MODEL_APP_PREFIX = "shardline-"
GATEWAY_APP = "shardline-gateway"
GATEWAY_ROOTS = ("deployments/gateway.py",)  # the gateway's code version follows its imports (code_files.py)
# requests past what the gateway holds that Ray still lets reach it, so that it refuses them itself (Gateway._admit)
OVERFLOW = 1024


class EndpointConflict(ValueError):
    """The endpoint's route prefix or port is held by something shardline did not start (one line; not retried)."""


def serve_safe(name: str) -> str:
    """`name` with the characters Serve dislikes in an application's name replaced, and, where that changed it,
    a short hash of `name` appended: 'team.gpt' and 'team gpt' would both read 'team-gpt', the name of another
    model (the route prefixes '/a/b' and '/a-b' likewise), and each would take over or delete the other's
    application. A name that needed no change is kept as it is, as shardline always named it."""
    safe = sanitised(name)
    return safe if safe == name else f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def sanitised(name: str) -> str:
    """`name` with every character Serve dislikes in an application's name replaced by '-' (how shardline named
    applications before serve_safe added its hash)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", name)


def gateway_name(serve: ServeConfig) -> str:
    """'shardline-gateway' on the prefix '/', 'shardline-gateway-<prefix>' on another (serve_safe: '/' within a
    prefix adds a hash)."""
    prefix = serve.route_prefix.strip("/")
    return GATEWAY_APP + ("-" + serve_safe(prefix) if prefix else "")


def is_shardline_app(name: str) -> bool:
    return name.startswith(MODEL_APP_PREFIX)


def check_endpoint_free(serve: ServeConfig, timeout_s: float = 3.0) -> None:
    """EndpointConflict when the endpoint's address cannot host shardline's gateway; nothing when it can.

    Asks over HTTP, so it needs no connection to Ray: Serve's proxy answers GET /-/routes with {prefix: app}.
    """
    import httpx

    base = (
        serve.public_url.rstrip("/").removesuffix(serve.route_prefix.rstrip("/"))
        if serve.public_url
        else f"http://{serve.host if serve.host not in ('0.0.0.0', '::') else '127.0.0.1'}:{serve.port}"
    )
    if serve.port == 0 and not serve.public_url:
        return
    try:
        r = httpx.get(f"{base}/-/routes", timeout=timeout_s)
    except httpx.HTTPError:
        return  # nothing answers: Serve's proxy will bind it (or a remote cluster is not up yet)
    if r.status_code == 503:
        return  # Serve's proxy before its route table is ready (no application yet): the gateway will be the first
    try:
        routes = r.json()
    except ValueError:
        routes = None
    if r.status_code != 200 or not isinstance(routes, dict):
        raise EndpointConflict(
            f"serve.port={serve.port}: {base} is held by another process that is not Ray "
            f"Serve (GET /-/routes answered {r.status_code}); set serve.port to a free port"
        )
    holder = routes.get(serve.route_prefix)
    if holder is not None and holder != gateway_name(serve) and not is_shardline_app(str(holder)):
        raise EndpointConflict(
            f"serve.route_prefix={serve.route_prefix}: held by application {holder!r} on {base}, "
            "which shardline did not start; set serve.route_prefix to a free prefix"
        )


def drop_stale_serve_client() -> None:
    """Forget Ray Serve's cached controller client when it belongs to a Ray cluster this driver has left.

    Serve keeps its client across `ray.shutdown()` and tells a stale one by the driver's job id, but the first
    driver of every new local cluster has the same job id (01000000): after a driver reconnects to another
    cluster in the same process, `serve.status()` and friends would call a controller that is not there. Submitting
    a call to it fails at once in that case (the actor is from another cluster); nothing is waited for.
    """
    from ray.serve import context

    client = context._global_client
    if client is None:
        return
    try:
        client._controller.check_alive.remote()
    except Exception:  # noqa: BLE001 - "Can't find actor ... from a different cluster": rediscover it by name
        release_serve_handles()  # the old client's handles too: their metrics threads would outlive it


def prefix_holder(serve: ServeConfig) -> str | None:
    """The application holding the gateway's route prefix on the connected cluster, None when it is free.

    Raises:
        EndpointConflict: an application shardline did not start holds it.
    """
    from ray import serve as rs
    from ray.serve.context import _get_global_client

    drop_stale_serve_client()
    try:
        client = _get_global_client()
        details = client.get_serve_details() if client is not None else {}
    except rs.exceptions.RayServeException:
        return None  # Serve is not running yet
    for name, app in (details.get("applications") or {}).items():
        if app.get("route_prefix") == serve.route_prefix and name != gateway_name(serve):
            if not is_shardline_app(name):
                raise EndpointConflict(
                    f"serve.route_prefix={serve.route_prefix}: held by application {name!r}, "
                    "which shardline did not start; set serve.route_prefix to a free prefix"
                )
            return str(name)
    return None


def serve_run(build: Callable[[], Any], name: str, route_prefix: str | None) -> None:
    """`serve.run(build(), ...)` without blocking, in turn with this process's other deploys (SERVE_RUN_LOCK).

    Building a deployment's options and serve.run both register modules with cloudpickle by value and unregister
    them after; a thread of Ray's own (a handle's long-poll applying a deployment config) does the same, and
    whichever unregisters second raises PICKLE_RACE. That is a client-side race, not the application's failure:
    build and deploy again (serve.run is declarative, so a repeat is harmless). Other errors propagate.
    """
    from ray import serve as rs

    for attempt in range(PICKLE_RACE_TRIES):
        try:
            with SERVE_RUN_LOCK:
                rs.run(build(), name=name, route_prefix=route_prefix, blocking=False, logging_config=QUIET)
            return
        except Exception as e:  # noqa: BLE001 - Serve raises RuntimeError/ValueError; only the race is retried
            if PICKLE_RACE not in str(e) or attempt == PICKLE_RACE_TRIES - 1:
                raise
            log.warning("deploying %s raced with another thread's pickling; deploying again", name)
            time.sleep(0.05 * (attempt + 1))


def ensure_gateway(
    serve: ServeConfig, token_sha256: str, runtime_env: dict[str, Any] | None, timeout_s: float = 120.0
) -> str:
    """Deploy (or update by a lightweight config change) the gateway on serve.route_prefix; its app name.

    The route prefix must be free of other applications (endpoint.reconcile moves an older shardline model
    application off it first).
    """
    from ray import serve as rs

    from deployments.gateway import FORWARDING, Gateway, GatewayConfig

    name = gateway_name(serve)
    want = GatewayConfig(
        default_model=serve.default_model,
        max_request_bytes=serve.max_request_bytes,
        max_queued_requests=serve.max_queued_requests,
        body_timeout_s=serve.body_timeout_s,
        token_sha256=token_sha256,
        settings=gateway_settings(serve),
    ).model_dump()
    if _gateway_config(name) == want:
        return name

    def build() -> Any:
        gateway: Any = rs.deployment(Gateway)  # a Deployment (Ray's overloads type the decorator form)
        deployment = gateway.options(
            name="gateway",
            num_replicas=serve.gateway_replicas,
            ray_actor_options={"num_cpus": serve.router_cpus, "runtime_env": dict(runtime_env or {})},
            user_config=want,
            # the gateway queues and refuses (Gateway._admit: OpenAI's error object); Ray takes in OVERFLOW more
            # than it holds so that they reach it, and its proxy's own plain-text 503 only answers past that. The
            # proxy counts a request as queued until it has picked a replica for it, which a burst outruns: its
            # queue is as deep as what the replica may hold, or it refuses requests the gateway had room for
            max_ongoing_requests=FORWARDING + serve.max_queued_requests + OVERFLOW,
            max_queued_requests=FORWARDING + serve.max_queued_requests + OVERFLOW,
            backpressure_config={"status_code": 503, "retry_after_s": 1},
        )
        deployment._version = _gateway_version()  # fixed: a config change is a lightweight update (endpoint._pinned)
        return deployment.bind(name)

    serve_run(build, name, serve.route_prefix)
    deadline = time.monotonic() + timeout_s
    while _gateway_config(name) != want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"gateway {name} did not take its config in {timeout_s} s")
        time.sleep(0.2)
    return name


def gateway_settings(serve: ServeConfig) -> str:
    """The gateway's deploy-time options (replicas, queue, CPUs) and its code, hashed into its config: a change to any
    of them alone redeploys the gateway rather than being skipped as "already up to date"."""
    import hashlib

    fixed = serve.model_dump_json(include={"gateway_replicas", "max_queued_requests", "router_cpus"})
    return hashlib.sha256(f"{fixed}:{_gateway_version()}".encode()).hexdigest()[:12]


def _gateway_version() -> str:
    """The gateway's code: its module and every project file it imports (deployments/code_files.py)."""
    from deployments.code_files import code_hash

    return code_hash(GATEWAY_ROOTS)


def _gateway_config(name: str) -> dict[str, Any] | None:
    from ray import serve as rs

    try:
        if name not in rs.status().applications:
            return None
        return rs.get_deployment_handle("gateway", name).get_config.remote().result(timeout_s=30)
    except Exception as e:  # noqa: BLE001 - a gateway starting or being deleted reads as "not there"
        log.debug("reading gateway %s: %s", name, e)
        return None


def remove_gateway_if_unused(serve: ServeConfig) -> bool:
    """Delete the gateway when no shardline model application is left behind it."""
    from ray import serve as rs

    apps = rs.status().applications
    name = gateway_name(serve)
    if name not in apps or any(is_shardline_app(a) and a != name and not a.startswith(GATEWAY_APP) for a in apps):
        return False
    rs.delete(name, _blocking=True)
    return True
