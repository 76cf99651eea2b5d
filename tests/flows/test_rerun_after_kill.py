"""Crash anywhere, rerun, lose nothing: for each stage, SIGKILL the whole `shardline run` process tree once that
stage is running and run the same command again: it completes, the registry holds one version, training continued
from the newest complete checkpoint of the killed attempt (or was reused whole), nothing of the killed run is left
running. Continuing from the champion and the canary stage's kill are tests/flows/test_pipeline.py's, the latter
against a live endpoint."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest
from support.procs import alive, kill_tree

from training import checkpoint as ck
from training import resume

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
STEPS = {"train_fsdp": 60}  # long enough to be caught between checkpoints; the other cases train the fewest steps
COMMAND = [
    sys.executable,
    "-m",
    "flows.cli",
    "run",
    "--config",
    "configs/debug.toml",
    "--json",
    "--set",
    "train.log_every=1",
    "--set",
    "canary.enabled=false",
]


def _command(stage: str) -> list[str]:
    # No live endpoint (10-14 s a run) where it plays no part; the promote case keeps it, so that a kill that
    # lands just after registration still finds the run inside a stage.
    serving = [] if stage == "promote_model" else ["--set", "serve.enabled=false"]
    return [*COMMAND, "--set", f"train.steps={STEPS.get(stage, 20)}", *serving]


def _env(home: Path, api_url: str = "") -> dict[str, str]:
    """The CLI's environment: its own temporary Prefect server, or the one at `api_url` (as under `shardline up`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "MLFLOW_TRACKING_URI"))}
    return {**env, "SHARDLINE_HOME": str(home), **({"PREFECT_API_URL": api_url} if api_url else {})}


def _run(home: Path, stage: str, api_url: str = "") -> dict:
    proc = subprocess.run(
        _command(stage), cwd=REPO, env=_env(home, api_url), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _complete(home: Path) -> tuple[int, str] | None:
    return ck.latest_complete([str(p) for p in (home / "checkpoints").glob("train-*/checkpoint_0*")])


def _stages(home: Path, status: str) -> set[str]:
    """The stages whose MLflow child run has `status` now (read straight from the run's SQLite store)."""
    db = home / "mlflow.db"
    if not db.exists():
        return set()
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)) as con:
            rows = con.execute(
                "SELECT t.value FROM tags t JOIN runs r ON r.run_uuid = t.run_uuid "
                "WHERE t.key = 'shardline.stage' AND r.status = ?",
                (status,),
            ).fetchall()
    except sqlite3.Error:  # not created yet, or a writer holds it this instant
        return set()
    return {value for (value,) in rows}


def _stage_is_running(home: Path, stage: str) -> bool:
    """True once every stage named in `stage` ("a+b": at the same time) is running."""
    if stage == "train_fsdp":  # mid-training: a complete checkpoint exists and more steps are to come
        found = _complete(home)
        return found is not None and found[0] >= 10
    running = _stages(home, "RUNNING")
    if stage == "promote_model" and "canary_deploy" in running:
        # registering takes ~60 ms, less than a poll may take on 2 busy cores: when it finished between two polls,
        # the kill lands in the next stage, right after it (the registry then holds the version and its alias)
        return "promote_model" in _stages(home, "FINISHED")
    return set(stage.split("+")) <= running


# With data.engine = "local" the corpus is sharded while Ray starts: one kill while both run covers both stages.
@pytest.mark.parametrize(
    "stage", ["shard_dataset+provision_cluster", "train_fsdp", "validate_checkpoint", "promote_model"]
)
def test_sigkill_at_a_stage_then_rerun_completes_and_registers_once(stage, tmp_path, run_home, request):
    import mlflow

    # The training case runs with the CLI's own temporary Prefect server, killed with the rest of the tree; the
    # others share the session's server (a temporary server costs ~10 s per run on 2 busy cores).
    api_url = "" if stage == "train_fsdp" else request.getfixturevalue("prefect_server")
    home, started = run_home, time.monotonic()
    log = (tmp_path / "killed.log").open("w")
    killed = subprocess.Popen(_command(stage), cwd=REPO, env=_env(home, api_url), stdout=log, stderr=subprocess.STDOUT)
    deadline, pids = time.monotonic() + 600, []
    while time.monotonic() < deadline and killed.poll() is None:
        if _stage_is_running(home, stage):
            pids = kill_tree(killed.pid)
            break
        time.sleep(0.01 if stage == "promote_model" else 0.1)
    killed.wait(timeout=30)
    assert pids, f"the run ended before {stage} was seen running: {(tmp_path / 'killed.log').read_text()[-3000:]}"
    at_kill = _complete(home)
    time.sleep(1.0)
    assert not [p for p in pids if alive(p)]
    uri = f"sqlite:///{home / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri, registry_uri=uri)
    killed_train = [
        r
        for r in client.search_runs(
            [e.experiment_id for e in client.search_experiments()], "tags.`shardline.stage` = 'train_fsdp'"
        )
    ]
    trained_before = [r for r in killed_train if r.info.status == "FINISHED"]
    validated_before = [
        r
        for r in client.search_runs(
            [e.experiment_id for e in client.search_experiments()],
            "tags.`shardline.stage` = 'validate_checkpoint' and attributes.status = 'FINISHED'",
        )
    ]
    name = "shardline-debug"
    champion_before = (
        client.get_registered_model(name).aliases.get("champion")
        if client.search_registered_models(f"name = '{name}'")
        else None
    )
    registered_before = bool(client.search_model_versions(f"name = '{name}'"))

    summary = _run(home, stage, api_url)
    assert summary["model_version"] == "1" and summary["decision"] == "first-champion"
    assert [str(v.version) for v in client.search_model_versions(f"name = '{summary['model_name']}'")] == ["1"]
    train_stage = next(
        r
        for r in client.search_runs(
            [e.experiment_id for e in client.search_experiments()],
            f"tags.`shardline.stage` = 'train_fsdp' and tags.`mlflow.parentRunId` = '{summary['parent_run_id']}'",
        )
    )
    if trained_before:  # the killed run had finished training: reused whole, not one step trained again
        assert stage in ("validate_checkpoint", "promote_model")
        assert train_stage.data.tags[resume.TAG_REUSED_FROM] == trained_before[0].info.run_id
        assert summary["train_run_id"] == trained_before[0].info.run_id
        assert not client.get_metric_history(train_stage.info.run_id, "loss")
    else:  # trained in the rerun, from the newest complete checkpoint of the killed attempt (none: from step 0)
        assert stage in ("shard_dataset+provision_cluster", "train_fsdp")
        resumed = at_kill[0] if at_kill else 0
        assert (stage == "train_fsdp") == (resumed > 0)
        final = Path(summary["checkpoint_uri"])
        if at_kill:
            assert final.parent == Path(at_kill[1]).parent  # the same Ray Train run (named by the training key)
        manifest = json.loads((final / ck.manifest_name(0)).read_text())
        assert manifest["step"] == STEPS.get(stage, 20) and manifest["resumed_from"] == resumed
        assert train_stage.data.tags[resume.TAG_RESUMED_FROM_STEP] == str(resumed)
        losses = sorted(client.get_metric_history(summary["train_run_id"], "loss"), key=lambda m: m.step)
        assert losses[0].step == resumed + 1  # no step before the checkpoint was trained again
    version_tags = client.get_model_version(name, "1").tags
    rerun_validated = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        f"tags.`shardline.stage` = 'validate_checkpoint' and tags.`mlflow.parentRunId` = '{summary['parent_run_id']}'",
    )
    if validated_before and champion_before is None:  # same checkpoint, data and champion: Prefect's cache
        assert stage == "promote_model" and not rerun_validated
        assert version_tags["shardline.validation_run_id"] == validated_before[0].info.run_id
    else:  # validated in the rerun (the killed validation never returned; or the champion changed since)
        assert [r.info.status for r in rerun_validated] == ["FINISHED"]
        if registered_before:  # the killed promote registered it from its own model: its lineage stays that one's
            assert version_tags["shardline.validation_run_id"] == validated_before[0].info.run_id
            revalidated = json.loads(version_tags["shardline.revalidated_by"])
            assert revalidated["validation_run_id"] == rerun_validated[0].info.run_id
        else:
            assert version_tags["shardline.validation_run_id"] == rerun_validated[0].info.run_id
    # The killed run's MLflow runs did not stay RUNNING: the rerun found their process gone and ended them.
    every_run = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_name for r in every_run if r.info.status == "RUNNING"] == []
    ended = [r for r in every_run if r.info.status == "KILLED"]
    assert "pipeline" in {r.data.tags.get("shardline.stage") for r in ended}  # and the stages it was running
    assert all(
        r.data.tags["shardline.ended_by"].startswith(f"run {summary['parent_run_id']}: owner process ") for r in ended
    )
    print(f"{stage}: kill and rerun took {time.monotonic() - started:.1f} s")
