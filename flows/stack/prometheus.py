"""The Prometheus part: a server on host:port scraping the live endpoint's /metrics and every node of the Ray head.

Ray's head lists its nodes' metrics export addresses in a service-discovery file in its session directory; the
rendered prometheus.yml reads it with file_sd_configs, so training's gauges (training/prom_metrics.py) and Ray's own
metrics arrive without a port being configured. The data and the rendered config live in $SHARDLINE_HOME/prometheus.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import yaml

from flows.stack.config import StackConfig
from flows.stack.procs import is_ours, port_open
from flows.stack.service import comes_up, ensure_service, service_env, stop_part
from flows.stack.state import PartState

# Ray's file name (ray._private.ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE), not imported: `up` may run without
# Ray imported, and the name is part of Ray's documented Prometheus set-up.
DISCOVERY_FILE = "prom_metrics_service_discovery.json"
INSTALL_HINT = (
    "install it with `sudo apt-get install -y prometheus` (or `make test-system`), or turn this part off "
    "with --set stack.prometheus=false"
)


class Unavailable(Exception):
    """Prometheus cannot run here (no binary, port taken by a server this stack did not start): `up` skips it."""


def server_url(cfg: StackConfig) -> str:
    return f"http://{cfg.host}:{cfg.prometheus_port}"


def endpoint_target(serve) -> tuple[str, str]:
    """(host:port, metrics path) of the gateway's merged /metrics; `serve` is the pipeline's ServeConfig."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(serve.host, serve.host)  # dial locally
    if ":" in host:  # an IPv6 literal: host:port needs it in brackets
        host = f"[{host.strip('[]')}]"
    return f"{host}:{serve.port}", serve.route_prefix.rstrip("/") + "/metrics"


def duration(seconds: float) -> str:
    """A Prometheus duration: whole units only ("2.5s" and "1e+06s" are refused), so milliseconds where needed."""
    ms = max(1, round(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def ray_discovery_file() -> Path:
    """Ray's service-discovery file of this $SHARDLINE_HOME's head (its session directory, read from the head's
    command lines), else the copy Ray keeps in its temp dir, which follows the head started last on this host."""
    from infra import process
    from infra.head import read_head

    head = read_head()
    for pid in head.pids if head is not None else []:
        info = process.inspect(pid)
        for arg in info.cmdline if info is not None else ():
            if arg.startswith(("--session-dir=", "--session_dir=")):
                return Path(arg.split("=", 1)[1]) / DISCOVERY_FILE
    return Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / DISCOVERY_FILE


def render_config(endpoint: tuple[str, str], discovery_file: Path, scrape_interval_s: float) -> str:
    """prometheus.yml: job `shardline-endpoint` (the gateway's /metrics, every model's router merged, labels model,
    version, endpoint, source) and job `ray` (every node in Ray's service-discovery file)."""
    target, path = endpoint
    interval = duration(scrape_interval_s)
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {"job_name": "shardline-endpoint", "metrics_path": path, "static_configs": [{"targets": [target]}]},
            {"job_name": "ray", "file_sd_configs": [{"files": [str(discovery_file)]}]},
        ],
    }
    return "# Rendered by `shardline up` (flows/stack/prometheus.py); rewritten on every `up`.\n" + yaml.safe_dump(
        config, sort_keys=False
    )


def write_config(path: Path, text: str) -> bool:
    """Write the rendered config when it differs from what is there; True if it changed."""
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".yml.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # Prometheus never reads half a file
    return True


def start(cfg: StackConfig, home: Path, recorded: PartState | None, serve) -> PartState:
    """Render prometheus.yml, then keep the recorded server (reloaded with SIGHUP if the config changed) or start
    one and wait until /-/ready answers; `serve` is the pipeline's ServeConfig. A recorded server that is not kept
    is stopped first when this stack started it.

    Raises:
        Unavailable: no `prometheus` binary, or the port is taken by a server this stack did not start.
        StackError: the server did not come up (from ensure_service).
    """
    exe = shutil.which("prometheus")
    if exe is None:
        raise Unavailable(f"no `prometheus` binary on PATH; {INSTALL_HINT}")
    directory = home / "prometheus"
    config_file = directory / "prometheus.yml"
    discovery = ray_discovery_file()
    changed = write_config(config_file, render_config(endpoint_target(serve), discovery, cfg.prometheus_scrape_s))
    url = server_url(cfg)
    detail = {
        "config": str(config_file),
        "data": str(directory / "data"),
        "ray_discovery": str(discovery),
        "health_url": f"{url}/-/ready",
    }
    if recorded is not None and recorded.url == url and comes_up(recorded, cfg.start_timeout_s):
        if changed and recorded.started_by_us:
            reload(recorded)
        return recorded.model_copy(update={"detail": {**recorded.detail, **detail}})
    if recorded is not None:
        # moved to another port or host, or not ready (still loading its TSDB, or hung): the old server of this
        # stack is stopped before the port check, which would take it for someone else's and have `up` forget it
        stop_part(recorded)
    if port_open(cfg.host, cfg.prometheus_port):
        raise Unavailable(
            f"port {cfg.host}:{cfg.prometheus_port} is taken by a server this stack did not start "
            "(Debian's prometheus.service listens on 9090); choose another with "
            "--set stack.prometheus_port=PORT"
        )
    argv = [
        exe,
        f"--config.file={config_file}",
        f"--storage.tsdb.path={directory / 'data'}",
        f"--web.listen-address={cfg.host}:{cfg.prometheus_port}",
    ]
    return ensure_service(
        "prometheus",
        None,
        url,
        detail["health_url"],
        cfg.host,
        cfg.prometheus_port,
        argv,
        service_env({}),
        home / "stack" / "logs",
        cfg.start_timeout_s,
        detail,
    )


def reload(part: PartState) -> bool:
    """Ask the recorded server to re-read its config (SIGHUP, Prometheus's documented reload); True if signalled."""
    signalled = False
    for proc in part.procs:
        if is_ours(proc):  # never a reused PID
            os.kill(proc.pid, signal.SIGHUP)
            signalled = True
    return signalled
