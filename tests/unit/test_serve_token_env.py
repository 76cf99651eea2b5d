"""serve.auth_token_env names an environment variable: a token pasted there would reach Prefect's parameters and
MLflow, and the endpoint would serve without auth (no variable has that name); it is refused, without echoing it."""

from __future__ import annotations

import pytest

from flows.config import ConfigError, load_config


@pytest.mark.parametrize("pasted", ["sk-abc123", "9f8e7d6c-5b4a39281706f5e4d3c2b1a0", "Bearer xyz"])
def test_a_token_pasted_where_its_variable_name_goes_is_refused_unshown(pasted):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f'serve.auth_token_env="{pasted}"'])
    assert str(err.value) == (
        "config (with --set): serve.auth_token_env: the name of an environment variable (e.g. SHARDLINE_SERVE_TOKEN), "
        "not the token itself (got '***')"
    )


def test_a_variable_name_or_none_is_taken():
    assert load_config(None, ['serve.auth_token_env="TEAM_API_TOKEN"']).serve.auth_token_env == "TEAM_API_TOKEN"
    assert load_config(None, ['serve.auth_token_env=""']).serve.auth_token_env == ""  # no auth, said outright
