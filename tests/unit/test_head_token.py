"""A head start runs `ray get-auth-token --generate` (a `ray` process, ~1.8 s) only where Ray has no token yet."""

from __future__ import annotations

import pytest

from infra.ray_env import has_token


@pytest.mark.parametrize(
    ("env_token", "file_text", "has"),
    [
        ("", None, False),  # a fresh machine: no variable, no file
        ("", "", False),  # an empty file is no token (Ray would generate one)
        ("", "\n", False),
        ("", "f00d" * 16, True),
        ("t0ken", None, True),  # $RAY_AUTH_TOKEN comes first, as in Ray's loader
        ("  ", None, False),
    ],
)
def test_a_token_is_generated_only_where_ray_has_none(env_token, file_text, has, tmp_path, monkeypatch):
    token_file = tmp_path / "auth_token"
    if file_text is not None:
        token_file.write_text(file_text)
    monkeypatch.setenv("RAY_AUTH_TOKEN", env_token)
    assert has_token(token_file) is has
