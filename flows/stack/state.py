"""The stack's state file, $SHARDLINE_HOME/stack.json: what `up` started (URLs, ports, PIDs) and whether it did."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, Field

from flows.stack.procs import Proc, http_ok, is_ours
from infra.paths import shardline_home

PARTS = ("postgres", "prefect", "mlflow", "worker", "ray", "endpoint", "prometheus")


class PartState(BaseModel):
    """One part of the stack as `up` left it."""

    name: str
    url: str = ""
    port: int = 0
    procs: list[Proc] = Field(default_factory=list, description="processes `up` started; `down` stops these only")
    started_by_us: bool = False
    detail: dict[str, str] = Field(default_factory=dict, description="part-specific facts (never credentials)")


class StackState(BaseModel):
    """Everything `up` recorded; `down` reads it back."""

    home: str
    parts: dict[str, PartState] = Field(default_factory=dict)


class StackStateError(RuntimeError):
    """$SHARDLINE_HOME/stack.json is there but unreadable (damaged, or written by another version)."""


def state_path() -> Path:
    return shardline_home() / "stack.json"


def read_state() -> StackState | None:
    """The recorded stack, or None when `up` never ran here (or `down` removed the record)."""
    path = state_path()
    if not path.exists():
        return None
    try:
        return StackState.model_validate_json(path.read_text())
    except (ValueError, OSError) as e:  # pydantic's ValidationError is a ValueError
        why = str(e).splitlines()[0]
        raise StackStateError(
            f"{path}: not a stack record this shardline can read ({why}); if no stack runs here, remove it"
        ) from None


def write_state(state: StackState) -> None:
    """Replace the state file atomically, so a concurrent reader never sees half of it."""
    path = state_path()
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(state.model_dump_json(indent=2))
    os.replace(tmp, path)


def part_up(part: PartState) -> bool:
    """Whether a recorded part is up: its processes alive (if we started it) and its URL answering (if it has one)."""
    if part.started_by_us and part.procs and not all(is_ours(p) for p in part.procs):
        return False
    health = part.detail.get("health_url", "")
    return http_ok(health) if health else bool(part.procs) and all(is_ours(p) for p in part.procs)


def stack_environment() -> dict[str, str]:
    """Environment that points a `shardline run` at the running stack: {} when no stack is up here.

    Only parts that answer now are used, so a stack left half-down never sends a run to a dead server.
    """
    state = read_state()
    if state is None:
        return {}
    env: dict[str, str] = {}
    prefect = state.parts.get("prefect")
    if prefect is not None and part_up(prefect):
        env["PREFECT_API_URL"] = prefect.url
    mlflow = state.parts.get("mlflow")
    if mlflow is not None and part_up(mlflow):
        env["MLFLOW_TRACKING_URI"] = mlflow.url
    return env


def dump_status(state: StackState) -> dict:
    """Status of every part as plain JSON: name -> {up, url, pids, started_by_us}."""
    out = {}
    for name in PARTS:
        part = state.parts.get(name)
        if part is None:
            continue
        out[name] = {
            "up": part_up(part),
            "url": part.url,
            "pids": [p.pid for p in part.procs],
            "started_by_us": part.started_by_us,
            **{k: v for k, v in part.detail.items() if k != "health_url"},
        }
    return json.loads(json.dumps(out))
