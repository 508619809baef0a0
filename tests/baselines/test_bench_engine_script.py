"""scripts/bench_engine.py end to end on a tiny random Llama: table printed, JSON written."""

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


def test_bench_engine_runs_all_three_systems(tiny_hf_checkpoint, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = [
        "--model", str(tiny_hf_checkpoint("llama")),
        "--num-requests", "4",
        "--input-median", "8", "--input-max", "24",
        "--output-median", "6", "--output-max", "16",
        "--max-model-len", "64", "--budget-full-requests", "2",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
        "--output", str(out),
    ]  # fmt: skip
    assert _load_script().main(argv) == 0
    assert "paged-jax" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"paged-jax", "contiguous-kv", "hf-static"}
    for result in report["results"].values():
        assert result["num_requests"] == 4
        assert result["num_output_tokens"] == report["workload"]["summary"]["total_output_tokens"]
        for key in ("tokens_per_s", "requests_per_s", "max_concurrent_seqs", "kv_utilization"):
            assert result[key] > 0
        assert 0 < result["kv_utilization"] <= 1
    assert report["results"]["contiguous-kv"]["max_concurrent_seqs"] <= 2
    assert report["kv_budget"]["contiguous_slots"] == 2
    assert set(report["ratios"]) == {
        "concurrency_paged_vs_contiguous",
        "throughput_paged_vs_contiguous",
        "throughput_paged_vs_hf",
    }
    assert set(report["targets"]) == {
        "kv_utilization",
        "concurrency_vs_contiguous",
        "throughput_ahead_of_baselines",
    }
    assert report["greedy_output_agreement"]["paged_vs_contiguous"] == 1.0
    assert report["results"]["paged-jax"]["num_compiles_after_warmup"] == 0
