"""The code part of a Serve deployment's version (deployments/code_files.py): every project file its replicas import.

A file missing from it is code that changes without redeploying: a hand-kept list missed the router's chat mixin,
and the gateway's missed the module its /metrics merge moved to."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.code_files import code_files
from deployments.gateway_control import GATEWAY_ROOTS
from deployments.serve_build import REPLICA_ROOTS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("roots", "expected"),
    [(REPLICA_ROOTS, "deployments/router_chat.py"), (GATEWAY_ROOTS, "deployments/router_metrics_share.py")],
    ids=["model-application", "gateway"],
)
def test_the_code_version_covers_every_project_file_a_deployment_imports(roots, expected):
    """Importing a deployment's modules in a fresh interpreter loads only files its code version hashes."""
    modules = [r.removesuffix(".py").replace("/", ".") for r in roots]
    probe = (
        f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps([getattr(m, '__file__', None) or '' for m in list(sys.modules.values())]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    loaded = {str(Path(f).resolve().relative_to(ROOT)) for f in json.loads(out) if f.startswith(str(ROOT) + "/")}
    loaded = {f for f in loaded if f.split("/")[0] in ("deployments", "training", "infra")}
    hashed = set(code_files(roots))
    assert expected in loaded and loaded <= hashed, sorted(loaded - hashed)
    assert all((ROOT / f).is_file() for f in hashed)
