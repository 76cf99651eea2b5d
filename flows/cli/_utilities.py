"""What every `shardline` command shares: the environment, the config, tables, and one way to exit on an error.

Commands (flows/cli/<command>.py) and the root (flows/cli/root.py) import these; no command imports the root
(Prefect's `cli/_utilities.py` shape).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from flows.config import ConfigError, load_config


def prepare_environment() -> None:
    """Telemetry off; use the stack `shardline up` runs here, if any; else Prefect's state under $SHARDLINE_HOME."""
    from infra.paths import quiet_telemetry, shardline_home

    quiet_telemetry()
    from flows.stack.state import stack_environment

    for key, value in stack_environment().items():  # a running `shardline up` stack: its Prefect and MLflow
        os.environ.setdefault(key, value)
    if not os.environ.get("PREFECT_API_URL") and not os.environ.get("PREFECT_HOME"):
        os.environ["PREFECT_HOME"] = str(shardline_home() / "prefect")
    # Without an API URL the run starts Prefect's temporary server, which Prefect gives 20 s: on 2 busy cores (CI)
    # it took longer, and the run failed before its first stage ("Timed out ... ephemeral Prefect API server")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")


def answer_quickly() -> None:
    """An interactive command (`canary`, `lineage`) fails in seconds, in one line, against an MLflow server that
    does not answer, instead of MLflow's default of 7 retries with backoff (about two silent minutes). A user's
    own MLFLOW_HTTP_REQUEST_* settings win; pipeline runs keep MLflow's defaults."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")


def table(rows: list[tuple[str, Any]]) -> str:
    kw = max(len(k) for k, _ in rows)
    vw = max(len(str(v)) for _, v in rows)
    line = f"+{'-' * (kw + 2)}+{'-' * (vw + 2)}+"
    body = [f"| {k.ljust(kw)} | {str(v).ljust(vw)} |" for k, v in rows]
    return "\n".join([line, *body, line])


def config_or_none(args: argparse.Namespace, probe_endpoint: bool = False) -> Any:
    """The PipelineConfig of `--config` and `--set`, with the environment prepared; None after printing the one-line
    mistake to stderr (the caller exits 2). `probe_endpoint`: for a command that serves (flows.config.load_config)."""
    try:
        config = load_config(args.config, args.set, probe_endpoint)
    except ConfigError as e:
        print(f"shardline: {e}", file=sys.stderr)
        return None
    prepare_environment()
    return config


def exit_with_error(message: str, code: int = 1) -> int:
    """Print `shardline: message` (one line, credentials masked) to stderr; the exit code to return."""
    from infra.redact import redact

    print(f"shardline: {redact(message)}", file=sys.stderr, flush=True)
    return code


def exit_codes(what: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """The one mapping of errors to exit codes, for a command doing `what`: a config mistake is 2, an interrupt
    130, any other failure 1 (`shardline: <what> failed: <Type>: <first line>`, credentials masked); never a
    traceback on the terminal (the logs and MLflow keep the details)."""

    def decorate(command: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> int:
            from flows.log_hygiene import one_line

            try:
                return command(*args, **kwargs)
            except ConfigError as e:
                return exit_with_error(str(e), 2)
            except KeyboardInterrupt:
                return exit_with_error("interrupted", 130)
            except Exception as e:  # noqa: BLE001 - one line for the user; the details are in the logs
                return exit_with_error(f"{what} failed: {one_line(e)}", 1)

        return run

    return decorate
