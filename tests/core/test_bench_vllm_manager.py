"""scripts/bench_vllm_manager.py: its CLI parses, and it skips cleanly without vllm.

The comparison itself needs vLLM in a side venv (scripts/setup_vllm_venv.sh), which CI
does not build; these checks never import vllm successfully and take about a second.
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_vllm_manager.py"


def test_bench_vllm_manager_help():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True
    )
    assert "--rounds" in proc.stdout
    assert "--require-vllm" in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_bench_vllm_manager_skips_without_vllm(tmp_path):
    out = tmp_path / "cmp.json"
    args = [str(SCRIPT), "--num-requests", "20", "--num-blocks", "200", "--output", str(out)]
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "vllm is not importable" in proc.stderr
    assert not out.exists()
    proc = subprocess.run([sys.executable, *args, "--require-vllm"], capture_output=True, text=True)
    assert proc.returncode == 2
