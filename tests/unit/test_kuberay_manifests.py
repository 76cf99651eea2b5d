"""KubeRay RayCluster / RayJob / RayService rendered from the config pass the KubeRay CRD schemas (v1.7.0)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from support.kuberay_schema import spec_errors

from flows.cli.cluster import render_kuberay
from flows.config import ConfigError, PipelineConfig, load_config

REPO = Path(__file__).resolve().parents[2]


def _render(tmp_path: Path, config: PipelineConfig | None = None) -> dict[str, dict]:
    paths = render_kuberay(config or PipelineConfig(), tmp_path)
    return {p.stem: yaml.safe_load(p.read_text()) for p in paths}


def _cluster_spec(manifest: dict) -> dict:
    spec = manifest["spec"]
    return spec.get("rayClusterSpec") or spec.get("rayClusterConfig") or spec


def test_manifests_pass_the_crd_schemas(tmp_path):
    manifests = _render(tmp_path)
    assert {m["kind"] for m in manifests.values()} == {"RayCluster", "RayJob", "RayService"}
    for name, manifest in manifests.items():
        assert spec_errors(manifest) == [], name


def test_autoscaling_auth_ports_and_gpu_group(tmp_path):
    for manifest in _render(tmp_path).values():
        spec = _cluster_spec(manifest)
        assert spec["rayVersion"] == "2.60.0" and spec["enableInTreeAutoscaling"] is True
        head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
        assert {p["containerPort"] for p in head["ports"]} == {6379, 8265, 10001, 8080, 8000}
        assert head["image"] == "shardline:0.1.0"  # the project's image, not plain Ray
        groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
        gpu = groups["gpu"]
        assert (gpu["minReplicas"], gpu["maxReplicas"]) == (0, 4)
        worker = gpu["template"]["spec"]["containers"][0]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert worker["resources"]["requests"] == worker["resources"]["limits"]
        for container in (head, worker):
            env = {e["name"]: e for e in container["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token"
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
                "name": "shardline-ray-token",
                "key": "auth_token",
            }
        assert {e["name"]: e.get("value") for e in worker["env"]}["NCCL_IB_DISABLE"] == "1"  # tcp default


def test_working_dir_code_ships_the_repo_and_its_dependencies(tmp_path):
    config = load_config(
        None,
        [
            "cluster.launcher.kuberay.code=working_dir",
            "cluster.launcher.kuberay.working_dir_uri=s3://bucket/shardline.zip",
            "cluster.network=roce",
        ],
    )
    manifests = _render(tmp_path, config)
    job = manifests["rayjob"]
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert runtime_env["working_dir"] == "s3://bucket/shardline.zip"
    assert "torch==2.13.0" in runtime_env["pip"] and runtime_env["env_vars"]["NCCL_IB_GID_INDEX"] == "3"
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"] == "rayproject/ray:2.60.0-py311"
    serve = yaml.safe_load(manifests["rayservice"]["spec"]["serveConfigV2"])
    assert serve["applications"][0]["import_path"] == "deployments.endpoint_builder:app"
    assert serve["applications"][0]["runtime_env"]["working_dir"] == "s3://bucket/shardline.zip"
    for manifest in manifests.values():
        assert spec_errors(manifest) == []


def test_validator_rejects_wrong_types_and_unknown_fields(tmp_path):
    job = _render(tmp_path)["rayjob"]
    bad_type = copy.deepcopy(job)
    bad_type["spec"]["rayClusterSpec"]["workerGroupSpecs"][1]["maxReplicas"] = "four"
    assert spec_errors(bad_type) == ["rayClusterSpec.workerGroupSpecs.1.maxReplicas: 'four' is not of type 'integer'"]
    typo = copy.deepcopy(job)
    typo["spec"]["rayClusterSpec"]["enableInTreeAutoscalling"] = True
    assert "'enableInTreeAutoscalling' was unexpected" in spec_errors(typo)[0]
    quantity = copy.deepcopy(job)
    quantity["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "cpu"
    ] = "4 cores"
    assert len(spec_errors(quantity)) == 1
    start_param = copy.deepcopy(job)  # rayStartParams are strings; an int would fail at the API server
    start_param["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    assert spec_errors(start_param) == [
        "rayClusterSpec.headGroupSpec.rayStartParams.num-cpus: 0 is not of type 'string'"
    ]


def test_working_dir_without_uri_is_a_clear_error(tmp_path):
    config = load_config(None, ["cluster.launcher.kuberay.code=working_dir"])
    with pytest.raises(ValueError, match="needs working_dir_uri"):
        render_kuberay(config, tmp_path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["gpu_min_replicas=9", "gpu_max_replicas=1"], "gpu_min_replicas=9 > gpu_max_replicas=1"),
        (["cpu_min_replicas=5", "cpu_max_replicas=2"], "cpu_min_replicas=5 > cpu_max_replicas=2"),
        (["name=Bad_Name"], "cluster.launcher.kuberay.name: String should match pattern"),
        (["namespace=UPPER_ns"], "cluster.launcher.kuberay.namespace: String should match pattern"),
    ],
)
def test_what_kubernetes_would_refuse_is_a_config_error_before_rendering(override, message):
    """Kubernetes names are RFC 1123 labels, and an autoscaling group's minimum is within its maximum: a mistake
    is one line at config load, not a manifest the API server (or the autoscaler) refuses later."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"cluster.launcher.kuberay.{o}" for o in override])


@pytest.mark.parametrize("name", ["raycluster", "rayjob", "rayservice"])
def test_checked_in_manifests_are_the_default_rendering(name, tmp_path):
    render_kuberay(PipelineConfig(), tmp_path)
    rendered = (tmp_path / "kuberay" / f"{name}.yaml").read_text()
    assert rendered == (REPO / "infra" / "kuberay" / f"{name}.yaml").read_text()
