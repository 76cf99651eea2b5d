"""A canary's PromQL gates against a real Prometheus server scraping a real exporter: a critical gate's breach
fails the step, a report-only gate's is recorded and decides nothing, a query with no sample is inconclusive.
Needs the `prometheus` binary (Debian package `prometheus`); skipped, saying so, where it is absent."""

from __future__ import annotations

import shutil
import subprocess
import time

import httpx
import pytest
import yaml
from support.requires import missing

from deployments.canary_records import StepMetrics, VersionStats
from deployments.config import CanaryConfig, PromQLGate
from deployments.promql import read_gates
from deployments.rollout_gates import apply_promql
from deployments.rollout_policy import decide_canary
from infra.cluster import free_port

pytestmark = pytest.mark.slow
PROMETHEUS = shutil.which("prometheus")


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    if PROMETHEUS is None:
        missing(
            "SKIPPED LOUDLY: no `prometheus` binary on PATH (apt-get install prometheus); the PromQL gate "
            "is covered only by its unit tests here"
        )
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    registry = CollectorRegistry()
    ratio = Gauge("shardline_test_error_ratio", "errors per request", ["model", "version"], registry=registry)
    ratio.labels("m", "1").set(0.01)
    ratio.labels("m", "2").set(0.04)
    exporter_port = free_port()
    server, thread = start_http_server(exporter_port, addr="127.0.0.1", registry=registry)
    home = tmp_path_factory.mktemp("prometheus")
    (home / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {"job_name": "exporter", "static_configs": [{"targets": [f"127.0.0.1:{exporter_port}"]}]}
                ],
            }
        )
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={home / 'prometheus.yml'}",
            f"--storage.tsdb.path={home / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # up, and the exporter scraped at least once
            try:
                result = httpx.get(
                    f"{url}/api/v1/query", params={"query": "shardline_test_error_ratio"}, timeout=5
                ).json()["data"]["result"]
                if len(result) == 2:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("prometheus did not scrape the exporter within 60 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        server.shutdown()


def test_promql_gates_read_a_real_prometheus(prometheus):
    cfg = CanaryConfig(
        prometheus_url=prometheus,
        min_paired=2,
        promql_gates=[
            PromQLGate(
                name="error_ratio",
                query="max(shardline_test_error_ratio{model='$model',version='$challenger'})",
                max=0.05,
            ),
            PromQLGate(
                name="vs_champion",
                critical=False,
                max=2.0,
                query=(
                    "max(shardline_test_error_ratio{version='$challenger'})"
                    " / max(shardline_test_error_ratio{version='$champion'})"
                ),
            ),
            PromQLGate(name="absent", query="max(shardline_no_such_metric)", max=1.0),
        ],
    )
    readings = read_gates(cfg, "m", "1", "2")
    assert [(r.name, r.verdict) for r in readings] == [
        ("error_ratio", "pass"),
        ("vs_champion", "fail"),
        ("absent", "no-data"),
    ]
    assert readings[0].value == pytest.approx(0.04) and readings[0].query.endswith("version='2'})")
    assert readings[1].value == pytest.approx(4.0) and readings[1].message == (
        "PromQL gate vs_champion (report-only): 4 > max 2"
    )
    stats = VersionStats(version="2", n=4, errors=0, error_rate=0.0, p95_ms=1.0, bpb=2.0)
    step = StepMetrics(
        percent=10, requests=4, challenger=stats, champion=stats.model_copy(update={"version": "1"}), paired=4
    )
    judged = apply_promql(step, readings)
    # the report-only breach decides nothing; the critical gate without a sample makes the step inconclusive
    assert judged.failures == [] and judged.outcome == "inconclusive"
    assert judged.inconclusive == ["PromQL gate absent: no sample: too little evidence to judge"]
    assert decide_canary("m", "2", "1", [judged], cfg).verdict == "inconclusive"
    strict = cfg.model_copy(update={"promql_gates": [cfg.promql_gates[0].model_copy(update={"max": 0.03})]})
    breached = apply_promql(step, read_gates(strict, "m", "1", "2"))
    assert breached.failures == ["PromQL gate error_ratio: 0.04 > max 0.03"] and breached.outcome == "fail"
    down = cfg.model_copy(
        update={"prometheus_url": f"http://127.0.0.1:{free_port()}", "promql_gates": cfg.promql_gates[:1]}
    )
    (unreachable,) = read_gates(down, "m", "1", "2")
    assert unreachable.verdict == "no-data" and "query failed: ConnectError" in unreachable.message
