"""Issue 11, test 1: a remote Ray cluster that does not have shardline installed runs the training as a Ray Job.

The head is a separate `ray start --head` process (token auth, dashboard on 127.0.0.1) whose Python sees the
project's dependencies but not the project: the code arrives by the job's runtime env. The pipeline in
`cluster.mode = "remote"` submits training to the job server; its follower is SIGKILLed while the job runs, the
same command again re-attaches to the same job id (the cluster holds exactly one training job), completes, and
the run's lineage names the job. A credential planted in the driver's environment reaches no job metadata.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from support.procs import kill, kill_tree, tree

REPO = Path(__file__).resolve().parents[2]
PLANTED = "planted-secret-0f3c9a"
pytestmark = pytest.mark.slow


def _cluster_python(root: Path) -> Path:
    """A venv whose site-packages reaches the project's dependencies through a plain path line: the editable
    install's .pth (and so its import finder) lives in that folder and is not executed from there."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))
    (site / "project_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return root / "bin" / "python"


def _cluster_env(python: Path, home: Path) -> dict[str, str]:
    keep = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "SHARDLINE_", "MLFLOW_", "PREFECT_", "VIRTUAL_ENV", "AWS_"))
    }
    return {
        **keep,
        "PATH": f"{python.parent}{os.pathsep}{keep.get('PATH', '')}",
        "PYTHONNOUSERSITE": "1",
        "RAY_AUTH_MODE": "token",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HOME": os.environ.get("HOME", str(home)),
    }


@pytest.fixture(scope="module")
def bare_head(tmp_path_factory):
    """(job-server URL, cluster python, its env) of a Ray head on 127.0.0.1 without shardline; stopped by its PIDs."""
    from infra.cluster import free_port
    from infra.head import _descendants, _forget_current_cluster, _kill, _node_processes

    tmp_path = tmp_path_factory.mktemp("bare-head")
    python = _cluster_python(tmp_path / "cluster-env")
    env, cwd = _cluster_env(python, tmp_path), tmp_path  # a cwd outside the repo: nothing of it on sys.path
    ray_cli = [str(python), "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]
    subprocess.run([*ray_cli, "get-auth-token", "--generate"], env=env, cwd=cwd, capture_output=True, timeout=120)
    port, dash, agent, agent_grpc, metrics, client_port = (free_port() for _ in range(6))
    # every port chosen free: Ray's fixed defaults (agent 52365, ...) collide with other heads on a shared host
    started = subprocess.run(
        [
            *ray_cli,
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--num-cpus=4",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}",
            f"--ray-client-server-port={client_port}",
            "--disable-usage-stats",
            f"--object-store-memory={256 * 1024 * 1024}",
        ],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        start_new_session=True,
    )
    pids = _node_processes(str(port))
    _forget_current_cluster(str(port))
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        yield f"http://127.0.0.1:{dash}", python, env
    finally:
        _kill(_descendants(pids + _node_processes(str(port))))
        _forget_current_cluster(str(port))


def _command(address: str, shared: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "flows.cli",
        "run",
        "--config",
        "configs/debug.toml",
        "--json",
        "--set",
        "cluster.mode=remote",
        "--set",
        f"cluster.address={address}",
        "--set",
        f'cluster.shared_paths=["{shared}"]',
        "--set",
        "canary.enabled=false",
    ]


def _driver_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "MLFLOW_TRACKING_URI"))}
    return {**env, "SHARDLINE_HOME": str(home), "AWS_SECRET_ACCESS_KEY": PLANTED, "MLFLOW_TRACKING_PASSWORD": PLANTED}


def _training_jobs(client) -> list:
    return [j for j in client.list_jobs() if (j.submission_id or "").startswith("shardline-train-")]


def test_training_runs_as_a_job_on_a_cluster_without_shardline_and_a_rerun_reattaches(bare_head, tmp_path):
    from mlflow import MlflowClient

    from infra.jobs import TAG_RAY_JOB_ID, job_client
    from training.checkpoint import verify_checkpoint

    address, cluster_python, cluster_env = bare_head
    probe = subprocess.run(
        [str(cluster_python), "-c", "import training"],
        env=cluster_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode != 0 and "No module named 'training'" in probe.stderr  # the cluster lacks the code
    shared = tmp_path / "shared"  # the head runs on this machine: a local folder every node sees
    home = shared / "home"
    client = job_client(address)
    before = {j.submission_id for j in _training_jobs(client)}

    log = (tmp_path / "killed.log").open("w")
    killed = subprocess.Popen(
        _command(address, shared), cwd=REPO, env=_driver_env(home), stdout=log, stderr=subprocess.STDOUT
    )
    job_id = _running_job(client, before, killed)
    pids = kill_tree(killed.pid) if job_id else []
    killed.wait(timeout=30)
    assert job_id, f"no training job ran before the follower ended: {(tmp_path / 'killed.log').read_text()[-3000:]}"
    assert pids

    rerun = subprocess.run(
        _command(address, shared), cwd=REPO, env=_driver_env(home), capture_output=True, text=True, timeout=400
    )
    (tmp_path / "rerun.log").write_text(rerun.stderr)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert f"re-attached to Ray job {job_id}" in rerun.stderr and "submitted training" not in rerun.stderr
    assert f"[{job_id}] trained 30 steps" in rerun.stderr  # the job's log streamed into the Prefect task log

    jobs = [j for j in _training_jobs(client) if j.submission_id not in before]
    assert [j.submission_id for j in jobs] == [job_id]  # re-attached: one training job for both attempts
    assert str(jobs[0].status).endswith("SUCCEEDED")
    uri = f"sqlite:///{home / 'mlflow.db'}"
    mlflow = MlflowClient(uri)
    train = mlflow.get_run(summary["train_run_id"])
    assert train.data.tags[TAG_RAY_JOB_ID] == job_id  # lineage names the job
    assert train.data.tags["shardline.ray_address"] == address
    assert summary["decision"] == "first-champion" and summary["model_version"] == "1"
    assert Path(summary["checkpoint_uri"]).is_relative_to(home / "checkpoints")
    assert verify_checkpoint(summary["checkpoint_uri"]).step == 30  # debug.toml's train.steps, complete

    # nothing planted in the driver's environment reached the job's metadata, runtime env or log
    info = client.get_job_info(job_id)
    assert PLANTED not in json.dumps(
        {"runtime_env": info.runtime_env, "metadata": info.metadata, "entrypoint": info.entrypoint}, default=str
    )
    assert "working_dir" in info.runtime_env and "training.job_entry" in info.entrypoint
    assert PLANTED not in client.get_job_logs(job_id)


def _running_job(client, before: set[str], follower: subprocess.Popen) -> str:
    """The id of the first new training job seen RUNNING while `follower` lives (up to 240 s); '' if none."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and follower.poll() is None:
        running = [
            j for j in _training_jobs(client) if str(j.status).endswith("RUNNING") and j.submission_id not in before
        ]
        if running:
            return running[0].submission_id
        time.sleep(0.3)
    return ""


def test_cancelling_the_run_stops_its_job(bare_head, tmp_path):
    """SIGTERM is how a Prefect worker cancels a flow run's process: the stage stops the job it follows."""
    from infra.jobs import job_client

    address, _, _ = bare_head
    client = job_client(address)
    before = {j.submission_id for j in _training_jobs(client)}
    shared = tmp_path / "shared"
    log_path = tmp_path / "cancelled.log"
    follower = subprocess.Popen(
        [*_command(address, shared), "--set", "train.steps=100000"],
        cwd=REPO,
        env=_driver_env(shared / "home"),
        stdout=subprocess.DEVNULL,
        stderr=log_path.open("w"),
        text=True,
    )
    job_id = _running_job(client, before, follower)
    if not job_id:
        kill_tree(follower.pid)
    assert job_id, log_path.read_text()[-3000:]
    below = tree(follower.pid)  # its temporary Prefect server among them
    follower.send_signal(signal.SIGTERM)
    try:
        follower.wait(timeout=120)
    finally:
        kill(below)  # what it left behind: the processes recorded above, each while it is still the one recorded
    assert follower.returncode != 0
    assert f"stopping Ray job {job_id}" in log_path.read_text(), log_path.read_text()[-3000:]
    deadline = time.monotonic() + 60
    while not str(client.get_job_status(job_id)).endswith("STOPPED") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert str(client.get_job_status(job_id)).endswith("STOPPED")
