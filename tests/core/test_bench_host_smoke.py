"""scripts/bench_host.py runs end to end on a small trace and passes its pool self-check."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_host.py"


def test_bench_host_small_run_returns_every_block(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--num-requests", "60", "--num-blocks", "300", "--output", str(out)]
    args += ["--engine-seqs", "8", "--engine-steps", "3"]
    subprocess.run([sys.executable, str(SCRIPT), *args], check=True, capture_output=True)
    result = json.loads(out.read_text())
    assert result["all_blocks_returned"] is True
    assert [e["async_scheduling"] for e in result["engine_host"]] == [True, False]
    for e in result["engine_host"]:
        assert e["num_seqs"] == 8 and e["host_cpu_us_per_step"]["median"] > 0
        assert set(e["parts_cpu_us_per_step_median"]) >= {"schedule", "prepare", "dispatch"}
    assert result["preemptions"] > 0  # 299 usable blocks are too few for this trace
    assert 0.0 < result["prefix_hit_rate"] < 1.0


def test_bench_host_rejects_a_pool_too_small_for_one_request(tmp_path):
    args = ["--num-requests", "60", "--num-blocks", "8", "--output", str(tmp_path / "x.json")]
    args += ["--engine-seqs", "0"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "--num-blocks=8 must be >=" in proc.stderr
