"""Live endpoint benchmark: router overhead, requests/s held for /v1/score, and what shadow scoring costs.

Serves the demo-size byte GPT (configs/demo.toml's model, untrained weights: the cost of a forward pass does not
depend on what the weights learned) on a local Ray, all on 127.0.0.1, and prints, measured side by side in one run:
- p50/p95 latency of POST /v1/score through the proxy and router vs calling the model deployment's handle directly
  (the router's added milliseconds; target <= 2 ms at p50);
- requests/s held at a few concurrent clients;
- the same with a challenger at 100% whose every request the champion also scores (shadow_share 1) vs none (0).
Run: .venv/bin/python bench/bench_serve.py [--seconds 10] [--requests 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _register_demo_model(uri: str, name: str, exp: str) -> str:
    import mlflow

    from deployments.registry import client_for, register_version
    from flows.config import load_config
    from training.model import build_gpt
    from training.servable import log_servable_model

    cfg = load_config(REPO / "configs" / "demo.toml")
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(experiment_id=exp) as run:
        model_uri = log_servable_model(build_gpt(cfg.train).eval(), cfg.train.seq_len)
    return register_version(client_for(uri), name, model_uri, run.info.run_id)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, int(round(q * len(ordered))) - 1)]


def _latencies(call, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


def _throughput(url: str, body: dict, seconds: float, clients: int) -> float:
    import httpx

    done = [0] * clients
    failed = []
    stop = time.monotonic() + seconds

    def run(i: int) -> None:
        with httpx.Client(timeout=60) as http:
            while time.monotonic() < stop:
                r = http.post(f"{url}/v1/score", json=body)
                if r.status_code != 200:
                    failed.append(r.status_code)
                done[i] += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise SystemExit(f"{len(failed)} requests failed during the throughput run: {failed[:5]}")
    return sum(done) / (time.monotonic() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each throughput run")
    parser.add_argument("--requests", type=int, default=200, help="sequential requests per latency measurement")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients in the throughput runs")
    args = parser.parse_args()

    home = tempfile.mkdtemp(prefix="bench-serve-")
    os.environ["SHARDLINE_HOME"] = home
    import httpx
    import ray
    from ray import serve

    from deployments import endpoint, serve_build
    from deployments.config import ServeConfig
    from infra.cluster import free_port
    from infra.tracking import setup_tracking

    uri = f"sqlite:///{home}/mlflow.db"
    name = "bench-serve"
    exp = setup_tracking(uri, "bench")
    v1, v2 = _register_demo_model(uri, name, exp), _register_demo_model(uri, name, exp)
    from deployments.registry import client_for

    client_for(uri).set_registered_model_alias(name, "champion", v1)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    cfg = ServeConfig(port=free_port())
    try:
        url = endpoint.reconcile(cfg, name, uri).url
        app = serve_build.app_name_for(cfg, name)
        text = (REPO / "training" / "model.py").read_text()[:1024]
        body = {"text": text}
        model = serve.get_deployment_handle(f"v{v1}", app)
        with httpx.Client(timeout=60) as http:
            for _ in range(20):  # warm both paths
                http.post(f"{url}/v1/score", json=body)
                model.score.remote(text.encode()).result()
            via_router = _latencies(lambda: http.post(f"{url}/v1/score", json=body), args.requests)
            direct = _latencies(lambda: model.score.remote(text.encode()).result(), args.requests)
        rps_champion = _throughput(url, body, args.seconds, args.clients)
        shadowed = {}
        for share in (0.0, 1.0):
            router = serve_build.router_config(
                cfg,
                name,
                v1,
                challenger=v2,
                challenger_percent=100,
                shadow_share=share,
                lease_expires_at=time.time() + 3600,
            )
            endpoint.apply(serve_build.AppSpec(app_name=app, tracking_uri=uri, versions=[v1, v2], router=router), cfg)
            shadowed[share] = _throughput(url, body, args.seconds, args.clients)
    finally:
        endpoint.remove(cfg, name)
        ray.shutdown()

    p50r, p50d = statistics.median(via_router), statistics.median(direct)
    p95r, p95d = _pct(via_router, 0.95), _pct(direct, 0.95)
    print(
        f"demo-size byte GPT, {len(text)}-byte /v1/score bodies, {os.cpu_count()} cores, {args.requests} sequential "
        f"requests per latency figure, {args.clients} clients x {args.seconds:.0f} s per throughput figure"
    )
    print(
        f"latency p50: router {p50r:.2f} ms vs handle {p50d:.2f} ms: +{p50r - p50d:.2f} ms "
        f"({p50r / p50d:.2f}x)  (target <= +2 ms)"
    )
    print(f"latency p95: router {p95r:.2f} ms vs handle {p95d:.2f} ms: +{p95r - p95d:.2f} ms ({p95r / p95d:.2f}x)")
    p99r, p99d = _pct(via_router, 0.99), _pct(direct, 0.99)
    print(f"latency p99: router {p99r:.2f} ms vs handle {p99d:.2f} ms: +{p99r - p99d:.2f} ms ({p99r / p99d:.2f}x)")
    print(f"latency max: router {max(via_router):.2f} ms vs handle {max(direct):.2f} ms")
    print(f"requests/s held, champion alone: {rps_champion:.1f}")
    print(
        f"requests/s, challenger at 100%: shadow_share=1 {shadowed[1.0]:.1f} vs shadow_share=0 {shadowed[0.0]:.1f} "
        f"= {shadowed[1.0] / shadowed[0.0]:.2f}x (what pairing every request costs)"
    )


if __name__ == "__main__":
    main()
