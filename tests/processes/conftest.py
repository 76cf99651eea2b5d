"""Fixtures of the stack's process tests (test_stack_start, test_stack_record, test_stack_stop): a fresh
$SHARDLINE_HOME that refuses to start a Ray head, and detached processes stopped when the test ends."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flows.stack.procs import Proc, spawn, stop
from infra import head


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh $SHARDLINE_HOME, Ray's temp dir inside it, and a guard: starting a Ray head fails the test."""
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path))
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "raytmp"))

    def no_head(*args, **kwargs):
        raise AssertionError("a Ray head was started")

    monkeypatch.setattr(head, "ensure_head", no_head)
    monkeypatch.setattr(head, "_run_ray", no_head)
    return tmp_path


@pytest.fixture
def spawned(tmp_path: Path):
    """Detached processes started with procs.spawn (their own session, as `up` starts servers); whatever a test
    leaves running is stopped at the end."""
    started: list[Proc] = []

    def start(argv: list[str]) -> Proc:
        proc = spawn(f"p{len(started)}", argv, dict(os.environ), tmp_path / "logs")
        started.append(proc)
        return proc

    start.all = started  # type: ignore[attr-defined]
    yield start
    for proc in started:
        stop(proc, grace_s=2.0)
