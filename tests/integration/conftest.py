"""Fixtures of the integration tier."""

from __future__ import annotations

import pytest
from support.train_support import RECORD_DIR_ENV, ray_runtime_env


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """A local Ray cluster whose training workers record their rank and pid (recording_gpt) in the yielded folder."""
    import ray

    out = tmp_path_factory.mktemp("workers")
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env=ray_runtime_env(**{RECORD_DIR_ENV: str(out)}),
    )
    yield out
    ray.shutdown()
