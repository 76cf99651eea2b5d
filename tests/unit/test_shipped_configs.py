"""Every example under configs/ loads as the README shows it (a broken example is caught here, not by a user)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_a_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.train.steps >= 1 and cfg.registry.model_name


def test_the_examples_cover_each_way_to_bring_a_model():
    loaded = {p.stem: load_config(p).train for p in CONFIGS}
    assert loaded["llama-tiny"].hf_config["model_type"] == "llama"
    assert loaded["lightning"].loop == "lightning"
    assert loaded["demo"].model_factory == "training.model:build_gpt"
