"""deployments/code_files.py reads import statements as Python resolves them (no file uses relative imports today,
so the walk's answer for them is checked here)."""

from __future__ import annotations

import ast

import pytest

from deployments.code_files import _imported


@pytest.mark.parametrize(
    ("rel", "statement", "names"),
    [
        ("deployments/x.py", "import training.model as m", ["training.model"]),
        ("deployments/x.py", "from training import model", ["training", "training.model"]),
        ("deployments/x.py", "from .gateway import Gateway", ["deployments.gateway", "deployments.gateway.Gateway"]),
        ("deployments/x.py", "from . import gateway", ["deployments", "deployments.gateway"]),
        ("training/data/x.py", "from ..model import GPT", ["training.model", "training.model.GPT"]),
        ("training/data/x.py", "x = 1", []),
    ],
)
def test_import_statements_name_the_modules_python_would_load(rel, statement, names):
    assert _imported(rel, ast.parse(statement).body[0]) == names
