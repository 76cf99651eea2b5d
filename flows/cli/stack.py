"""`shardline up`, `shardline down`, `shardline status`: the local service stack (flows/stack)."""

from __future__ import annotations

import argparse
import json
import sys

from flows.config import ConfigError, load_stack_config
from infra.redact import redact

FLAG_KEYS = {"backend": "backend", "host": "host", "prefect_port": "prefect_port", "mlflow_port": "mlflow_port"}


def _configs(args: argparse.Namespace, probe_endpoint: bool = False):
    overrides = list(args.set)
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag, None)
        if value is not None:
            # a JSON string is a TOML basic string: a backslash or a quote in the flag stays what was typed
            overrides.append(
                f"stack.{key}={json.dumps(value, ensure_ascii=False)}"
                if isinstance(value, str)
                else f"stack.{key}={value}"
            )
    return load_stack_config(args.config, overrides, probe_endpoint)


def summary_lines(status: dict) -> list[str]:
    """Where to look, what to curl and how to stop: the end of `up` and of `make demo`."""
    lines = []
    labels = {
        "prefect": ("Prefect UI", "ui"),
        "mlflow": ("MLflow UI", None),
        "ray": ("Ray dashboard", None),
        "endpoint": ("model endpoint", None),
        "prometheus": ("Prometheus", None),
    }
    for name, (label, key) in labels.items():
        part = status.get(name)
        if part:
            lines.append(f"  {label:<15} {part.get(key) if key else part['url']}")
    if status.get("ray"):  # the dashboard opens on a token prompt: where the token is, never the token itself
        from flows.stack.ray_token import token_hint

        lines.append(f"  ray dashboard token: {token_hint()}")
    if status.get("prometheus"):
        lines.append(
            f"  Grafana:        import infra/grafana/shardline.json (datasource: {status['prometheus']['url']})"
        )
    endpoint = status.get("endpoint")
    if endpoint:
        lines.append(
            f"  try:            curl -s -X POST {endpoint['url']}/v1/completions "
            '-H \'content-type: application/json\' -d \'{"prompt": "def ", "max_tokens": 32}\''
        )
    lines.append("  stop it all:    shardline down")
    return lines


def _cmd_up(args: argparse.Namespace) -> int:
    from flows.stack.postgres import BackendError
    from flows.stack.procs import StackError
    from flows.stack.stack import status, up
    from flows.stack.state import StackBusy

    try:
        stack_cfg, pipeline_cfg = _configs(args, probe_endpoint=True)
    except ConfigError as e:
        print(f"shardline: {redact(e)}", file=sys.stderr)
        return 2
    print("shardline up:", flush=True)
    try:
        up(stack_cfg, pipeline_cfg, say=lambda line: print(line, flush=True))
    except (StackBusy, BackendError) as e:  # nothing started: no note about what is recorded
        print(f"shardline: {redact(e)}", file=sys.stderr)
        return 1
    except StackError as e:
        print(f"shardline: {redact(e)}\n  (what did start is recorded; `shardline down` stops it)", file=sys.stderr)
        return 1
    print("\n".join(summary_lines(status())), flush=True)
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from flows.stack.procs import StackError
    from flows.stack.stack import down

    try:
        _, pipeline_cfg = _configs(args)
    except ConfigError as e:
        print(f"shardline: {redact(e)}", file=sys.stderr)
        return 2
    print("shardline down:", flush=True)
    try:
        down(pipeline_cfg, say=lambda line: print(line, flush=True))
    except StackError as e:
        print(f"shardline: {redact(e)}", file=sys.stderr)
        return 1
    return 0


def models_report(report: dict) -> dict:
    """What the endpoint serves ({model: champion}) and the registry's champions it does not serve, with why
    ({model: reason}); {} when the endpoint or MLflow is not up."""
    import httpx

    endpoint, mlflow = report.get("endpoint") or {}, report.get("mlflow") or {}
    if not endpoint.get("up"):
        return {}
    try:
        served = httpx.get(f"{endpoint['url']}/healthz", timeout=10).json().get("models", {})
    except (httpx.HTTPError, ValueError):
        served = {}
    not_served = {}
    if mlflow.get("up"):
        from deployments.registry import client_for, served_champions

        for model, want in served_champions(client_for(mlflow["url"])).items():
            if served.get(model) != want["champion"]:
                not_served[model] = f"v{want['champion']} is champion but not served: " + (
                    want["error"] or f"no application; `shardline serve --set registry.model_name={model}` serves it"
                )
    return {"models": served, "not_served": not_served}


def _cmd_status(args: argparse.Namespace) -> int:
    from flows.stack.stack import status

    report = status()
    if report.get("endpoint"):
        report["endpoint"] |= models_report(report)
    if args.json:
        print(json.dumps(report), flush=True)
    elif not report:
        print("no stack is recorded here; start one with `shardline up`")
    else:
        for name, part in report.items():
            pids = ",".join(str(p) for p in part["pids"]) or "-"
            print(f"  {name:<9} {'up' if part['up'] else 'DOWN':<5} {part['url'] or '-':<45} pids {pids}")
        endpoint = report.get("endpoint") or {}
        if endpoint.get("up"):
            models = ", ".join(f"{m} v{v}" for m, v in sorted(endpoint.get("models", {}).items()))
            print(f"  models    {models or 'waiting for a first model'}")
            for model, why in sorted(endpoint.get("not_served", {}).items()):
                print(f"  NOT SERVED {model}: {why}")
        print("\n".join(summary_lines(report)))
    # like a service manager's status: 0 only when a stack is recorded and every part of it answers
    return 0 if report and all(p["up"] for p in report.values()) else 1


def add_stack_commands(sub: argparse._SubParsersAction) -> None:
    """Register `up`, `down` and `status` on the `shardline` parser."""
    up = sub.add_parser("up", help="start the local stack: Prefect, MLflow, worker, Ray head, endpoint")
    down = sub.add_parser("down", help="stop exactly what `shardline up` started")
    for p in (up, down):
        p.add_argument("--config", metavar="FILE.toml", help="a config file; its [stack] table configures `up`")
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            help="override a value, e.g. --set stack.prefect_port=4300 (repeatable)",
        )
    up.add_argument("--backend", help="postgresql://USER@HOST:PORT/NAME for MLflow and Prefect (stack.backend)")
    up.add_argument("--host", help="address the services bind to (stack.host)")
    up.add_argument("--prefect-port", type=int, help="Prefect server port (stack.prefect_port)")
    up.add_argument("--mlflow-port", type=int, help="MLflow server port (stack.mlflow_port)")
    up.set_defaults(func=_cmd_up)
    down.set_defaults(func=_cmd_down)
    status = sub.add_parser("status", help="each part of the stack: up or down, URL, PIDs")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=_cmd_status)
