"""One release at a time per model: an exclusive lock around promotion and canary that really excludes.

Which lock, by where the state lives (a lock the database or the kernel holds first: it is freed the moment its
holder dies, where a Prefect lease is freed only when the server's lease service gets to it):
- MLflow on PostgreSQL: a session-level advisory lock (`pg_advisory_lock`), freed when the connection drops;
- MLflow on SQLite (the embedded default): an OS file lock (`flock`) beside the SQLite file;
- an MLflow server with a Prefect server configured (PREFECT_API_URL; `shardline up`): a Prefect global
  concurrency limit with one slot (`shardline-release-<model>`), held with a lease Prefect renews;
- otherwise: a file lock under $SHARDLINE_HOME (one machine).
None is check-then-set: the acquire itself is atomic in the server, the database or the kernel.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

from infra.paths import shardline_home
from infra.tracking import sqlite_path


class LockTimeout(TimeoutError):
    """Another release of the same model held the lock for longer than canary.lock_timeout_s."""


def _still_held(lock: str, model_name: str, timeout_s: float) -> LockTimeout:
    """The one-line error of a lock not freed in time: what holds it, as far as this side can tell, and the ways out."""
    return LockTimeout(
        f"{lock} still held after {timeout_s:g} s: another release of {model_name!r} is still running (its canary "
        f"may be paused or awaiting approval: `shardline canary status --model {model_name}`); let it finish, abort "
        "it, or raise canary.lock_timeout_s"
    )


def _slug(model_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", model_name)


@contextlib.contextmanager
def release_lock(model_name: str, tracking_uri: str, timeout_s: float) -> Iterator[str]:
    """Hold the model's release lock for the duration of the block; yields a description of the lock.

    Raises:
        LockTimeout: the lock was not free within timeout_s.
    """
    if tracking_uri.startswith(("postgresql", "postgres")):
        with _pg_lock(model_name, tracking_uri, timeout_s) as what:
            yield what
    elif tracking_uri.startswith("sqlite:///") or not os.environ.get("PREFECT_API_URL"):
        with _file_lock(model_name, tracking_uri, timeout_s) as what:
            yield what
    else:
        with _prefect_lock(model_name, timeout_s) as what:
            yield what


@contextlib.contextmanager
def _file_lock(model_name: str, tracking_uri: str, timeout_s: float) -> Iterator[str]:
    if (database := sqlite_path(tracking_uri)) is not None:
        path = Path(f"{database}.release-{_slug(model_name)}.lock")
    else:
        path = shardline_home() / "locks" / f"release-{_slug(model_name)}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    with open(path, "a+") as fh:
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise _still_held(f"release lock {path} of model {model_name!r}", model_name, timeout_s) from None
                time.sleep(0.5)
        try:
            yield f"file lock {path}"
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _pg_lock(model_name: str, tracking_uri: str, timeout_s: float) -> Iterator[str]:
    import sqlalchemy

    key = int.from_bytes(hashlib.sha256(f"shardline-release:{model_name}".encode()).digest()[:8], "big", signed=True)
    engine = sqlalchemy.create_engine(tracking_uri, poolclass=sqlalchemy.pool.NullPool)
    deadline = time.monotonic() + timeout_s
    with engine.connect() as conn:
        while not conn.execute(sqlalchemy.text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar():
            if time.monotonic() > deadline:
                raise _still_held(f"advisory release lock of model {model_name!r}", model_name, timeout_s)
            time.sleep(0.5)
        try:
            yield f"postgres advisory lock {key}"
        finally:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
    engine.dispose()


@contextlib.contextmanager
def _prefect_lock(model_name: str, timeout_s: float) -> Iterator[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    name = f"shardline-release-{_slug(model_name)}"
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    held = contextlib.ExitStack()
    try:
        # a short lease, renewed by Prefect while held: a killed holder frees the slot within 60 s (the minimum)
        held.enter_context(concurrency(name, occupy=1, timeout_seconds=timeout_s, strict=True, lease_duration=60))
    except TimeoutError:
        raise _still_held(f"Prefect concurrency limit {name}", model_name, timeout_s) from None
    with held:
        yield f"Prefect global concurrency limit {name}"
