"""A scenario module's tests build on each other in file order (one served model, released, rolled back, then its
router restarted; or one pipeline home whose first run makes the champion the later runs are judged against).
Marked `pytestmark = pytest.mark.scenario`, such a module's selected tests always run with the tests before them:
`pytest -k llama` runs the first run too, so a test's outcome does not depend on what else was selected.

A test named by node id (`file.py::test`) is the only one collected, so nothing can be added back: select a
scenario's tests with `-k` (or run the module).
"""

from __future__ import annotations

from collections import defaultdict

import pytest

_COLLECTED = pytest.StashKey[list]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_COLLECTED] = []


def pytest_itemcollected(item: pytest.Item) -> None:
    item.config.stash[_COLLECTED].append(item)


@pytest.hookimpl(trylast=True)  # after -k and -m deselected what they do not select
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    scenarios: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in config.stash.get(_COLLECTED, []):
        if item.get_closest_marker("scenario") is not None:
            scenarios[item.nodeid.split("::", 1)[0]].append(item)
    chosen = {item.nodeid for item in items}
    needed: dict[str, list[pytest.Item]] = {}
    for module, module_items in scenarios.items():
        picked = [i for i, item in enumerate(module_items) if item.nodeid in chosen]
        if picked and len(picked) != max(picked) + 1:  # an earlier test of the scenario was not selected
            needed[module] = module_items[: max(picked) + 1]
    if not needed:
        return
    out: list[pytest.Item] = []
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if module not in needed:
            out.append(item)
        elif needed[module]:  # the module's first selected test: the scenario up to its last selected one
            added = [it.name for it in needed[module] if it.nodeid not in chosen]
            reporter = config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"scenario {module}: also runs {', '.join(added)} (the selection builds on them)")
            out.extend(needed[module])
            needed[module] = []
    items[:] = out
