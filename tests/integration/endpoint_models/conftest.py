"""The package's one serving world (see __init__.py)."""

from __future__ import annotations

import pytest
from support.serve_support import bigram_logits, corpus, serving_world

from . import MODELS


@pytest.fixture(scope="package")
def world(tmp_path_factory):
    """Both models registered with a weak first champion, a local Ray and a Serve config on a free port; the
    good table is there for the challengers the canary tests register."""
    fit, _ = corpus()
    tables = {"weak": bigram_logits(fit, smoothing=50.0), "good": bigram_logits(fit, smoothing=0.05)}
    with serving_world(tmp_path_factory.mktemp("home"), "models-it", tables, MODELS) as world:
        yield world
