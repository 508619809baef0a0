"""scripts/bench_engine.py end to end on a tiny random Llama: workers, repeats, agreement, JSON."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_engine", REPO / "scripts/bench_engine.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def test_bench_engine_runs_every_system_repeated(tiny_hf_checkpoint, tmp_path, capsys):
    """Every system, two rounds, and --tensor-parallel-size 2: a paged worker split over 2
    forced CPU devices beside the one-device one (one script run for both: each run starts
    its own worker processes, which import jax and compile)."""
    out = tmp_path / "bench.json"
    argv = [
        "--model", str(tiny_hf_checkpoint("llama")),
        "--num-requests", "4",
        "--input-median", "8", "--input-max", "24",
        "--output-median", "6", "--output-max", "6",
        "--max-model-len", "64", "--budget-full-requests", "2",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
        "--repeats", "2", "--hf-batch-sizes", "2,4",
        "--comparisons", "same-budget", "--tensor-parallel-size", "2",
        "--output", str(out),
    ]  # fmt: skip
    assert _load_script().main(argv) == 0
    assert "paged-jax" in capsys.readouterr().out
    report = json.loads(out.read_text())
    names = {"paged-jax", "contiguous-max", "contiguous-pow2", "contiguous-oracle", "hf-static"}
    assert set(report["results"]) == names | {"paged-jax-tp2"}
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
    # The tensor-parallel worker: the same greedy outputs in both rounds, no compile after
    # warm-up, half the KV heads per device (the tiny Llama has 2): half the KV bytes, in
    # the same number of blocks.
    tp = report["tensor_parallel"]
    assert set(tp) == {"1", "2"} and tp["2"]["greedy_outputs_equal_to_tp1"] == [4, 4]
    assert tp["2"]["num_compiles_after_warmup"] == 0
    assert tp["2"]["kv_cache_bytes_per_device"] * 2 == tp["1"]["kv_cache_bytes_per_device"]
    tp2 = report["results"]["paged-jax-tp2"]["median_run"]
    assert tp2["num_kv_blocks"] == paged["num_kv_blocks"]


def test_a_greedy_mismatch_is_counted():
    script = _load_script()
    args = script.parse_args(["--repeats", "2"])
    summary = {"tokens_per_s": 10.0, "max_concurrent_seqs": 2, "kv_utilization": 0.5}
    good = {"summary": summary, "outputs": {"a": [1, 2], "b": [3]}}
    bad = {"summary": summary, "outputs": {"a": [1, 2], "b": [4]}}  # "b" differs
    runs = {"paged-jax": [good, good], "contiguous-max": [good, bad]}
    plan = script.make_plan(args, script.MODEL_PRESETS["tiny"])
    report = script.build_report(args, plan, {"same-budget": runs}, {}, {})
    assert report["num_mismatched_outputs"] == 1
    assert report["greedy_output_agreement"]["contiguous-max"]["equal_per_run"] == [2, 1]
    assert report["ratios"]["throughput_paged_vs_contiguous-max"]["median"] == 1.0


def test_best_vs_best_real_workers(tiny_hf_checkpoint, tmp_path):
    """The swept systems' specs build real workers; their best settings are timed."""
    out = tmp_path / "bench.json"
    argv = [
        "--model", str(tiny_hf_checkpoint("llama")),
        "--systems", "paged,contiguous-max,hf", "--comparisons", "best",
        "--num-requests", "4",
        "--input-median", "8", "--input-max", "24",
        "--output-median", "5", "--output-max", "5",
        "--max-model-len", "64",
        "--sweep-max-num-seqs", "4,8", "--sweep-max-num-batched-tokens", "64,512",
        "--hf-batch-sizes", "4", "--hf-threads", "1",
        "--repeats", "1", "--output", str(out),
    ]  # fmt: skip
    assert _load_script().main(argv) == 0
    report = json.loads(out.read_text())
    best = report["best_vs_best"]
    assert best["best_settings"] == {
        "hf-static": {"batch_size": 4, "threads": 1},
        "paged-jax": {"max_num_seqs": 4, "max_num_batched_tokens": 64},
        "contiguous-max": {"max_num_seqs": 4},
    }
    assert best["results"]["contiguous-max"]["median_run"]["max_concurrent_seqs"] <= 4
    assert best["results"]["paged-jax"]["median_run"]["num_compiles_after_warmup"] == 0
    assert "throughput_paged_vs_hf-static" in best["ratios"]
    assert report["targets"]["throughput_vs_hf_best_vs_best"]["target"] == 3.0
    assert report["results"] == {} and report["num_mismatched_outputs"] == 0


class _FakeWorker:
    """Stands in for a worker process: tok/s is a known function of its setting."""

    started: list = []
    outputs = {"req-0": [5, 6], "req-1": [7]}

    def __init__(self, spec, label):
        self.spec, self.label, self.runs, self.closed = spec, label, [], False
        self.ready = {"warmup_s": 0.0}
        if label == "contiguous-pow2 (max_num_seqs 64)":  # a swept setting's worker dies
            raise _FakeWorker.error(f"{label} worker exited with 1")
        _FakeWorker.started.append(self)

    def run(self, **kwargs):
        self.runs.append(kwargs)
        spec, outputs = self.spec, dict(self.outputs)
        if spec["system"] == "paged":
            p = spec["paged"]
            tps = 1000.0 * p["max_num_seqs"] + p["max_num_batched_tokens"]
            tps = 1.0 if p["max_num_seqs"] == 64 and p["max_num_batched_tokens"] == 1024 else tps
        elif spec["system"] == "hf":
            tps = 10.0 * kwargs["batch_size"] * kwargs["threads"]
        else:
            tps = 100.0 * spec["contiguous"]["max_num_seqs"]
            if spec["contiguous"]["max_num_seqs"] == 32 and spec["system"].endswith("oracle"):
                outputs["req-1"] = [8]  # a greedy mismatch in a sweep run
        summary = {"tokens_per_s": tps, "max_concurrent_seqs": 2, "kv_utilization": 0.5}
        return {"summary": summary, "outputs": outputs}

    def close(self):
        self.closed = True


def test_sweeps_pick_each_systems_best_and_time_only_those(monkeypatch, tmp_path):
    """With stand-in workers: the grids, the picks, who stays alive, what the rounds time."""
    script = _load_script()
    _FakeWorker.started, _FakeWorker.error = [], script.WorkerError
    monkeypatch.setattr(script, "Worker", _FakeWorker)
    out = tmp_path / "bench.json"
    argv = [
        "--model-preset", "tiny", "--num-requests", "100", "--no-compile-cache",
        "--sweep-max-num-seqs", "32,64,128,256", "--sweep-max-num-batched-tokens", "64,1024",
        "--hf-batch-sizes", "8,32", "--hf-threads", "1,2", "--repeats", "3",
        "--output", str(out),
    ]  # fmt: skip
    monkeypatch.setattr(script, "build_model", lambda args, directory: directory)
    assert script.main(argv) == 1  # the mismatch and the failed worker, after the JSON
    report = json.loads(out.read_text())
    best = report["best_vs_best"]
    paged = [r["setting"] for r in best["sweeps"]["paged-jax"]]
    # 256 seqs > 100 requests (as 128) pruned; 64 seqs x 64 tokens kept (64 >= 64).
    assert [(s["max_num_seqs"], s["max_num_batched_tokens"]) for s in paged] == [
        (32, 64), (32, 1024), (64, 64), (64, 1024), (128, 1024),
    ]  # fmt: skip
    assert any(p.get("max_num_seqs") == 256 for p in best["pruned"])
    assert any(p.get("max_num_batched_tokens") == 64 and "128" in p["why"] for p in best["pruned"])
    assert best["best_settings"] == {
        "hf-static": {"batch_size": 32, "threads": 2},
        "paged-jax": {"max_num_seqs": 128, "max_num_batched_tokens": 1024},
        "contiguous-max": {"max_num_seqs": 128},
        "contiguous-pow2": {"max_num_seqs": 128},
        "contiguous-oracle": {"max_num_seqs": 128},
    }
    assert report["failed_settings"][0]["setting"] == {"max_num_seqs": 64}
    assert report["num_mismatched_outputs"] == 1
    assert report["greedy_output_agreement"]["contiguous-oracle (sweep, max_num_seqs 32)"] == {
        "requests": 2,
        "equal": 1,
    }
    # Each best setting's worker: its sweep run + 3 timed; same-budget ones: 3 timed;
    # every other swept worker closed after its one run.
    jax_workers = [w for w in _FakeWorker.started if w.spec["system"] != "hf"]
    runs = [len(w.runs) for w in jax_workers]
    assert runs.count(4) == 4 and runs.count(3) == 4 and set(runs) == {1, 3, 4}
    assert all(w.closed for w in _FakeWorker.started)  # all closed at the end
    hf = [w for w in _FakeWorker.started if w.spec["system"] == "hf"]
    # HF: both thread counts at the middle batch size (32), then batch 8 at 2 threads.
    assert hf[0].runs[:3] == [
        {"batch_size": 32, "threads": 1},
        {"batch_size": 32, "threads": 2},
        {"batch_size": 8, "threads": 2},
    ]
    assert len(hf) == 1 and hf[0].runs[3:] == [{"batch_size": 32, "threads": 2}] * 3
    # HF's three timed runs serve both tables; the same-budget rows are their own workers.
    assert best["results"]["hf-static"] == report["results"]["hf-static"]
    assert set(report["results"]) == {
        "paged-jax", "contiguous-max", "contiguous-pow2", "contiguous-oracle", "hf-static",
    }  # fmt: skip
    ratio = best["ratios"]["throughput_paged_vs_hf-static"]
    assert ratio["median"] == (128_000 + 1024) / 640
    assert report["targets"]["throughput_vs_hf_best_vs_best"]["met"] is True
    same = [w for w in _FakeWorker.started if w.spec.get("paged", {}).get("num_kv_blocks")]
    assert len(same) == 1 and same[0].spec["paged"]["max_num_seqs"] == 64
    assert report["model"]["num_parameters"] == 2_885_888


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--dry-run", "--model-preset", "80m", "--num-requests", "64", "--output", str(out)]
    assert _load_script().main(argv) == 0
    text = capsys.readouterr().out
    assert "64/4096" in text and "128/" not in text and "max_num_seqs': 128" in text
    assert not out.exists()


def test_useful_values_keeps_the_first_value_past_the_limit():
    script = _load_script()
    assert script.useful_values([512, 32, 128, 64, 256], 100) == (
        [32, 64, 128],
        {256: 128, 512: 128},
    )
    assert script.useful_values([32, 64], 1000) == ([32, 64], {})


def test_model_presets_parameter_counts():
    """The presets' counts (reported in the JSON) match transformers' own."""
    import torch
    import transformers

    from paged_jax.baselines.hf_generate import MODEL_PRESETS, llama_num_parameters

    for name, expected in (("tiny", 2_885_888), ("80m", 74_920_704)):
        config = transformers.LlamaConfig(**MODEL_PRESETS[name])
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        assert sum(p.numel() for p in model.parameters()) == expected, name
        assert llama_num_parameters(MODEL_PRESETS[name]) == expected, name
