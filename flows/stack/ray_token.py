"""Where the Ray dashboard's token is and how to print it, for `shardline status`: never the token itself.

The local head runs with Ray's token auth (infra.ray_env._run_ray), so its dashboard opens on a token prompt. Ray
reads the token from $RAY_AUTH_TOKEN, else the file $RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token, and
`ray get-auth-token` prints it (Ray's token-auth docs). The hint names that file and that command, so the token
stays out of logs and of `status --json` captured elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from flows.stack.service import bin_path
from infra.ray_env import token_file


def token_hint(env: Mapping[str, str] = os.environ) -> str:
    """One line: where the dashboard's token is and the command that prints it, with a warning when the token file
    can be read by other users (Ray writes it with the default umask)."""
    if env.get("RAY_AUTH_MODE", "token").lower() != "token":
        return f"none needed (RAY_AUTH_MODE={env['RAY_AUTH_MODE']})"
    command = f"{bin_path('ray')} get-auth-token"
    if env.get("RAY_AUTH_TOKEN"):
        return f"in $RAY_AUTH_TOKEN of this shell; print it with: {command}"
    path = token_file(env)
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return f"no token file at {path} yet (`shardline up` creates it with the Ray head)"
    hint = f"in {path} (mode {mode:o}); print it with: {command}"
    if mode & 0o077:
        hint += f"  WARNING: other users can read it: chmod 600 {path}"
    return hint
