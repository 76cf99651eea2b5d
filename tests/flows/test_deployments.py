"""prefect.yaml deploys for real: `prefect deploy --all` against a real Prefect server, then read back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from flows.config import PipelineConfig

REPO = Path(__file__).resolve().parents[2]


def test_prefect_yaml_parameters_are_valid_pipeline_configs():
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    entrypoints = {d["name"]: d["entrypoint"] for d in spec["deployments"]}
    assert entrypoints == {
        "nightly": "flows/pipeline.py:shardline_pipeline",
        "manual": "flows/pipeline.py:shardline_pipeline",
        "on-new-data": "flows/pipeline.py:shardline_pipeline",
        "release-from-shards": "flows/release.py:release_from_shards",
        "canary-version": "flows/canary_version.py:canary_version",
        "canary-control": "flows/canary_control.py:canary_control",
    }
    for d in spec["deployments"]:
        PipelineConfig.model_validate(d.get("parameters", {}).get("config", {}))
        assert d["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}


def test_prefect_deploy_creates_schedule_form_and_trigger(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.utilities.asyncutils import run_coro_as_sync

    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_server,
        "SHARDLINE_GIT_REPOSITORY": "https://example.invalid/shardline.git",
        "SHARDLINE_GIT_COMMIT": "0123456789abcdef0123456789abcdef01234567",
        "PREFECT_HOME": str(tmp_path),
    }
    prefect = str(Path(sys.executable).with_name("prefect"))
    pool = subprocess.run(
        [prefect, "work-pool", "create", "shardline-process", "--type", "process"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pool.returncode == 0 or "already exists" in pool.stdout + pool.stderr, pool.stdout + pool.stderr
    proc = subprocess.run(
        [prefect, "--no-prompt", "deploy", "--all"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    async def read():
        async with get_client() as client:
            out = {}
            for name in ("nightly", "manual", "on-new-data"):
                out[name] = await client.read_deployment_by_name(f"shardline/{name}")
            return out, await client.read_automations()

    deployments, automations = run_coro_as_sync(read())
    nightly = deployments["nightly"]
    assert [s.schedule.cron for s in nightly.schedules] == ["0 3 * * *"]
    assert nightly.parameters == {"config": {"train": {"steps": 300}}}
    # The UI form is the PipelineConfig JSON schema: every stage section is there, typed and described.
    schema = deployments["manual"].parameter_openapi_schema
    defs = schema.get("definitions") or schema.get("$defs")
    assert {"DataConfig", "TrainConfig", "CanaryConfig"} <= set(defs)
    assert defs["TrainConfig"]["properties"]["steps"]["type"] == "integer"
    assert defs["TrainConfig"]["properties"]["steps"]["description"]
    # Workers clone the deployed commit, not a branch head.
    clone = deployments["nightly"].pull_steps[0]["prefect.deployments.steps.git_clone"]
    assert clone["commit_sha"] == "0123456789abcdef0123456789abcdef01234567" and "branch" not in clone
    # The event trigger became an automation that runs the on-new-data deployment on `shardline.dataset.updated`.
    target = deployments["on-new-data"].id
    runs_it = [a for a in automations if any(getattr(action, "deployment_id", None) == target for action in a.actions)]
    assert len(runs_it) == 1
    assert runs_it[0].trigger.expect == {"shardline.dataset.updated"}
    # The canary's operator actions are a choice in the UI form, not free text.
    control = run_coro_as_sync(_read_deployment("canary-control/canary-control"))
    action = control.parameter_openapi_schema["properties"]["action"]
    assert action["enum"] == ["status", "pause", "resume", "promote", "abort"] and action["type"] == "string"
    assert control.parameter_openapi_schema["required"] == ["action"]


async def _read_deployment(name: str):
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return await client.read_deployment_by_name(name)
