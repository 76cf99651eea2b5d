"""Crash anywhere, rerun, lose nothing: SIGKILL the whole `shardline run` process tree while it trains, run the same
command again: it completes, training continued from the newest complete checkpoint of the killed attempt, the
registry holds one version, nothing of the killed run is left running. A third run continues from the champion
(train.init_from = "champion") and starts far below a from-scratch loss."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from train_support import kill_tree  # noqa: E402
from training import checkpoint as ck  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
COMMAND = [sys.executable, "-m", "flows.cli", "run", "--config", "configs/debug.toml", "--json",
           "--set", "train.steps=60", "--set", "train.log_every=1", "--set", "canary.enabled=false"]


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "MLFLOW_TRACKING_URI"))}
    return {**env, "SHARDLINE_HOME": str(home)}


def _run(home: Path) -> dict:
    proc = subprocess.run(COMMAND, cwd=REPO, env=_env(home), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _complete(home: Path) -> tuple[int, str] | None:
    return ck.latest_complete([str(p) for p in (home / "checkpoints").glob("train-*/checkpoint_0*")])


def test_sigkill_while_training_then_rerun_resumes_and_registers_once(tmp_path, run_home):
    import mlflow

    home = run_home
    log = (tmp_path / "killed.log").open("w")
    killed = subprocess.Popen(COMMAND, cwd=REPO, env=_env(home), stdout=log, stderr=subprocess.STDOUT)
    deadline, pids = time.monotonic() + 600, []
    while time.monotonic() < deadline and killed.poll() is None:
        found = _complete(home)
        if found and found[0] >= 10:
            pids = kill_tree(killed.pid)
            break
        time.sleep(0.2)
    killed.wait(timeout=30)
    assert pids, f"the run ended before it could be killed mid-training: {(tmp_path / 'killed.log').read_text()[-3000:]}"
    at_kill = _complete(home)
    assert at_kill is not None and at_kill[0] < 60
    time.sleep(1.0)
    assert not [p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1][:3]]

    summary = _run(home)
    assert summary["model_version"] == "1" and summary["decision"] == "first-champion"
    final = Path(summary["checkpoint_uri"])
    assert final.parent == Path(at_kill[1]).parent  # the same Ray Train run (named by the training key)
    manifest = json.loads((final / ck.manifest_name(0)).read_text())
    assert manifest["step"] == 60 and manifest["resumed_from"] == at_kill[0]
    uri = f"sqlite:///{home / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri, registry_uri=uri)
    assert [str(v.version) for v in client.search_model_versions(f"name = '{summary['model_name']}'")] == ["1"]
    train = client.get_run(summary["train_run_id"])
    assert train.data.tags["shardline.resumed_from_step"] == str(at_kill[0])
    resumed_losses = sorted(client.get_metric_history(summary["train_run_id"], "loss"), key=lambda m: m.step)
    assert resumed_losses[0].step == at_kill[0] + 1  # no step before the checkpoint was trained again

    # the same command once more: the champion exists now, so it continues from it (new training, version 2)
    third = _run(home)
    assert third["model_version"] == "2"
    tags = client.get_run(third["train_run_id"]).data.tags
    assert tags["shardline.init_from_version"] == f"{summary['model_name']}/1"
    assert tags["shardline.init_from_checkpoint"] == summary["checkpoint_uri"]
    continued = sorted(client.get_metric_history(third["train_run_id"], "loss"), key=lambda m: m.step)
    scratch_first = 5.545  # ln 256: an untrained byte model's loss
    assert continued[0].step == 1 and continued[0].value < scratch_first - 1.0
