"""The Ray auth token a head start generates is the cluster's password: the file is the owner's alone from the
moment `ray get-auth-token --generate` writes it (Ray writes it with the process umask, 0644 under 022)."""

from __future__ import annotations

import os
import stat

from infra.ray_env import _run_ray


def test_the_generated_ray_token_file_is_never_readable_by_others(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # Ray writes ~/.ray/auth_token
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    before = os.umask(0o022)  # a usual umask: Ray alone would make the file world-readable
    try:
        _run_ray(["get-auth-token", "--generate"], umask=0o077)
    finally:
        os.umask(before)
    token = tmp_path / ".ray" / "auth_token"
    assert token.read_text().strip() and stat.S_IMODE(token.stat().st_mode) == 0o600
