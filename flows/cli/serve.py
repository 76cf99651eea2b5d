"""`shardline serve`: start (or attach to) the model's live endpoint and print its URL; `--stop` removes it."""

from __future__ import annotations

import argparse
import json

from deployments.serving import serve_down, serve_up

__all__ = ["add_parser", "serve_down", "serve_up"]


def _cmd_serve(args: argparse.Namespace) -> int:
    from flows.cli._utilities import config_or_none, exit_with_error
    from infra.redact import first_line

    config = config_or_none(args, probe_endpoint=not args.stop)  # removing it works whatever holds the port
    if config is None:
        return 2
    from deployments.endpoint import EndpointError
    from infra.cluster import ClusterError, teardown

    try:
        out = serve_down(config) if args.stop else serve_up(config)
    except (ClusterError, EndpointError, OSError) as e:
        return exit_with_error(f"serve: {type(e).__name__}: {first_line(e)}")
    finally:
        teardown(None)
    if args.json:
        print(json.dumps(out), flush=True)
    elif args.stop:
        print(
            f"application removed: {out['app_removed']}; local Ray head stopped: {out['head_stopped']}; "
            f"unmarked as served in the registry: {out['unmarked']}"
        )
    elif out["champion"] is None:
        print(f"{config.registry.model_name} has no champion yet: nothing to serve (run the pipeline first)")
    else:
        print(f"{out['app']} serves {config.registry.model_name} v{out['champion']} at {out['url']} ({out['action']})")
        print(
            f"  curl -s {out['url']}/v1/completions -H 'content-type: application/json' "
            '-d \'{"prompt": "def main():", "max_tokens": 32}\''
        )
        if out.get("dashboard_url"):
            print(f"  Ray dashboard: {out['dashboard_url']}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="start or attach to the live endpoint of the registry's champion")
    serve.add_argument("--config", metavar="FILE.toml", help="pipeline config (its [serve], [cluster], [registry])")
    serve.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one config value (repeatable)"
    )
    serve.add_argument(
        "--stop", action="store_true", help="remove this model's application (and the local Ray head shardline started)"
    )
    serve.add_argument("--json", action="store_true", help="print one JSON object")
    serve.set_defaults(func=_cmd_serve)
