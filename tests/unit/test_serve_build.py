"""The replicas' code version: which project files it covers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from deployments.serve_build import _REPLICA_ROOTS, _code_files

ROOT = Path(__file__).resolve().parents[2]


def test_the_code_version_covers_every_project_file_a_replica_imports():
    """Importing the replicas' modules in a fresh interpreter loads only files the code version hashes, the router's
    chat mixin among them (a hand-kept list missed it, and a change there did not redeploy the routers)."""
    modules = [r.removesuffix(".py").replace("/", ".") for r in _REPLICA_ROOTS]
    probe = (
        f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps([getattr(m, '__file__', None) or '' for m in list(sys.modules.values())]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    loaded = {str(Path(f).resolve().relative_to(ROOT)) for f in json.loads(out) if f.startswith(str(ROOT) + "/")}
    loaded = {f for f in loaded if f.split("/")[0] in ("deployments", "training", "infra")}
    assert "deployments/router_chat.py" in loaded
    assert loaded <= set(_code_files()), sorted(loaded - set(_code_files()))
    assert all((ROOT / f).is_file() for f in _code_files())
