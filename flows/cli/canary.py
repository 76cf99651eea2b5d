"""`shardline canary status|pause|resume|promote|abort`: operator control of a model's live canary.

The command talks only to MLflow (deployments/canary_control: the challenger version's tags), so it works from
any machine that reaches the tracking server, while the canary's driver runs wherever its flow runs.
Exit codes: 0 done; 1 refused (no canary running, or a state the action does not apply to) or MLflow failed;
2 a bad argument or config.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from flows.cli._utilities import answer_quickly, exit_with_error

ACTIONS = ("status", "pause", "resume", "promote", "abort")
DONE = {"pause": "paused", "resume": "resumed", "promote": "promoted", "abort": "aborted"}


def describe(status: Any) -> str:
    """One line per canary state, for people."""
    if status.state == "none":
        last = (
            f"; v{status.challenger_version}'s canary ended {status.last_verdict}: {status.last_reason}"
            if status.last_verdict
            else ""
        )
        champion = f"champion v{status.champion_version}" if status.champion_version else "no champion version"
        return f"{status.model}: no canary running; {champion}{last}"
    line = (
        f"{status.model}: {status.state} at {status.percent}% (step {status.step} of {status.steps}), "
        f"champion v{status.champion_version}, challenger v{status.challenger_version}, mode {status.mode}, "
        f"canary {status.canary_id}"
    )
    if status.state == "awaiting-approval" and status.approval_deadline:
        line += f"; rolls back in {max(0.0, status.approval_deadline - time.time()):.0f} s unless promoted"
    if status.state == "paused" and status.pause_deadline:
        line += f"; rolls back in {max(0.0, status.pause_deadline - time.time()):.0f} s unless resumed"
    return line


def canary_command(
    action: str,
    model_name: str,
    tracking_uri: str,
    reason: str = "",
    as_json: bool = False,
    wait_s: float = 60.0,
    user: str = "",
) -> int:
    """Run one `shardline canary` action against the registry at `tracking_uri`; prints, returns the exit code."""
    if missing := missing_store(tracking_uri):
        return exit_with_error(f"canary {action}: {missing}", code=2)
    from mlflow.exceptions import MlflowException

    from deployments.canary_control import CommandRefused, read_status, send_command
    from deployments.registry import client_for

    client = client_for(tracking_uri)
    try:
        if action == "status":
            status = read_status(client, model_name)
            print(status.model_dump_json() if as_json else describe(status), flush=True)
            return 0
        command, status = send_command(client, model_name, action, reason, user, wait_s)
    except CommandRefused as e:
        return exit_with_error(f"canary {action}: {e}")
    except MlflowException as e:
        return exit_with_error(f"canary {action}: MLflow: {str(e.message).splitlines()[0]}")
    if as_json:
        print(
            json.dumps({"command": command.model_dump(mode="json"), "status": status.model_dump(mode="json")}),
            flush=True,
        )
    else:
        print(
            f"{DONE[action]} the canary {command.canary_id} of {model_name} (by {command.user}"
            f"{': ' + reason if reason else ''})\n{describe(status)}",
            flush=True,
        )
    return 0


def missing_store(tracking_uri: str) -> str:
    """Why `tracking_uri` names no registry to read: a SQLite file that does not exist (a mistyped path; MLflow
    would create an empty registry there and every canary would read as none); '' when it may. shardline's own
    store ($SHARDLINE_HOME/mlflow.db) is created on first use, as `shardline run` would."""
    from infra.paths import shardline_home
    from infra.tracking import sqlite_path

    path = sqlite_path(tracking_uri)
    if path is None or path.exists() or path.absolute() == (shardline_home() / "mlflow.db").absolute():
        return ""
    return (
        f"no MLflow database at {path}: check registry.tracking_uri or $MLFLOW_TRACKING_URI "
        "(a `shardline up` stack's server is used when neither is set)"
    )


def tracking_uri_for(configured: str) -> str:
    """The MLflow server the canary's driver uses, as `shardline run` would pick it: registry.tracking_uri, else
    $MLFLOW_TRACKING_URI, else the running `shardline up` stack's, else the local SQLite store."""
    import os

    from flows.stack.state import stack_environment
    from infra.tracking import resolve_tracking_uri

    return resolve_tracking_uri(
        configured or os.environ.get("MLFLOW_TRACKING_URI") or stack_environment().get("MLFLOW_TRACKING_URI", "")
    )


def _cmd_canary(args: argparse.Namespace) -> int:
    from flows.config import ConfigError, load_config

    try:
        config = load_config(args.config, args.set)
    except ConfigError as e:
        print(f"shardline: {e}", file=sys.stderr)
        return 2
    answer_quickly()
    return canary_command(
        args.action,
        args.model or config.registry.model_name,
        tracking_uri_for(config.registry.tracking_uri),
        args.reason,
        args.json,
        args.wait,
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `canary` on the `shardline` parser."""
    canary = sub.add_parser(
        "canary",
        help="show, pause, resume, promote or abort a model's live canary",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    canary.add_argument(
        "action",
        choices=ACTIONS,
        help="status: the canary's state; pause: hold the current step; "
        "resume: go on; promote: skip the remaining steps and promote now; abort: roll back now",
    )
    canary.add_argument("--model", default="", help="registered model (default: registry.model_name of the config)")
    canary.add_argument("--reason", default="", help="why; recorded with your user name and the time")
    canary.add_argument("--config", metavar="FILE.toml", help="pipeline config (its [registry] section)")
    canary.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set registry.tracking_uri=http://mlflow:5000",
    )
    canary.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait for the canary's driver to act on the command (default 60)",
    )
    canary.add_argument("--json", action="store_true", help="print one JSON object")
    canary.set_defaults(func=_cmd_canary)
