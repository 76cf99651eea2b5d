"""git push deploys: a bare repository with infra/git/post-receive redeploys on push, and the next worker run
executes the pushed commit, not the branch head at run time."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from support.stack_support import REPO, assert_completed, create_run, deployment, mlflow_runs_of_flow_run, wait_for_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
IDENTITY = ["-c", "user.email=ci@shardline.invalid", "-c", "user.name=shardline-ci"]


def git(*args: str, cwd=None) -> str:
    proc = subprocess.run(["git", *IDENTITY, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"git {' '.join(args)}: {proc.stderr}"
    return proc.stdout + proc.stderr


def commit(work, message: str) -> str:
    with open(work / "configs" / "debug.toml", "a") as fh:
        fh.write(f"# {message}\n")
    git("commit", "-qam", message, cwd=work)
    return git("rev-parse", "HEAD", cwd=work).strip()


def test_push_redeploys_and_the_worker_runs_the_pushed_commit(stack, tmp_path):
    import sys

    bare, work = tmp_path / "shardline.git", tmp_path / "work"
    git("clone", "-q", "--bare", str(REPO), str(bare))
    shutil.copy(REPO / "infra" / "git" / "post-receive", bare / "hooks" / "post-receive")
    git("-C", str(bare), "config", "shardline.prefectApiUrl", stack["api"])
    git("-C", str(bare), "config", "shardline.python", sys.executable)
    git("-C", str(bare), "config", "shardline.testCommand", "")  # `make test` is what is running this test
    git("clone", "-q", str(bare), str(work))
    git("checkout", "-q", "-B", "main", cwd=work)

    pushed = commit(work, "deployed by the hook")
    out = git("push", "-q", "origin", "main", cwd=work)
    assert f"shardline: deployed {pushed}" in out, out
    manual = deployment(stack["api"], "shardline/manual")
    clone_step = manual["pull_steps"][0]["prefect.deployments.steps.git_clone"]
    assert clone_step == {"id": "clone", "repository": str(bare), "commit_sha": pushed}

    # The branch moves on without a deploy (the hook only deploys `main`; this push goes to the head of `main`
    # with the hook's branch set elsewhere): runs must still execute the deployed commit.
    git("-C", str(bare), "config", "shardline.branch", "release")
    head = commit(work, "pushed, not deployed")
    git("push", "-q", "origin", "main", cwd=work)
    assert git("-C", str(bare), "rev-parse", "main").strip() == head != pushed

    try:
        run = create_run(stack["api"], manual["id"], {"config": stack["config"]("stack-git")})
        done = wait_for_run(stack["api"], run["id"], 420, stack["log"])
        assert_completed(done, stack["log"])
        commits = {
            r.data.tags.get("shardline.git_commit")
            for r in mlflow_runs_of_flow_run(stack["tracking_uri"], run["id"])
            if r.data.tags.get("shardline.stage") == "pipeline"
        }
        assert commits == {pushed}
    finally:  # the other stack tests expect the deployments of this checkout
        from flows.stack.deploy import deploy_all

        deploy_all(stack["api"])
