"""What serving needs from its surroundings: the API token, the code shipped to replicas, and `shardline serve`.

`serve_up` connects to (or starts) the configured cluster and reconciles the model's application to the registry;
`serve_down` removes that application and the local head shardline started, and nothing else.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from typing import Any

from deployments.config import ServeConfig
from deployments.http_io import TOKEN_SPACE

log = logging.getLogger(__name__)


def api_token(serve: ServeConfig) -> str:
    """The bearer token guarding the API: from the Prefect Secret block named by serve.auth_secret_block, else
    the environment variable serve.auth_token_env; "" = no auth. Never logged: replicas only get its sha256."""
    if serve.auth_secret_block:
        from prefect.blocks.system import Secret

        token = str(Secret.load(serve.auth_secret_block).get())  # type: ignore[union-attr]  # sync: not a coroutine
    else:
        token = os.environ.get(serve.auth_token_env, "") if serve.auth_token_env else ""
    # ASCII whitespace around it is not the token (a Kubernetes secret made `--from-file` ends in a newline): the
    # replicas' digest and the canary's own requests use it without (a header cannot carry the newline)
    return token.encode().strip(TOKEN_SPACE).decode() or token


def token_digest(token: str) -> str:
    """The sha256 replicas compare a request's bearer token with ("" = no auth), of its UTF-8 bytes without
    surrounding ASCII whitespace, as check_token reads a client's; a token that is only whitespace still requires
    one, which nothing matches: it fails closed."""
    if not token:
        return ""
    raw = token.encode()
    return hashlib.sha256(raw.strip(TOKEN_SPACE) or raw).hexdigest()


def replica_runtime_env(cluster_mode: str) -> dict[str, Any] | None:
    """How replicas get shardline's code: from the installed environment on the local head (same venv); on a
    cluster whose nodes may not have it (local-multinode, remote), the `py_modules` this driver's job uploaded
    (infra.cluster.code_runtime_env): Serve's controller cannot upload a driver's local folders itself."""
    if cluster_mode == "local":
        return None
    import ray

    uploaded = ray.get_runtime_context().runtime_env.get("py_modules")
    return {"py_modules": list(uploaded)} if uploaded else None


def serve_up(config: Any, wait_for_lock_s: float = 5.0) -> dict[str, Any]:
    """Start or attach to the model's application on the configured cluster; serve the registry's champion.

    When another run's canary holds the model's release lock, the application is left as it is (that run
    owns it right now) and `reconciled` is False.

    Returns:
        {"url", "app", "champion", "action", "ray_address", "dashboard_url", "reconciled"}.
    """
    from deployments.endpoint import endpoint_url, read_state, reconcile, start_proxy
    from deployments.gateway_control import ensure_gateway
    from deployments.registry import client_for
    from deployments.release_lock import LockTimeout, release_lock
    from deployments.rollout import tag_abandoned
    from deployments.serve_build import app_name_for
    from infra.cluster import provision
    from infra.tracking import resolve_tracking_uri

    tracking_uri = resolve_tracking_uri(config.registry.tracking_uri)
    cluster = provision(config.cluster)
    token = token_digest(api_token(config.serve))
    env = replica_runtime_env(config.cluster.mode)
    name = config.registry.model_name
    try:
        with release_lock(name, tracking_uri, wait_for_lock_s):
            done = reconcile(config.serve, name, tracking_uri, token, env)
            tag_abandoned(client_for(tracking_uri), name, done.orphaned)  # not a replaced champion: never canaried
            start_proxy(config.serve)
            if done.champion is None:  # the gateway answers "waiting for a first model" until there is one
                ensure_gateway(config.serve, token, env)
            out = {
                "url": done.url or endpoint_url(config.serve),
                "champion": done.champion,
                "action": done.action,
                "reconciled": True,
            }
    except LockTimeout:
        state = read_state(app_name_for(config.serve, name))
        out = {
            "url": endpoint_url(config.serve),
            "champion": state["config"]["champion"] if state else None,
            "action": "a release of this model is in progress; left as it is",
            "reconciled": False,
        }
    others = reconcile_others(config.serve, name, tracking_uri, token, env)
    return {
        **out,
        "app": app_name_for(config.serve, name),
        "ray_address": cluster.gcs_address or cluster.address,
        "dashboard_url": cluster.dashboard_url,
        "others": others,
    }


def reconcile_others(
    serve: ServeConfig, skip: str, tracking_uri: str, token_sha256: str, runtime_env: dict[str, Any] | None
) -> dict[str, str]:
    """Serve the champion of every other model this gateway serves (per the registry) where it is not served: a
    release that failed after promotion left it so. Models whose release is in progress are left to it.

    Returns:
        model name -> what was done, or the one-line reason it still is not served.
    """
    from deployments.endpoint import EndpointError, read_state, reconcile
    from deployments.gateway_control import EndpointConflict, gateway_name
    from deployments.registry import client_for, served_champions
    from deployments.release_lock import LockTimeout, release_lock
    from deployments.serve_build import app_name_for

    plain = serve.model_copy(update={"app_name": ""})  # serve.app_name names this run's model's application only
    out = {}
    for model, want in served_champions(client_for(tracking_uri), gateway_name(serve)).items():
        state = read_state(app_name_for(plain, model))
        if model == skip or (state is not None and state["config"]["champion"] == want["champion"]):
            continue
        try:
            with release_lock(model, tracking_uri, 0.5):
                out[model] = reconcile(plain, model, tracking_uri, token_sha256, runtime_env).action
        except LockTimeout:
            out[model] = "a release of this model is in progress; left as it is"
        except (EndpointError, EndpointConflict) as e:
            out[model] = f"not served: {type(e).__name__}: {str(e).splitlines()[0]}"
    return out


def serve_down(config: Any, wait_for_lock_s: float = 5.0) -> dict[str, Any]:
    """Remove the model's application; stop the local Ray head if this $SHARDLINE_HOME started one.

    On a remote cluster only the application is removed: Serve itself and other applications stay. The model is
    no longer marked as served in the registry, or the next `shardline serve` of another model would serve it
    again (reconcile_others); a registry that does not answer leaves the mark (`unmarked` False, a warning).
    Both under the model's release lock: a canary or promotion in progress owns the application (removing it
    mid-ramp would fail that release on an application that vanished, or be undone by its promotion). A lock whose
    store does not answer (the Prefect server or PostgreSQL down) is warned about and the stop goes on without it:
    `--stop` must work when the stack around it is down, and it stops the local Ray head either way.

    Raises:
        EndpointError: a release of the model holds its lock beyond `wait_for_lock_s`; nothing was removed.
    """
    from deployments.endpoint import EndpointError
    from deployments.http_io import failure_line
    from deployments.release_lock import LockTimeout, release_lock
    from infra.head import read_head, stop_head
    from infra.tracking import resolve_tracking_uri

    name = config.registry.model_name
    removed = False
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(release_lock(name, resolve_tracking_uri(config.registry.tracking_uri), wait_for_lock_s))
        except LockTimeout:
            raise EndpointError(
                f"a release of {name} is in progress (its canary or promotion); try again when it ends"
            ) from None
        except Exception as e:  # noqa: BLE001 - the lock's store (Prefect, PostgreSQL) down: stopping must still work
            log.warning("stopping %s without its release lock: its store did not answer (%s)", name, failure_line(e))
        if config.cluster.mode == "remote" or read_head() is not None:
            import ray

            from deployments.endpoint import remove
            from infra.cluster import provision, teardown

            info = provision(config.cluster) if not ray.is_initialized() else None
            try:
                removed = remove(config.serve, name)
            finally:
                if info is not None:  # only the connection made here: a caller's own stays (and its cluster)
                    teardown(info)
        unmarked = _unmark(config)
    head_stopped = stop_head() if config.cluster.mode != "remote" else False
    return {"app_removed": removed, "head_stopped": head_stopped, "unmarked": unmarked}


def _unmark(config: Any) -> bool:
    """Drop the model's served-by mark; False when the registry did not answer (logged with why: the application is
    removed all the same, and `shardline serve --stop` again drops the mark once it answers)."""
    from deployments.registry import client_for, unmark_serving
    from infra.redact import first_line
    from infra.tracking import resolve_tracking_uri

    name = config.registry.model_name
    try:
        unmark_serving(client_for(resolve_tracking_uri(config.registry.tracking_uri)), name)
    except Exception as e:  # noqa: BLE001 - the registry down: removing the application still stands
        log.warning(
            "%s stays marked as served in the registry (%s: %s): the next `shardline serve` of another model "
            "serves it again; run `shardline serve --stop` again once the registry answers",
            name,
            type(e).__name__,
            first_line(e),
        )
        return False
    return True
