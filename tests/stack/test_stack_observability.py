"""The stack's Prometheus against the real stack: `shardline up` started it, it scrapes the live gateway's /metrics
and the Ray head's node through Ray's service-discovery file, and a gauge that training's helper sets inside a Ray
worker arrives in Prometheus under the name the Grafana dashboard queries. `status` names the Ray token's file.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import httpx
import pytest
from support.requires import missing
from support.stack_support import REPO, shardline

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# A Ray task on the stack's head sets the training gauges once, then stays alive while Prometheus scrapes the node.
PROBE = """
import os, sys, time, ray
from flows.config import load_config
from infra.cluster import provision, teardown

info = provision(load_config("configs/debug.toml").cluster)

@ray.remote(num_cpus=0)
def probe(done: str):
    from training import prom_metrics
    prom_metrics.export({"loss": 1.25, "tokens_per_s": 321.0, "mfu": 0.02, "step_time_s": 0.5}, 7, "probe-run")
    deadline = time.monotonic() + 240
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.5)

try:
    ray.get(probe.remote(sys.argv[1]))
finally:
    teardown(info)
"""


def query(url: str, expr: str) -> list[dict]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    return r.json()["data"]["result"]


def wait_for(url: str, expr: str, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while not (result := query(url, expr)):
        assert time.monotonic() < deadline, f"no series for {expr} within {timeout_s:.0f} s"
        time.sleep(1)
    return result


def test_stack_prometheus_scrapes_the_gateway_ray_and_training_gauges(stack, tmp_path):
    if shutil.which("prometheus") is None:
        missing("no `prometheus` binary on PATH: `make test-system` installs it (apt-get install -y prometheus)")
    part = stack["status"].get("prometheus")
    assert part is not None and part["up"], stack["up_output"]  # a SKIPPED line there says why
    url = part["url"]
    discovery = part["ray_discovery"]
    assert discovery.endswith("/prom_metrics_service_discovery.json") and "/session_" in discovery  # our head's

    plain = shardline(["status"], stack["env"], timeout=60)
    assert f"Prometheus      {url}" in plain.stdout and "ray dashboard token: " in plain.stdout, plain.stdout

    gateway = wait_for(url, 'up{job="shardline-endpoint"} == 1', 60)
    assert gateway[0]["metric"]["instance"] == f"127.0.0.1:{stack['serve_port']}"
    wait_for(url, 'up{job="ray"} == 1', 120)  # the head's node, found through Ray's service-discovery file

    done = tmp_path / "done"
    probe = subprocess.Popen(
        [sys.executable, "-c", PROBE, str(done)],
        cwd=REPO,
        env=stack["env"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        loss = wait_for(url, 'ray_shardline_train_loss{run_id="probe-run"}', 150)
        assert float(loss[0]["value"][1]) == 1.25
        tps = wait_for(url, 'max by (run_id) (ray_shardline_train_tokens_per_second{run_id="probe-run"})', 60)
        assert float(tps[0]["value"][1]) == 321.0
    finally:
        done.touch()
        out, _ = probe.communicate(timeout=120)
        print(out[-3000:])
    assert probe.returncode == 0, out[-3000:]
