"""Deploy prefect.yaml to the stack's Prefect server, stamped with the commit that workers must run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from flows.stack.procs import StackError
from flows.stack.service import bin_path, service_env
from infra.redact import find_credential, redact

REPO = Path(__file__).resolve().parents[2]


def git_head(repo: Path) -> str:
    """The commit checked out in `repo`.

    Raises:
        StackError: `repo` is not a git checkout (workers clone the deployed commit, so there must be one).
    """
    proc = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    sha = proc.stdout.strip()
    if proc.returncode != 0 or len(sha) != 40:
        raise StackError(f"deploy: {repo} is not a git checkout with a commit; workers clone the deployed commit")
    return sha


def deploy_all(api_url: str, repo: Path = REPO, repository: str = "", commit: str = "", timeout_s: float = 600) -> str:
    """`prefect deploy --all` from `repo` with the pull step pinned to `commit` of `repository`; return the commit.

    Defaults: $SHARDLINE_GIT_REPOSITORY / $SHARDLINE_GIT_COMMIT when set (CI, the git hook), else this checkout's
    path and HEAD. Uncommitted changes are not deployed: workers run what git has.

    Raises:
        StackError: the repository URL carries a credential, or the deploy failed (its last output lines are in the
            message).
    """
    repository = repository or os.environ.get("SHARDLINE_GIT_REPOSITORY") or str(repo)
    found = find_credential(repository)
    if found and found != "a user/token in the URI":  # the pull step is stored by Prefect and shown in its UI
        # (a bare user is not refused: ssh://git@github.com/..., https://org@dev.azure.com/...)
        raise StackError(
            f"deploy: the git repository {redact(repository)} carries {found}: Prefect would store it in every "
            "deployment's pull step; give the URL only and the token as a git_clone credentials block"
        )
    commit = commit or os.environ.get("SHARDLINE_GIT_COMMIT") or git_head(repo)
    env = service_env(
        {"PREFECT_API_URL": api_url, "SHARDLINE_GIT_REPOSITORY": repository, "SHARDLINE_GIT_COMMIT": commit}
    )
    proc = subprocess.run(
        [bin_path("prefect"), "--no-prompt", "deploy", "--all"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
        raise StackError("deploy: `prefect deploy --all` failed:\n" + "\n".join(lines))
    return commit
