"""The Prometheus part with the real `prometheus` binary: it scrapes a gateway-like /metrics (a real RouterMetrics)
and a Ray-node-like target listed in a service-discovery file, every Grafana panel's query answers with data, a
second `up` keeps the server and reloads a changed config, and stopping leaves no process.

Needs Debian's prometheus (`make test-system` installs it): missing, the test fails under CI=true, skips otherwise.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from support.requires import missing

from deployments.config import ServeConfig
from deployments.serve_metrics import RouterMetrics
from flows.stack import prometheus
from flows.stack.config import StackConfig
from flows.stack.procs import is_ours
from flows.stack.service import stop_part
from infra.cluster import free_port
from training import prom_metrics

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        missing("no `prometheus` binary on PATH: `make test-system` installs it (apt-get install -y prometheus)")
    return found


class Exposition:
    """A tiny HTTP server answering GET `path` with a prometheus_client registry's exposition, 404 elsewhere."""

    def __init__(self, registry, path: str) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                ok = self.path == path
                body = generate_latest(registry) if ok else b"not here\n"
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def targets(tmp_path: Path) -> Iterator[dict]:
    """A gateway at /code/metrics with live traffic on two versions, and a "Ray node" exposing the training gauges
    under the names Ray's agent gives them (Ray itself is the slow stack test's), listed in a discovery file."""
    router = RouterMetrics("tiny")
    gateway = Exposition(router.registry, "/code/metrics")
    from prometheus_client import CollectorRegistry, Gauge

    node_registry = CollectorRegistry()
    for name in sorted(prom_metrics.exported_names()):
        Gauge(name, "training gauge", ["run_id"], registry=node_registry).labels("run-1").set(0.5)
    node = Exposition(node_registry, "/metrics")
    discovery = tmp_path / "session" / prometheus.DISCOVERY_FILE
    discovery.parent.mkdir()
    discovery.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": [f"127.0.0.1:{node.port}"]}]))  # Ray's shape
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            for version, latency in (("1", 20.0), ("2", 80.0)):
                router.request(version, "completions", "live", ok=True)
                router.model_call(
                    version, "served", "generate", {"ok": True, "latency_ms": latency, "bits": 100.0, "bytes": 40}
                )
            router.request("2", "completions", "live", ok=False)
            router.rejected("completions", 429)
            router.set_percent(25)
            stop.wait(0.1)

    threading.Thread(target=traffic, daemon=True).start()
    try:
        yield {"serve": ServeConfig(port=gateway.port, route_prefix="/code"), "discovery": discovery}
    finally:
        stop.set()
        gateway.close()
        node.close()


def query(url: str, expr: str) -> list[dict]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200, f"{expr}: {r.text}"  # 400 bad_data: the PromQL does not parse
    return r.json()["data"]["result"]


def wait_for(url: str, expr: str, timeout_s: float = 40.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while not (result := query(url, expr)):
        assert time.monotonic() < deadline, f"no series for {expr} within {timeout_s:.0f} s"
        time.sleep(0.5)
    return result


def test_prometheus_part_scrapes_endpoint_and_ray_nodes_and_every_panel_has_data(
    prometheus_binary, targets, tmp_path, monkeypatch
):
    monkeypatch.setattr(prometheus, "ray_discovery_file", lambda: targets["discovery"])
    cfg = StackConfig(prometheus_port=free_port(), prometheus_scrape_s=1, start_timeout_s=60)
    home = tmp_path / "home"
    if shutil.which("promtool"):  # Debian's package ships it beside the server
        rendered = prometheus.render_config(prometheus.endpoint_target(targets["serve"]), targets["discovery"], 1)
        check = subprocess.run(
            ["promtool", "check", "config", "/dev/stdin"], capture_output=True, text=True, input=rendered
        )
        assert check.returncode == 0, check.stdout + check.stderr
    part = prometheus.start(cfg, home, None, targets["serve"])
    try:
        assert part.started_by_us and part.url == f"http://127.0.0.1:{cfg.prometheus_port}" and len(part.procs) == 1
        assert Path(part.detail["data"]).is_relative_to(home) and Path(part.detail["config"]).is_relative_to(home)
        served = wait_for(
            part.url, 'shardline_requests_total{job="shardline-endpoint", model="tiny", version="2", outcome="ok"}'
        )
        assert float(served[0]["value"][1]) > 0
        loss = wait_for(part.url, 'ray_shardline_train_loss{job="ray", run_id="run-1"}')
        assert float(loss[0]["value"][1]) == 0.5

        dashboard = json.loads((REPO / "infra" / "grafana" / "shardline.json").read_text())
        for panel in (p for p in dashboard["panels"] if p["type"] != "row"):
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", "10s").replace("$model", ".*")
                result = wait_for(part.url, expr)
                assert any(v["value"][1] not in ("NaN", "+Inf", "-Inf") for v in result), (panel["title"], result)
        bpb = query(
            part.url,
            "sum by (version) (rate(shardline_bits_total[10s])) / "
            "sum by (version) (rate(shardline_scored_bytes_total[10s]))",
        )
        # 100 bits per 40 bytes (approx: a scrape may fall between a call's two increments)
        assert {r["metric"]["version"]: float(r["value"][1]) for r in bpb} == {
            "1": pytest.approx(2.5, rel=0.05),
            "2": pytest.approx(2.5, rel=0.05),
        }
        p99 = {
            r["metric"]["version"]: float(r["value"][1])
            for r in query(
                part.url,
                "histogram_quantile(0.99, sum by (version, le) (rate(shardline_model_latency_seconds_bucket[10s])))",
            )
        }
        assert p99["1"] <= 0.025 and 0.05 <= p99["2"] <= 0.1  # 20 ms and 80 ms calls land in their buckets

        # A second `up` with the endpoint elsewhere: the same server, told to re-read its config.
        moved = ServeConfig(port=targets["serve"].port, route_prefix="/other")
        again = prometheus.start(cfg, home, part, moved)
        assert [p.pid for p in again.procs] == [p.pid for p in part.procs]
        deadline = time.monotonic() + 30
        while "/other/metrics" not in httpx.get(f"{part.url}/api/v1/status/config", timeout=10).json()["data"]["yaml"]:
            assert time.monotonic() < deadline, "the changed config was not reloaded"
            time.sleep(0.5)
    finally:
        assert stop_part(part)
    assert not any(is_ours(p) for p in part.procs)
    assert not re.search(r"level=error.*(config|file_sd)", Path(part.detail["log"]).read_text())
