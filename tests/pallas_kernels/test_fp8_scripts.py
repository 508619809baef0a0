"""The fp8 GPU cell script runs end to end (CPU smoke on the reference) and writes its JSON."""

from __future__ import annotations

import importlib.util
import json
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_fp8_decode_smoke(tmp_path):
    out = tmp_path / "fp8.json"
    assert _load("bench_fp8_decode").main(["--reps", "1", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    cells = report["cells"]
    assert set(cells) == {"bfloat16", "fp8_e4m3", "fp8_e5m2"}
    assert cells["fp8_e4m3"]["kv_bytes"] * 2 == cells["bfloat16"]["kv_bytes"]
    # e4m3 keeps one more mantissa bit than e5m2: closer to the bf16 output.
    assert 0 < cells["fp8_e4m3"]["max_abs_diff_vs_bf16"] < cells["fp8_e5m2"]["max_abs_diff_vs_bf16"]
    assert cells["fp8_e5m2"]["max_abs_diff_vs_bf16"] < 0.5
    # Each cache checked against the reference on the same cache, and the summary metrics
    # follow from the cells (e4m3 against bf16).
    assert all(c["agrees_with_reference"] for c in cells.values())
    m = report["metrics"]
    assert m["cells_timed"] == 3
    assert m["fp8_max_abs_err_vs_bf16"] == cells["fp8_e4m3"]["max_abs_diff_vs_bf16"]
    assert m["fp8_time_over_bf16"] == cells["fp8_e4m3"]["us"] / cells["bfloat16"]["us"]
