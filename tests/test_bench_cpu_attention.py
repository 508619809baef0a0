"""bench_kernels --cpu-attention: the CPU reference attention's effective GB/s, beside the
host's measured read bandwidth and the previous implementation timed in the same rounds,
in JSON with its command."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_cpu_attention_mode_reports_gb_per_s_as_bytes_over_median_time(tmp_path):
    out = tmp_path / "cpu_attention.json"
    args = ["--cpu-attention", "--cpu-tiny", "--repeats", "3", "--output", str(out)]
    run = subprocess.run(
        [sys.executable, "scripts/bench_kernels.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard only; the test reads the JSON, never the run time
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["command"] == "python scripts/bench_kernels.py " + " ".join(args)
    assert report["device"] == "cpu"
    bw = report["host_bandwidth"]
    assert bw["sum_read_gb_per_s"] > 0 and bw["copy_read_plus_write_gb_per_s"] > 0
    rows = report["results"]
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16"}
    for r in rows:
        assert len(r["samples_s"]) == 3
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["median_s"] == sorted(r["samples_s"])[1]
        assert abs(r["gb_per_s"] - r["kv_bytes"] / r["median_s"] / 1e9) < 1e-9 * r["gb_per_s"]
        assert r["fraction_of_host_read_bandwidth"] == r["gb_per_s"] / bw["sum_read_gb_per_s"]
        # K and V of every context token: mean context x sequences x heads x dim x bytes.
        itemsize = 4 if r["dtype"] == "float32" else 2
        keys = round(r["context_tokens_mean"] * r["num_seqs"])
        assert r["kv_bytes"] == 2 * keys * r["num_kv_heads"] * r["head_dim"] * itemsize
    # Both implementations in every cell and dtype (a decode and a prefill cell), and one
    # side-by-side ratio each, from the same rounds.
    assert {r["impl"] for r in rows} == {"reference", "previous"}
    cells = {(r["cell"], r["dtype"]) for r in rows}
    assert {r["q_len"] for r in rows} == {1, 8}
    speedups = report["speedups"]
    assert {(x["cell"], x["dtype"]) for x in speedups} == cells and len(speedups) == len(cells)
    for x in speedups:
        by_impl = {r["impl"]: r for r in rows if (r["cell"], r["dtype"]) == (x["cell"], x["dtype"])}
        want = by_impl["previous"]["median_s"] / by_impl["reference"]["median_s"]
        assert abs(x["previous_over_reference_median"] - want) < 1e-9 * want
        fastest = min(by_impl["previous"]["samples_s"]) / min(by_impl["reference"]["samples_s"])
        assert abs(x["previous_over_reference_min"] - fastest) < 1e-9 * fastest
        assert x["per_round_ratio_min"] <= x["per_round_ratio_median"] <= x["per_round_ratio_max"]
        assert x["max_abs_output_difference"] < 0.05  # the same attention, up to rounding
