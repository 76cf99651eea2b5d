"""The stack's state file, $SHARDLINE_HOME/stack.json: what `up` started (URLs, ports, PIDs) and whether it did."""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel, Field

from flows.stack.procs import Proc, StackError, http_ok, is_ours, port_open
from infra.paths import replace_file, shardline_home

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


class StackBusy(StackError):
    """Another `shardline up` or `down` holds this $SHARDLINE_HOME's stack lock."""


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
    """Replace the state file atomically, so a concurrent reader never sees half of it.

    Each write goes through a temp file of its own in the same directory (same file system, so os.replace is
    atomic): with one shared name, two writers truncated and renamed each other's file, and one of them failed
    with FileNotFoundError or a reader saw a damaged record.
    """
    text = state.model_dump_json(indent=2)
    replace_file(state_path(), lambda tmp: Path(tmp).write_text(text))


@contextmanager
def stack_lock() -> Iterator[None]:
    """Hold $SHARDLINE_HOME/stack.lock exclusively for a whole `up` or `down`; read the state inside it.

    A second `up` or `down` fails at once rather than waiting: a waiting one would sit silent for as long as the
    first takes to start every server (minutes), and then redo what the first just did, so the operator is told
    instead. Two at once each read the record before the other wrote it, and each started (and recorded) a server,
    of which only one stayed recorded: the other was left running where `down` never stops it.
    The lock is an flock, so it goes with the process that held it, however it ended; the spawned servers do not
    inherit it (Popen closes every other descriptor).

    Raises:
        StackBusy: another `shardline up` or `down` runs on this $SHARDLINE_HOME.
    """
    path = shardline_home() / "stack.lock"
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StackBusy(
                f"another `shardline up/down` is running on {path.parent}; wait for it to finish, then try again"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def part_up(part: PartState) -> bool:
    """Whether a recorded part is up: its processes alive (if we started it) and its URL answering (if it has one).

    A part with neither processes nor a health URL (PostgreSQL: shardline only uses the server) is up while its
    detail's host accepts TCP connections on its port; without that check it always read as DOWN.
    """
    if part.started_by_us and part.procs and not all(is_ours(p) for p in part.procs):
        return False
    health = part.detail.get("health_url", "")
    if health:
        return http_ok(health)
    if part.procs:
        return all(is_ours(p) for p in part.procs)
    return _accepts(part.detail.get("host", ""), part.port)


def _accepts(host: str, port: int) -> bool:
    """True if host:port accepts TCP connections; False too when the host name does not resolve (status reports,
    it does not fail)."""
    if not host or not port:
        return False
    try:
        return port_open(host, port)
    except OSError:
        return False


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
