"""The `shardline` command: user mistakes give one line and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _shardline(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SHARDLINE_HOME": str(home)}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_unknown_key_exits_2_with_one_line(tmp_path):
    proc = _shardline("run", "--config", "configs/debug.toml", "--set", "train.stepz=5", home=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "shardline: configs/debug.toml (with --set): unknown key 'train.stepz'"
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_missing_config_file(tmp_path):
    proc = _shardline("run", "--config", str(tmp_path / "nope.toml"), home=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("nope.toml: no such config file")


def test_bad_value_names_key(tmp_path):
    proc = _shardline("run", "--set", "train.workers=-1", home=tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "train.workers" in proc.stderr


def test_lineage_of_unknown_model_is_one_line(tmp_path):
    proc = _shardline("lineage", "--model", "no-such-model", home=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("shardline: model 'no-such-model'"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_errors_nothing_catches_are_one_line_with_credentials_masked(tmp_path):
    """Whatever a command lets through is `shardline: <command> failed: ...`, one line, exit 1, masked."""
    proc = _shardline("lineage", "--tracking-uri", "s3://AKIAFAKE:hunter2@bucket", home=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("shardline: lineage failed: ")
    assert "hunter2" not in proc.stderr + proc.stdout and "AKIAFAKE:***@bucket" in proc.stderr
    # a --set mistake repeats the assignment, masked
    proc = _shardline("run", "--set", "tracking_uri=postgresql://u:hunter2@db/x", home=tmp_path)
    assert proc.returncode == 2 and "hunter2" not in proc.stderr and "u:***@db" in proc.stderr, proc.stderr
    # a config path that is a directory
    proc = _shardline("run", "--config", str(tmp_path), home=tmp_path)
    assert (
        proc.returncode == 2 and proc.stderr.strip() == f"shardline: {tmp_path}: cannot read the config: Is a directory"
    )


def test_a_damaged_stack_record_is_one_line_that_says_what_to_do(tmp_path):
    (tmp_path / "stack.json").write_text("{garbage")
    for command in ("status", "down"):
        proc = _shardline(command, home=tmp_path)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"shardline: {command} failed: StackStateError: {tmp_path / 'stack.json'}: not a stack")
        assert line.endswith("if no stack runs here, remove it")


def test_a_usage_error_masks_a_credential_it_echoes(tmp_path):
    proc = _shardline("lineage", "--tracking_uri", "http://alice:hunter2@mlflow:5000", home=tmp_path)
    assert proc.returncode == 2 and "hunter2" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "shardline: error: unrecognized arguments: --tracking_uri http://alice:***@mlflow:5000"
    )


def test_a_port_held_by_another_program_refuses_only_the_commands_that_serve_there(tmp_path):
    """`down`, `canary status` and `shard` never serve: whatever holds serve.port must not stop them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        held = ("--set", f"serve.port={port}")
        proc = _shardline("run", *held, home=tmp_path / "home")
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip() == (
            f"shardline: config (with --set): serve.port={port}: http://127.0.0.1:{port} is held by another process "
            "that is not Ray Serve (GET /-/routes answered 404); set serve.port to a free port"
        )
        corpus = tmp_path / "corpus"
        corpus.mkdir()
        for n in range(20):
            (corpus / f"{n}.txt").write_text(f"def f{n}():\n    return {n}\n" * 50)
        shard = ["shard", "--set", f"data.source={corpus}", "--set", f"data.output={tmp_path / 'out'}"]
        for command in (["down"], ["canary", "status", "--json"], shard):
            proc = _shardline(*command, *held, home=tmp_path / "home")
            assert proc.returncode == 0 and "held by another process" not in proc.stderr, (command, proc.stderr)
    finally:
        server.terminate()
        server.wait(timeout=10)
