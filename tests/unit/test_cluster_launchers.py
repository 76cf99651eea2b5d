"""Ray cluster-launcher configs rendered from [cluster.launcher] pass Ray's own checks (schema, prepare_config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from infra.launch.config import AwsLauncher, LauncherConfig
from infra.launch.render import LauncherError, check_with_ray, launcher_config, write_yaml

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("provider", ["aws", "azure"])
def test_rendered_config_passes_ray_schema_and_prepare_config(provider):
    prepared = check_with_ray(launcher_config(LauncherConfig(), provider))
    types = prepared["available_node_types"]
    assert set(types) == {"head", "cpu_worker", "gpu_worker"}
    # explicit resources on every node type: the autoscaler needs them before a node exists (Azure never fills
    # them in), and the head advertises no CPU so work lands on workers
    assert types["head"]["resources"]["CPU"] == 0 and types["head"]["max_workers"] == 0
    assert types["cpu_worker"]["resources"]["CPU"] == 16 and "GPU" not in types["cpu_worker"]["resources"]
    assert types["gpu_worker"]["resources"]["GPU"] == 8
    assert prepared["docker"]["image"] == "rayproject/ray:2.60.0-py311"
    assert types["gpu_worker"]["docker"]["worker_image"] == "rayproject/ray:2.60.0-py311-gpu"
    commands = json.dumps([prepared[k] for k in prepared if k.endswith("_commands")])
    assert "${" not in commands and "SHARDLINE_GIT_REPOSITORY" not in commands  # nothing left to the node's shell
    assert "RAY_AUTH_MODE=token" in " ".join(prepared["head_start_ray_commands"])
    assert "RAY_AUTH_MODE=token" in " ".join(prepared["worker_start_ray_commands"])
    assert prepared["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token"}
    assert "ray-3.0.0.dev0" not in commands and "conda create" not in commands  # Ray's defaults did not leak in
    assert "'ray[serve,serve-grpc,train]==2.60.0'" in prepared["setup_commands"][0]


def test_git_url_is_installed_without_expanding_anything_on_the_node():
    cfg = LauncherConfig(git_url="https://github.com/acme/shardline.git", git_ref="v0.1.0")
    setup = check_with_ray(launcher_config(cfg, "aws"))["setup_commands"]
    expected = "python -m pip install -q --no-deps 'shardline @ git+https://github.com/acme/shardline.git@v0.1.0'"
    assert setup[-1] == expected


def test_aws_gpu_nodes_get_efa_interfaces_and_placement_group():
    aws = AwsLauncher(efa_interfaces=4, subnet_id="subnet-1", security_group_id="sg-1", placement_group="pg-a")
    prepared = check_with_ray(launcher_config(LauncherConfig(aws=aws), "aws"))
    gpu = prepared["available_node_types"]["gpu_worker"]
    nics = gpu["node_config"]["NetworkInterfaces"]
    assert [n["NetworkCardIndex"] for n in nics] == [0, 1, 2, 3] and {n["InterfaceType"] for n in nics} == {"efa"}
    assert [n["DeviceIndex"] for n in nics] == [0, 1, 1, 1]
    assert gpu["node_config"]["Placement"] == {"GroupName": "pg-a"}
    assert "--device=/dev/infiniband" in gpu["docker"]["worker_run_options"]  # EFA verbs inside the container
    cpu = prepared["available_node_types"]["cpu_worker"]["node_config"]
    assert "NetworkInterfaces" not in cpu and "Placement" not in cpu


def test_efa_without_subnet_is_a_config_error():
    with pytest.raises(ValidationError, match="needs subnet_id and security_group_id"):
        AwsLauncher(efa_interfaces=32)


def test_rdma_network_passes_devices_to_azure_gpu_containers():
    plain = launcher_config(LauncherConfig(), "azure")["available_node_types"]["gpu_worker"]["docker"]
    rdma = launcher_config(LauncherConfig(), "azure", rdma=True)["available_node_types"]["gpu_worker"]["docker"]
    assert "--device=/dev/infiniband" not in plain["worker_run_options"]
    assert "--device=/dev/infiniband" in rdma["worker_run_options"]


def test_ray_rejects_a_broken_config():
    config = launcher_config(LauncherConfig(), "azure")
    config["available_node_types"]["gpu_worker"]["resources"]["GPU"] = "eight"
    with pytest.raises(LauncherError, match="azure launcher config rejected by Ray"):
        check_with_ray(config)


@pytest.mark.parametrize("provider", ["aws", "azure"])
def test_checked_in_template_is_the_default_rendering(provider, tmp_path):
    """infra/ray/*.yaml are what `shardline cluster render` writes for the defaults: they cannot drift."""
    from flows.cli.cluster import render_launcher
    from flows.config import PipelineConfig

    path = render_launcher(PipelineConfig(), provider, tmp_path, "render")
    assert path.read_text() == (REPO / "infra" / "ray" / f"{provider}.yaml").read_text()
    assert yaml.safe_load(path.read_text())["provider"]["type"] == provider


def test_yaml_writer_keeps_multiline_strings_readable(tmp_path):
    path = write_yaml({"a": "x\ny\n", "b": [1], "c": [1]}, tmp_path / "o.yaml", "hello")
    text = path.read_text()
    assert text.startswith("# hello\n") and "a: |\n  x\n  y\n" in text and "&id" not in text
