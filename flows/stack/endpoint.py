"""The endpoint part: the stack's gateway and the model's Ray Serve application (deployments.serving), serving the
registry's champion."""

from __future__ import annotations

from flows.stack.procs import http_ok
from flows.stack.state import PartState


def start(config, recorded: PartState | None) -> PartState:
    """Start (or attach to) the serving app on the stack's Ray head; `config` is the PipelineConfig."""
    from deployments.serving import serve_up
    from infra.cluster import teardown

    known = f"http://{config.serve.host}:{config.serve.port}"
    was_serving = http_ok(f"{known}/-/healthz")

    try:
        info = serve_up(config)
    finally:
        teardown(None)  # this command only drove the cluster; the head and the app stay up
    url = str(info["url"]).rstrip("/")
    # Ours if this stack started it earlier, or if nothing served there before this call.
    started = (recorded is not None and recorded.started_by_us) or not was_serving
    # Up means Serve's HTTP proxy answers; before the first champion there is no application behind it yet.
    return PartState(
        name="endpoint",
        url=url,
        started_by_us=started,
        detail={
            "app": str(info.get("app", "")),
            "champion": str(info.get("champion") or "none yet"),
            "health_url": f"{url}/-/healthz",
        },
    )


def stop(part: PartState, config) -> bool:
    """Remove the serving app when this stack started it (never another application, never Serve itself).

    The Ray head is the `ray` part's to stop (only if this stack started it), so `serve_down`, which also stops
    the head, is not what is called here. With no local head running the app is gone with it: nothing is removed,
    and no head is started to find that out (provision would start one).
    """
    if not part.started_by_us:
        return False
    import ray

    from deployments.endpoint import remove
    from infra.cluster import provision, teardown
    from infra.head import read_head

    if not ray.is_initialized() and config.cluster.mode != "remote" and read_head() is None:
        return False
    info = provision(config.cluster) if not ray.is_initialized() else None
    try:
        return bool(remove(config.serve, config.registry.model_name))
    finally:
        teardown(info)
