"""scripts/bench_serving.py end to end on a tiny random Llama: workers, rates, agreement, figure."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def _load_script():
    path = REPO / "scripts/bench_serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_bench_serving_tiny_run(tiny_hf_checkpoint, tmp_path):
    out, figs = tmp_path / "serving.json", tmp_path / "figs"
    argv = [
        "--model", str(tiny_hf_checkpoint("llama")),
        "--systems", "paged,orca-max,contiguous-max",
        "--datasets", "alpaca", "--scale", "0.0625",
        "--duration-s", "0.1", "--unloaded-requests", "2",
        "--rates-alpaca", "40,400", "--repeats", "2",
        "--budget-max-requests", "2", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
        "--output", str(out), "--figures", str(figs),
    ]  # fmt: skip
    assert _load_script().main(argv) == 0
    report = json.loads(out.read_text())
    trace = report["traces"]["alpaca"]
    assert report["num_mismatched_outputs"] == 0 and report["plan"]["max_model_len"] == 128
    assert trace["greedy_output_agreement"]["paged-jax"][0] == 2  # the unloaded run
    assert set(trace["curves"]) == {"paged-jax", "orca-max", "contiguous-max"}
    assert trace["output_check"]["compared"] > 0 and trace["output_check"]["missing"] == 0
    sizes = {p["rate"]: p["num_requests"] for p in trace["points"]}
    assert sizes == {0.0: 2, 40.0: 4, 400.0: 40}  # rate x duration
    paged_rates = [p["rate"] for p in trace["curves"]["paged-jax"]]
    assert paged_rates[0] == 0.0 and len(trace["curves"]["paged-jax"][0]["runs"]) == 2
    main = trace["analysis"]["main"]
    assert main["bound_s_per_token"] > 0 and "contiguous-max" in main["paged_over"]
    paged_like = [p for p in trace["points"] if "num_compiles_after_warmup" in p]
    assert {p["system"] for p in paged_like} == {"paged-jax", "orca-max"}
    assert all(p["num_compiles_after_warmup"] == 0 for p in paged_like)
    assert all(p["num_preemptions"] == 0 for p in paged_like if p["system"] == "orca-max")
    orca = [p for p in trace["points"] if p["system"] == "orca-max"]
    assert max(p["max_running"] for p in orca) <= 2  # budget: 2 max-length reservations
    assert (figs / "serving_alpaca.png").stat().st_size > 0


def test_output_check_counts_mismatched_missing_and_unchecked():
    check_outputs = _load_script().check_outputs
    runs = [
        ("paged-jax", 2, {"a": [1, 2], "b": [3]}),
        ("orca-max", 2, {"a": [1, 2], "b": [4]}),  # b differs
        ("orca-max", 3, {"a": [1, 2], "c": [5]}),  # b missing, c never served by paged
    ]
    check, agreement = check_outputs(runs)
    assert check == {"mismatched": 1, "missing": 1, "unchecked": 1, "compared": 5}
    assert agreement == {"paged-jax": [2], "orca-max": [1, 1]}
