"""A killed run's recorded children are stopped by the next run; nothing else is, not even a recycled PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from support.procs import alive

from infra import orphans

# A pretend run: it starts a long-lived child (as Prefect's temporary server would be), records its children as
# the flow does, prints the child's PID, and waits to be killed.
RUN = """
import subprocess, sys, time
from infra import orphans
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
orphans.record_children()
print(child.pid, flush=True)
time.sleep(300)
"""


def test_children_of_a_killed_run_are_reaped_by_recorded_pid(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.Popen([sys.executable, "-c", RUN], stdout=subprocess.PIPE, text=True, env=env)
    child = int(run.stdout.readline())
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        assert orphans.reap_orphans() == []  # the run is alive: its children are its own business
        os.kill(run.pid, signal.SIGKILL)  # only the main process dies, as under the OOM killer
        run.wait(timeout=10)
        assert alive(child)
        assert orphans.reap_orphans() == [child]
        assert not alive(child) and alive(bystander.pid)
        assert not list((tmp_path / "runs").glob("*.json"))
    finally:
        for p in (bystander,):
            p.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_recycled_pid_is_not_touched(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        me = orphans._identity(other.pid)
        record = {
            "owner": {"pid": 999_999_999, "start": 1, "cmdline": "gone"},
            "children": [{**me, "start": me["start"] - 1}],
        }  # same PID, another process
        (tmp_path / "runs").mkdir()
        (tmp_path / "runs" / "1.json").write_text(json.dumps(record))
        assert orphans.reap_orphans() == []
        time.sleep(0.2)
        assert alive(other.pid)
    finally:
        other.kill()
