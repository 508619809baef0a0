"""The three research-integration examples (docs/research_integration.md) run as users run them.

Each example checks its own result (paged output == dense computation) and exits non-zero
otherwise, so running it to a zero exit status is the test.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("kernels_only.py", "ragged paged attention vs dense causal attention"),
        ("block_manager_loop.py", "req-1: prefix hit 12 tokens"),
        ("own_model_engine.py", "LLM: 8 requests == dense forward"),
    ],
)
def test_example_runs_and_checks_itself(script, expected):
    # timeout: a hang guard only; no test asserts how long an example ran.
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert expected in proc.stdout
