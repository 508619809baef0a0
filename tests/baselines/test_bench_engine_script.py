"""scripts/bench_engine.py end to end on a tiny random Llama: workers, repeats, agreement, JSON."""

from __future__ import annotations

import importlib.util
import json
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_engine", REPO / "scripts/bench_engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_engine_runs_every_system_repeated(tiny_hf_checkpoint, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = [
        "--model", str(tiny_hf_checkpoint("llama")),
        "--num-requests", "4",
        "--input-median", "8", "--input-max", "24",
        "--output-median", "6", "--output-max", "6",
        "--max-model-len", "64", "--budget-full-requests", "2",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
        "--repeats", "2", "--hf-batch-sizes", "2,4",
        "--output", str(out),
    ]  # fmt: skip
    assert _load_script().main(argv) == 0
    assert "paged-jax" in capsys.readouterr().out
    report = json.loads(out.read_text())
    names = {"paged-jax", "contiguous-max", "contiguous-pow2", "contiguous-oracle", "hf-static"}
    assert set(report["results"]) == names
    total = report["workload"]["summary"]["total_output_tokens"]
    for name, result in report["results"].items():
        assert len(result["tokens_per_s"]["runs"]) == 2, name
        run = result["median_run"]
        assert run["num_requests"] == 4 and run["num_output_tokens"] == total
        assert 0 < run["kv_utilization"] <= 1 and run["max_concurrent_seqs"] > 0, name
    assert report["results"]["contiguous-max"]["median_run"]["max_concurrent_seqs"] <= 2
    assert report["settings"]["hf_best_batch_size"] in (2, 4)
    assert set(report["hf_sweep"]) == {"2", "4"}
    assert report["num_mismatched_outputs"] == 0
    assert all(
        a.get("equal_per_run", [4])[0] == 4 for a in report["greedy_output_agreement"].values()
    )
    paged = report["results"]["paged-jax"]["median_run"]
    assert paged["num_compiles_after_warmup"] == 0 and paged["host_wall_us_per_seq"] > 0
    assert "throughput_paged_vs_hf-static" in report["ratios"]


def test_a_greedy_mismatch_is_counted():
    script = _load_script()
    args = script.parse_args(["--repeats", "2"])
    summary = {"tokens_per_s": 10.0, "max_concurrent_seqs": 2, "kv_utilization": 0.5}
    good = {"summary": summary, "outputs": {"a": [1, 2], "b": [3]}}
    bad = {"summary": summary, "outputs": {"a": [1, 2], "b": [4]}}  # "b" differs
    runs = {"paged-jax": [good, good], "contiguous-max": [good, bad]}
    spec = {"workload": {}, "paged": {}}
    trace = script.make_trace(script.WorkloadConfig(num_requests=2))
    report = script.build_report(args, spec, trace, None, 4, 64, runs, {}, None, {})
    assert report["num_mismatched_outputs"] == 1
    assert report["greedy_output_agreement"]["contiguous-max"]["equal_per_run"] == [2, 1]
    assert report["ratios"]["throughput_paged_vs_contiguous-max"]["median"] == 1.0


def test_bench_engine_tensor_parallel_worker(tiny_hf_checkpoint, tmp_path):
    """--tensor-parallel-size adds a paged worker split over 2 forced CPU devices."""
    out = tmp_path / "bench.json"
    argv = [
        "--model", str(tiny_hf_checkpoint("llama")),
        "--systems", "paged", "--tensor-parallel-size", "2",
        "--num-requests", "3",
        "--input-median", "8", "--input-max", "24",
        "--output-median", "5", "--output-max", "5",
        "--max-model-len", "64", "--budget-full-requests", "2",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
        "--repeats", "1", "--output", str(out),
    ]  # fmt: skip
    assert _load_script().main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"paged-jax", "paged-jax-tp2"}
    assert report["num_mismatched_outputs"] == 0
    tp = report["tensor_parallel"]
    assert set(tp) == {"1", "2"} and tp["2"]["greedy_outputs_equal_to_tp1"] == [3]
    assert tp["2"]["num_compiles_after_warmup"] == 0
    # Half the KV heads per device: half the KV bytes (the tiny Llama has 2 KV heads).
    assert tp["2"]["kv_cache_bytes_per_device"] * 2 == tp["1"]["kv_cache_bytes_per_device"]
    runs = report["results"]
    assert (
        runs["paged-jax-tp2"]["median_run"]["num_kv_blocks"]
        == (runs["paged-jax"]["median_run"]["num_kv_blocks"])
    )
