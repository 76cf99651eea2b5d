"""bench/gpu_fsdp_h200.py (the H200 throughput script) runs end to end on CPU at its tiny size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_bench_script_runs_tiny_on_cpu(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_fsdp_h200.py"), "--tiny", "--steps", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["params_M"] > 0
    assert result["tokens_per_s"] > 0 and 0 < result["mfu"] < 1
    assert result["checkpoint_mb"] >= 1 and result["async2_total_s"] >= result["async2_blocked_s"]
