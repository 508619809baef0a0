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
        "--systems", "paged,orca-max,contiguous-max,static",
        "--datasets", "alpaca", "--scale", "0.0625",
        "--duration-s", "0.1", "--unloaded-requests", "2",
        "--rates-alpaca", "40,400", "--repeats", "2",
        "--budget-max-requests", "2", "--block-size", "4", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
        "--output", str(out), "--figures", str(figs),
    ]  # fmt: skip
    assert _load_script().main(argv) == 0
    report = json.loads(out.read_text())
    trace = report["traces"]["alpaca"]
    assert report["num_mismatched_outputs"] == 0 and report["plan"]["max_model_len"] == 128
    assert trace["greedy_output_agreement"]["paged-jax"][0] == 2  # the unloaded run
    assert set(trace["curves"]) == {"paged-jax", "orca-max", "contiguous-max", "static"}
    assert trace["output_check"]["compared"] > 0 and trace["output_check"]["missing"] == 0
    sizes = {p["rate"]: p["num_requests"] for p in trace["points"]}
    assert sizes == {0.0: 2, 40.0: 4, 400.0: 40}  # rate x duration
    paged_rates = [p["rate"] for p in trace["curves"]["paged-jax"]]
    assert paged_rates[0] == 0.0 and len(trace["curves"]["paged-jax"][0]["runs"]) == 2
    main = trace["analysis"]["main"]
    assert main["bound_s_per_token"] > 0 and "contiguous-max" in main["paged_over"]
    paged_like = [p for p in trace["points"] if "num_compiles_after_warmup" in p]
    assert {p["system"] for p in paged_like} == {"paged-jax", "orca-max", "static"}
    assert all(p["num_compiles_after_warmup"] == 0 for p in paged_like)
    assert all(p["num_preemptions"] == 0 for p in paged_like if p["system"] == "orca-max")
    orca = [p for p in trace["points"] if p["system"] == "orca-max"]
    assert max(p["max_running"] for p in orca) <= 2  # budget: 2 max-length reservations
    static = [p for p in trace["points"] if p["system"] == "static"]
    assert max(p["max_running"] for p in static) <= 2 and static[0]["static_batch_size"] == 2
    assert all(0 < p["mean_running"] <= p["max_running"] for p in trace["points"])
    paired = trace["paired"]["4x"]  # per-repeat ratios at the main bound, 2x and 8x too
    assert set(trace["paired"]) == {"2x", "4x", "8x"}
    per_repeat = paired["static"]["vs_reference"]["sustained_ratio_per_repeat"]
    assert [r["repeat"] for r in per_repeat] == [0, 1]
    assert set(paired["orca-max"]["vs_reference"]["latency_ratio_by_rate"]) == {"40.0", "400.0"}
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


def test_fanout_flags_rates_and_replot(tmp_path):
    import pytest

    script = _load_script()
    args = script.parse_args(["--workload", "parallel,beam", "--fanouts", "4,2", "--dry-run"])
    assert args.workload == ("parallel", "beam") and args.fanouts == [2, 4]
    assert script.fanout_rates([8.0, 12.0], "beam", 4) == [2.0, 3.0]
    assert script.fanout_rates([8.0], "plain", 4) == [8.0]
    for bad in (["--workload", "greedy"], ["--fanouts", "0"], ["--fanouts", "x"]):
        with pytest.raises(SystemExit):
            script.parse_args(bad)
    with pytest.raises(SystemExit):  # the dense-cache engine has no forks
        script.parse_args(["--workload", "beam", "--systems", "paged,contiguous-max"])
    # A saved report's fanout section is redrawn without measuring anything.
    curve = [
        {"rate": r, "median": m, "min": m, "max": m} for r, m in ((0, 0.01), (4, 0.02), (8, 0.2))
    ]
    curves = {"paged-jax": curve, "orca-oracle": curve[:2]}
    analysis = script.analyze_curves(curves, 4.0)
    report = {
        "plan": {"kv_budget_tokens": 64, "paged": {"block_size": 4}},
        "settings": {"scale": 0.25, "repeats": 1},
        "traces": {},
        "fanout": {"alpaca": {"beam": {"2": {"curves": curves, "analysis": analysis}}}},
    }
    script.replot(script.parse_args(["--figures", str(tmp_path)]), report)
    assert (tmp_path / "serving_parallel.png").stat().st_size > 0
