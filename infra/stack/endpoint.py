"""The endpoint part: the model's Ray Serve application (flows.cmd_serve), serving the registry's champion."""
from __future__ import annotations

from infra.stack.procs import http_ok
from infra.stack.state import PartState


def start(config, recorded: PartState | None) -> PartState:
    """Start (or attach to) the serving app on the stack's Ray head; `config` is the PipelineConfig."""
    from flows.cmd_serve import serve_up

    serve = getattr(config, "serve", None)
    known = f"http://{serve.host}:{serve.port}" if serve is not None else (recorded.url if recorded else "")
    was_serving = bool(known) and http_ok(f"{known}/healthz")
    info = serve_up(config)
    url = str(info["url"]).rstrip("/")
    # Ours if this stack started it earlier, or if nothing served there before this call.
    started = (recorded is not None and recorded.started_by_us) or not was_serving
    return PartState(name="endpoint", url=url, started_by_us=started,
                     detail={"app": str(info.get("app", "")), "health_url": f"{url}/healthz"})


def stop(part: PartState, config) -> bool:
    """Remove the serving app when this stack started it (never another application)."""
    if not part.started_by_us:
        return False
    from flows.cmd_serve import serve_down

    serve_down(config)
    return True
