"""Which project files a Serve deployment runs, and their hash: the code part of its Serve version.

A deployment's replicas run its module and every project module that one imports, at any depth and from inside
functions too (a function-level import runs in the replica when the function does). Following the import statements
finds them, where a hand-kept list drifted: it missed the router's chat mixin, so a change there did not redeploy
the routers, and the gateway's missed the module its /metrics merge moved to. The walk errs towards too many: a
function-level import of the data pipeline (training/evaluate.py) brings training/data in, so an edit there also
redeploys the models' replicas. Relative imports are followed too. Plain Python; nothing is imported.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("deployments", "training", "infra")  # the project's own; every other import is a dependency


def _imported(rel: str, node: ast.AST) -> list[str]:
    """The dotted names an import statement in file `rel` may load: the module, and each name as a submodule."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the file's package, `level - 1` packages up
        base = ".".join([*Path(rel).parents[node.level - 1].parts, *([base] if base else [])])
    return [base, *(f"{base}.{a.name}" for a in node.names)] if base else []


@functools.cache
def code_files(roots: tuple[str, ...]) -> tuple[str, ...]:
    """The project's files (relative paths) that the modules `roots` (relative paths) import, roots included, with
    the `__init__.py` of every package on the way (importing a.b.c runs a/__init__ and a/b/__init__ too)."""
    found: set[str] = set()
    todo = list(roots)
    while todo:
        rel = todo.pop()
        if rel in found:
            continue
        found.add(rel)
        for node in ast.walk(ast.parse((ROOT / rel).read_text(), rel)):
            for name in _imported(rel, node):
                parts = name.split(".")
                if parts[0] not in PACKAGES:
                    continue
                packages = [f"{'/'.join(parts[:i])}/__init__.py" for i in range(1, len(parts) + 1)]
                path = "/".join(parts)
                todo += [c for c in (f"{path}.py", *packages) if (ROOT / c).is_file()]
    return tuple(sorted(found))


def code_hash(roots: tuple[str, ...]) -> str:
    """sha256 over the bytes of code_files(roots), in order (12 hex digits)."""
    h = hashlib.sha256()
    for rel in code_files(roots):
        h.update(rel.encode() + b"\0" + (ROOT / rel).read_bytes())
    return h.hexdigest()[:12]
