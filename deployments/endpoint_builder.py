"""Serve application builder for declarative deployments (KubeRay RayService `serveConfigV2`, `serve deploy`).

`import_path: deployments.endpoint_builder:app` with `args: {model_name, tracking_uri, serve}` builds the same
application `shardline serve` deploys, serving the registry's champion at 100%.
"""

from __future__ import annotations

import os
from typing import Any

from deployments.config import ServeConfig


def app(args: dict[str, Any]) -> Any:
    """The endpoint application of `args['model_name']`'s champion in the registry at `args['tracking_uri']`.

    Raises:
        ValueError: args lack model_name, or the model has no champion yet (nothing to serve).
    """
    from deployments.registry import CHAMPION, client_for, read_aliases
    from deployments.serve_build import AppSpec, app_name_for, build_app, router_config
    from deployments.serving import api_token, token_digest
    from infra.tracking import resolve_tracking_uri

    if not args.get("model_name"):
        raise ValueError("serve config args: model_name is required")
    serve = ServeConfig.model_validate(args.get("serve", {}))
    name = str(args["model_name"])
    tracking_uri = resolve_tracking_uri(str(args.get("tracking_uri", "") or os.environ.get("MLFLOW_TRACKING_URI", "")))
    champion = read_aliases(client_for(tracking_uri), name).get(CHAMPION)
    if champion is None:
        raise ValueError(f"{name} has no champion in the registry at {tracking_uri}: nothing to serve")
    spec = AppSpec(
        app_name=app_name_for(serve, name),
        tracking_uri=tracking_uri,
        versions=[champion],
        router=router_config(serve, name, champion, token_digest(api_token(serve))),
    )
    return build_app(spec, serve)
