"""`shardline cluster up|down|render`: Ray cluster-launcher configs (AWS, Azure) and KubeRay manifests rendered
from the pipeline config, checked by Ray / written for kubectl; `up`/`down` run `ray up`/`ray down` on them."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from flows.cli._utilities import exit_with_error
from infra.redact import first_line

HEADER = """Rendered by `shardline cluster {verb} --provider {provider}` from [cluster.launcher];
edit the config, not this.
Ports (head): 6379 GCS (workers join), 8265 dashboard + Jobs API (bound to launcher.dashboard_host),
10001 Ray Client (unused by shardline), 8080 Prometheus metrics (every node), 8076 object manager,
8000 Serve HTTP (the endpoint). Ray's security group / NSG admits SSH and traffic between cluster members only:
reach the dashboard with `ray dashboard THIS_FILE`. Token auth: RAY_AUTH_MODE=token on every node, the token is
launcher.token_file copied to ~/.ray/auth_token."""


def _out_dir(args: argparse.Namespace) -> Path:
    from infra.paths import shardline_home

    return Path(args.out) if args.out else shardline_home() / "cluster"


def render_launcher(config: Any, provider: str, out_dir: Path, verb: str) -> Path:
    """Render, check with Ray's schema and prepare_config, and write `provider`'s launcher config; its path."""
    from infra.launch.render import check_with_ray, launcher_config, write_yaml

    launch = launcher_config(config.cluster.launcher, provider, rdma=config.cluster.network != "tcp")
    check_with_ray(launch)
    return write_yaml(launch, out_dir / f"{provider}.yaml", HEADER.format(verb=verb, provider=provider))


def render_kuberay(config: Any, out_dir: Path) -> list[Path]:
    """Write the RayCluster, RayJob and RayService manifests; their paths."""
    from deployments.serve_build import app_name_for
    from infra.launch import kuberay
    from infra.launch.render import write_yaml
    from infra.network import network_env

    launcher, serve = config.cluster.launcher, config.serve
    env = network_env(config.cluster.network, config.cluster.network_env)
    service_cfg = kuberay.serve_config(
        launcher,
        app_name_for(serve, config.registry.model_name),
        config.registry.model_name,
        config.registry.tracking_uri,
        serve.model_dump(exclude={"host", "port", "public_url"}),
    )
    manifests = {
        "raycluster.yaml": kuberay.ray_cluster(launcher, env),
        "rayjob.yaml": kuberay.ray_job(launcher, env, launcher.kuberay.pipeline_config),
        "rayservice.yaml": kuberay.ray_service(launcher, env, service_cfg),
    }
    header = (
        "Rendered by `shardline cluster render --provider kuberay` from [cluster.launcher.kuberay].\n"
        "Needs the KubeRay operator (>= 1.5.1) and the token Secret: kubectl create secret generic "
        f'{launcher.kuberay.token_secret} --from-literal=auth_token="$(ray get-auth-token --generate)"'
    )
    return [write_yaml(m, out_dir / "kuberay" / name, header) for name, m in manifests.items()]


def _ray_cli(verb: str, path: Path) -> int:
    from infra.cluster import ray_cli as ray_exe

    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run([ray_exe(), verb, "-y", str(path)], env=env, stdin=subprocess.DEVNULL).returncode


def _cmd_cluster(args: argparse.Namespace) -> int:
    from flows.cli._utilities import config_or_none

    config = config_or_none(args)
    if config is None:
        return 2
    from infra.launch.cloud_auth import credentials_missing
    from infra.launch.render import LauncherError

    out = _out_dir(args)
    try:
        if args.provider == "kuberay":
            if args.verb != "render" and not args.dry_run:
                print(
                    "shardline: cluster: --provider kuberay only renders manifests (use --dry-run or `render`), "
                    "then `kubectl apply -f` them",
                    file=sys.stderr,
                )
                return 2
            for path in render_kuberay(config, out):
                print(path)
            return 0
        path = render_launcher(config, args.provider, out, args.verb)
    except (LauncherError, ValueError) as e:
        return exit_with_error(f"cluster: {first_line(e)}", 2)
    print(path)
    if args.dry_run or args.verb == "render":
        return 0
    missing = credentials_missing(args.provider)
    if missing:
        print(f"shardline: cluster {args.verb}: {missing}; nothing was started", file=sys.stderr)
        return 1
    token = Path(config.cluster.launcher.token_file).expanduser()
    if args.verb == "up" and not token.is_file():
        print(
            f"shardline: cluster up: no Ray auth token at {token}; create it with `ray get-auth-token --generate`",
            file=sys.stderr,
        )
        return 1
    return _ray_cli(args.verb, path)


def add_parser(sub: argparse._SubParsersAction) -> None:
    cluster = sub.add_parser(
        "cluster", help="render, check and start/stop a Ray cluster on AWS or Azure, or render KubeRay manifests"
    )
    cluster.add_argument(
        "verb",
        choices=["up", "down", "render"],
        help="up: `ray up`; down: `ray down`; render: only write (same as --dry-run)",
    )
    cluster.add_argument("--provider", required=True, choices=["aws", "azure", "kuberay"])
    cluster.add_argument("--config", metavar="FILE.toml", help="pipeline config (its [cluster.launcher])")
    cluster.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set cluster.launcher.aws.region=us-west-2",
    )
    cluster.add_argument("--dry-run", action="store_true", help="render and check, print the path, start nothing")
    cluster.add_argument("--out", metavar="DIR", help="where rendered files go (default $SHARDLINE_HOME/cluster)")
    cluster.set_defaults(func=_cmd_cluster)
