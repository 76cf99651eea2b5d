"""Selecting a later test of a scenario module runs the tests it builds on (support/scenarios.py): a test's
outcome does not depend on what else was selected. Run by pytest's own pytester, in this process."""

from __future__ import annotations

pytest_plugins = ["pytester"]

SCENARIO = """
import pytest

pytestmark = pytest.mark.scenario
STATE = []

def test_first():
    STATE.append("first")

def test_second():
    STATE.append("second")

def test_third_needs_the_first():
    assert STATE[0] == "first"
    STATE.append("third")
"""

PLAIN = """
def test_alone():
    pass

def test_other():
    pass
"""


def _run(pytester, *args: str):
    pytester.makeini("[pytest]\nmarkers =\n    scenario: chained\n")
    pytester.makepyfile(test_story=SCENARIO, test_plain=PLAIN)
    return pytester.runpytest("-p", "support.scenarios", "-p", "no:cacheprovider", *args)


def test_a_later_test_runs_with_the_ones_before_it(pytester):
    result = _run(pytester, "-k", "third or alone", "-v")
    result.assert_outcomes(passed=4)  # first, second, third, and the plain module's one selected test
    ran = [line.split("::")[1].split()[0] for line in result.outlines if " PASSED" in line]
    assert [name for name in ran if name != "test_alone"] == ["test_first", "test_second", "test_third_needs_the_first"]
    result.stdout.fnmatch_lines(["*scenario test_story.py: also runs test_first, test_second (the selection*"])


def test_a_selection_that_starts_the_scenario_adds_nothing(pytester):
    result = _run(pytester, "-k", "test_first or other")  # test_other is not a scenario's: it stays alone too
    result.assert_outcomes(passed=2)
    assert "also runs" not in result.stdout.str()
