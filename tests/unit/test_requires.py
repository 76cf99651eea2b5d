"""A missing program that `make test` installs skips a developer's test but fails it under CI."""

from __future__ import annotations

import pytest
from support.requires import missing, under_ci


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_under_ci_a_missing_program_fails_the_test(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    assert under_ci()
    with pytest.raises(pytest.fail.Exception, match=r"^no prometheus \(CI: `make test` installs it"):
        missing("no prometheus")


@pytest.mark.parametrize("value", [None, "", "0", "false", "No"])
def test_elsewhere_a_missing_program_skips_the_test_and_says_why(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert not under_ci()
    with pytest.raises(pytest.skip.Exception, match=r"^no prometheus$"):
        missing("no prometheus")
