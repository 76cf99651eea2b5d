"""`shardline up` is idempotent and `shardline down` stops exactly what it started: no process, no port left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.procs import alive, group_members
from support.stack_support import shardline, stack_env, status, up_args

from flows.stack.procs import http_ok, port_open
from infra.cluster import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_up_twice_keeps_everything_and_down_leaves_no_process_and_no_port(tmp_path):
    env = stack_env(tmp_path / "home")
    # A Prefect server somebody else runs: `up` uses it, and `down` must leave it running.
    foreign_port = free_port()
    foreign = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("prefect")),
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(foreign_port),
            "--analytics-off",
        ],
        env={**env, "PREFECT_HOME": str(tmp_path / "foreign")},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        args = up_args("stack-lifecycle", ["--set", "stack.deploy=false"], prefect_port=foreign_port)
        deadline = time.monotonic() + 120
        while not http_ok(f"http://127.0.0.1:{foreign_port}/api/health"):
            assert time.monotonic() < deadline and foreign.poll() is None, "the foreign Prefect server did not start"
            time.sleep(1)
        first = shardline(args, env)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "prefect   http://127.0.0.1" in first.stdout and "kept (already running)" in first.stdout
        before = status(env)
        assert before["prefect"]["started_by_us"] is False and before["mlflow"]["started_by_us"] is True
        # Every part answers; the endpoint's gateway is up and waits for a first model (status exits 0).
        assert all(part["up"] for part in before.values()), before
        assert before["endpoint"]["champion"] == "none yet" and before["ray"]["started_by_us"] is True
        assert before["endpoint"]["models"] == {} and before["endpoint"]["not_served"] == {}
        plain = shardline(["status"], env, timeout=60)
        assert plain.returncode == 0 and "waiting for a first model" in plain.stdout, plain.stdout

        second = shardline(args, env)
        assert second.returncode == 0, second.stdout + second.stderr
        after = status(env)
        assert {n: p["pids"] for n, p in after.items()} == {n: p["pids"] for n, p in before.items()}

        ours = [p for part in after.values() if part["started_by_us"] for p in part["pids"]]
        members = set(ours).union(*(group_members(pid) for pid in ours))  # with servers' worker processes
        ports = [
            int(part["url"].split(":")[2].split("/")[0])
            for name, part in after.items()
            if part["started_by_us"] and name in ("mlflow",)
        ]

        down = shardline(["down"], env, timeout=300)
        assert down.returncode == 0, down.stderr
        assert "left running (not started by shardline up)" in down.stdout
        assert not [pid for pid in members if alive(pid)], "processes of the stack are still running"
        assert not any(port_open("127.0.0.1", port) for port in ports)
        assert status(env) == {}
        assert not (tmp_path / "home" / "stack.json").exists()
        # ...and the server it did not start still answers.
        assert foreign.poll() is None and http_ok(f"http://127.0.0.1:{foreign_port}/api/health")
    finally:
        if (tmp_path / "home" / "stack.json").exists():  # a failed assertion above: still stop what up started
            shardline(["down"], env, timeout=300)
        os.killpg(foreign.pid, signal.SIGTERM)
        foreign.wait(timeout=60)
