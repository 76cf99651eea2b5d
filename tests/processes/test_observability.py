"""Observability without servers: the rendered prometheus.yml, the Grafana dashboard's PromQL against the metric
names the code really exports, training's gauges staying off (and Ray unloaded) outside Ray, and the Ray
dashboard token hint that names the file and the command but never prints the token."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployments.config import ServeConfig
from deployments.serve_metrics import RouterMetrics
from flows.cli.stack import summary_lines
from flows.config import load_stack_config
from flows.stack import prometheus
from flows.stack.ray_token import token_hint
from training import prom_metrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "infra" / "grafana" / "shardline.json"
# PromQL words that look like metric names but are not
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions, keywords, label names
    (matchers, grouping lists), strings, range durations or Grafana variables."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = re.findall(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", e)
    return {n for n in names if n not in KEYWORDS}


def serving_names() -> set[str]:
    """Every series name a router's /metrics carries, read off a real RouterMetrics after one call of each kind."""
    m = RouterMetrics("m")
    m.request("1", "completions", "live", ok=True)
    m.rejected("completions", 429)
    m.model_call("1", "served", "generate", {"ok": True, "latency_ms": 12.0, "bits": 80.0, "bytes": 20})
    m.set_percent(10)
    return {s.name for family in m.registry.collect() for s in family.samples}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every panel target, and the model variable's label_values query."""
    dash = json.loads(DASHBOARD.read_text())
    out = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            found = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["query"]["query"])
            assert found, var["query"]
            out.append((f"variable {var['name']}", found.group(1)))
    return out


def test_test_helper_finds_metric_names_not_labels_or_functions():
    expr = (
        'histogram_quantile(0.95, sum by (model, le) (rate(a_bucket{model=~"$model", x="y z"}'
        "[$__rate_interval]))) / on (model) max without (job) (b_total offset 5m)"
    )
    assert metric_names(expr) == {"a_bucket", "b_total"}


def test_every_dashboard_query_names_metrics_the_code_exports():
    known = serving_names() | prom_metrics.exported_names()
    queries = dashboard_queries()
    used = set()
    for title, expr in queries:
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        assert names <= known, (
            f"{title}: {sorted(names - known)} exported by neither deployments/serve_metrics.py "
            f"nor training/prom_metrics.py"
        )
        used |= names
    # every training gauge has a panel, and so has each serving number the issue asks for
    assert prom_metrics.exported_names() <= used
    assert {
        "shardline_requests_total",
        "shardline_model_latency_seconds_bucket",
        "shardline_bits_total",
        "shardline_scored_bytes_total",
        "shardline_challenger_percent",
    } <= used


def test_dashboard_is_a_grafana_dashboard_on_a_prometheus_datasource_variable():
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"]) and dash["schemaVersion"] >= 36
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["refId"] and t["expr"] for t in p["targets"]), p["title"]
        assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
    quantiles = [t["expr"] for p in panels for t in p["targets"] if "histogram_quantile" in t["expr"]]
    # per op too: a score's latency and a 200-token completion's are not one distribution
    assert len(quantiles) == 3 and all("_bucket" in q and " op, le)" in q for q in quantiles)


def test_rendered_config_scrapes_the_gateway_metrics_and_rays_discovery_file(tmp_path):
    serve = ServeConfig(host="0.0.0.0", port=8123, route_prefix="/")
    text = prometheus.render_config(prometheus.endpoint_target(serve), tmp_path / "sd.json", 2.5)
    config = yaml.safe_load(text)
    assert config["global"]["scrape_interval"] == "2500ms"  # Prometheus refuses "2.5s"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["shardline-endpoint"]["metrics_path"] == "/metrics"  # not '//metrics' for the root prefix
    assert jobs["shardline-endpoint"]["static_configs"] == [{"targets": ["127.0.0.1:8123"]}]  # 0.0.0.0 dialled locally
    assert jobs["ray"]["file_sd_configs"] == [{"files": [str(tmp_path / "sd.json")]}]
    prefixed = prometheus.endpoint_target(ServeConfig(port=8000, route_prefix="/code"))
    assert prefixed == ("127.0.0.1:8000", "/code/metrics")
    assert prometheus.endpoint_target(ServeConfig(host="::", port=8000))[0] == "[::1]:8000"
    assert prometheus.endpoint_target(ServeConfig(host="fd00::5", port=8000))[0] == "[fd00::5]:8000"
    durations = [prometheus.duration(s) for s in (10, 2.5, 1e6, 0.0001, 0.25)]
    assert durations == ["10s", "2500ms", "1000000s", "1ms", "250ms"]


def test_config_is_rewritten_only_when_it_changes(tmp_path):
    path = tmp_path / "prometheus" / "prometheus.yml"
    assert prometheus.write_config(path, "a: 1\n") is True
    assert prometheus.write_config(path, "a: 1\n") is False  # a second `up`: no reload
    assert prometheus.write_config(path, "a: 2\n") is True and path.read_text() == "a: 2\n"


def test_without_a_recorded_head_the_discovery_file_is_rays_temp_dir_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "raytmp"))
    assert prometheus.ray_discovery_file() == tmp_path / "raytmp" / "ray" / "prom_metrics_service_discovery.json"


def test_missing_binary_is_a_skip_that_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no prometheus here
    stack, pipeline = load_stack_config(None, ["stack.prometheus_port=9300"])
    with pytest.raises(prometheus.Unavailable, match=r"apt-get install -y prometheus.*stack\.prometheus=false"):
        prometheus.start(stack, tmp_path, None, pipeline.serve)


def test_stack_table_takes_the_prometheus_fields(tmp_path):
    cfg = tmp_path / "ops.toml"
    cfg.write_text("[stack]\nprometheus_port = 9300\nprometheus = false\n")
    stack, _ = load_stack_config(cfg, ["stack.prometheus_scrape_s=2"])
    assert (stack.prometheus, stack.prometheus_port, stack.prometheus_scrape_s) == (False, 9300, 2.0)


def test_training_gauges_are_a_no_op_under_torchrun_and_never_import_ray():
    code = (
        "import sys; from training import prom_metrics\n"
        "prom_metrics.export({'loss': 2.0, 'tokens_per_s': 1.0, 'mfu': 0.1, 'step_time_s': 0.2}, 5, 'r')\n"
        "assert prom_metrics._ray_gauges() is None and 'ray' not in sys.modules, sorted(sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_training_gauge_names_are_valid_and_prefixed_as_ray_exports_them():
    names = prom_metrics.exported_names()
    assert len(names) == len(prom_metrics.GAUGES)
    assert all(re.fullmatch(r"ray_shardline_train_[a-z_]+", n) for n in names)
    # every key the helper reads is one the loops' metrics window really logs (training/train_metrics.py)
    window = (REPO / "training" / "train_metrics.py").read_text()
    assert all(f'"{key}"' in window for key in prom_metrics.GAUGES if key != "step")


TOKEN = "0123456789abcdef0123456789abcdef"


def test_token_hint_names_the_file_and_command_never_the_token(tmp_path):
    path = tmp_path / "auth_token"
    path.write_text(TOKEN)
    path.chmod(0o644)
    loose = token_hint({"RAY_AUTH_TOKEN_PATH": str(path)})
    assert str(path) in loose and "get-auth-token" in loose and "chmod 600" in loose and TOKEN not in loose
    path.chmod(0o600)
    tight = token_hint({"RAY_AUTH_TOKEN_PATH": str(path)})
    assert "mode 600" in tight and "WARNING" not in tight and TOKEN not in tight
    from_env = token_hint({"RAY_AUTH_TOKEN": TOKEN})
    assert "$RAY_AUTH_TOKEN" in from_env and TOKEN not in from_env
    assert token_hint({"RAY_AUTH_MODE": "disabled"}).startswith("none needed")
    assert "no token file" in token_hint({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")})


def test_summary_lists_prometheus_and_where_the_ray_token_is(tmp_path, monkeypatch):
    path = tmp_path / "auth_token"
    path.write_text(TOKEN)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    report = {"ray": {"url": "http://127.0.0.1:8265"}, "prometheus": {"url": "http://127.0.0.1:9095"}}
    text = "\n".join(summary_lines(report))
    assert "Prometheus      http://127.0.0.1:9095" in text and "infra/grafana/shardline.json" in text
    assert f"ray dashboard token: in {path}" in text and TOKEN not in text
