"""Expected failures (bad input, a config mistake, a rejected checkpoint, a failed gate) end the CLI with one line
naming the cause and print no traceback anywhere; the flow run ends Failed with that cause."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _cli(prefect_server: str, home: Path, *sets: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "SHARDLINE_HOME": str(home)}
    env.pop("MLFLOW_TRACKING_URI", None)
    args = [a for s in sets for a in ("--set", s)]
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--config", "configs/debug.toml", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _assert_one_line_failure(proc: subprocess.CompletedProcess, code: int, cause: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    last = (
        proc.stderr.strip().splitlines()[-1]
        if code == 2
        else next(line for line in proc.stderr.splitlines() if line.startswith("shardline: "))
    )
    assert cause in last, last


def test_empty_source_directory(prefect_server, tmp_path, module_home):
    (tmp_path / "empty").mkdir()
    proc = _cli(prefect_server, module_home, f"data.source={tmp_path / 'empty'}")
    _assert_one_line_failure(proc, 1, f"shardline: pipeline failed: DataError: {tmp_path / 'empty'}: no files")
    assert "Finished in state Failed" in proc.stderr


def test_config_mistake(prefect_server, module_home):
    proc = _cli(prefect_server, module_home, "train.stepz=3")
    _assert_one_line_failure(proc, 2, "unknown key 'train.stepz'")


@pytest.mark.slow
def test_rejected_checkpoint_and_failed_gate(prefect_server, tmp_path, module_home):
    partial = tmp_path / "partial-checkpoint"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\0" * 64)  # data without a manifest: a checkpoint cut short
    proc = _cli(prefect_server, module_home, f"train.init_from={partial}")
    _assert_one_line_failure(proc, 1, f"CheckpointError: {partial}: no manifest")

    proc = _cli(prefect_server, module_home, "train.steps=5", "validation.max_bits_per_byte=0.5")
    _assert_one_line_failure(proc, 1, "GateFailed: val_bits_per_byte")
