"""Run by a deployment's pull step inside the fresh clone: does this interpreter satisfy the clone's dependencies?

A flow run imports the deployed commit's code from its clone (Prefect puts the clone first on sys.path) and its
dependencies from the worker's environment, which nothing changes. When a commit needs dependencies the worker
lacks, the run stops here with one line naming them, instead of failing later with an ImportError or, worse,
running against other versions. Installing into the worker at run time (`pip install -e .` from a directory
deleted after the run) is exactly what this replaces; see the README's section on the stack for the measurement.

Usage: python -m flows.stack.code_env [PYPROJECT]   (exit 0: satisfied; 1: missing or mismatched, listed)
"""

from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path


def unmet_requirements(pyproject: Path) -> list[str]:
    """The clone's `[project.dependencies]` this interpreter does not satisfy, as 'requirement (have: version)'."""
    from packaging.requirements import Requirement

    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    unmet = []
    for line in project.get("dependencies", []):
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{line} (not installed)")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{line} (have {have})")
    return unmet


def main(argv: list[str]) -> int:
    pyproject = Path(argv[0] if argv else "pyproject.toml")
    unmet = unmet_requirements(pyproject)
    if unmet:
        print(
            f"{pyproject.resolve()}: this commit needs dependencies the worker's environment ({sys.prefix}) "
            f"lacks: {'; '.join(unmet)}. Install them there (make install) and restart the worker."
        )
        return 1
    print(f"dependencies of {pyproject.resolve().parent.name} satisfied by {sys.prefix}; running from the clone")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
