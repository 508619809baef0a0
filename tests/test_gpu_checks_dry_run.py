"""The prepared GPU run: its CPU dry run prints a plan that fits the device limits."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEVICE_COMMAND_LIMIT_S = 480  # inside a 600 s device command and a 15-minute lease


def test_dry_run_prints_the_plan_and_a_budget_that_fits():
    out = subprocess.run(
        ["bash", "scripts/gpu_checks.sh", "--dry-run"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    steps = dict(re.findall(r"step (\w+)\s+<=\s+(\d+) s", out))
    assert set(steps) == {"setup", "gpu_tests", "bench_kernels", "bench_engine", "fp8_decode"}
    total = int(re.search(r"budget: total (\d+) s <= (\d+) s", out).group(1))
    assert total == sum(map(int, steps.values())) <= DEVICE_COMMAND_LIMIT_S
    cells = re.findall(r"cell decode b=(\d+) ctx=(\d+) (\w+)", out)
    assert {(int(b), int(c)) for b, c, _ in cells} == {
        (b, c) for b in (1, 64, 256) for c in (2048, 8192)
    }
    assert {impl for *_, impl in cells} == {"pallas", "jax_pallas", "xla_gather"}
    bench_plan = float(re.search(r"= ~(\d+) s", out).group(1))
    assert bench_plan < int(steps["bench_kernels"]), "the kernel benchmark plan overruns its step"


def test_bench_report_is_written_after_every_cell(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_kernels
    finally:
        sys.path.pop(0)
    path = tmp_path / "r.json"
    report = bench_kernels.Report(path, dict(device="x"))
    assert json.loads(path.read_text())["results"] == []
    report.add(dict(batch=1, context=2048, impl="pallas", us=10.0))
    assert json.loads(path.read_text())["results"][0]["impl"] == "pallas"
    # Small cells loop many calls per sync; the biggest still loop at least 10.
    assert bench_kernels.loop_count(bench_kernels.kv_bytes([2048])) >= 1000
    assert bench_kernels.loop_count(bench_kernels.kv_bytes([8192] * 256)) == 10
