"""The CLI's start-up report: cold then warm, per phase, with the program being built named.

The slow cases run fresh processes: a warm start across processes is what users get, and
executables that JAX's own cache handed back once failed to load in the next process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from paged_jax.entrypoints.generate_cli import main as generate_main
from paged_jax.testing.cpu_devices import env_with_cpu_devices

ENGINE = ["--block-size", "4", "--max-num-seqs", "8", "--max-num-batched-tokens", "32"]
ENGINE += ["--max-model-len", "64", "--max-tokens", "3"]
PHASES = ("warmup_trace_s", "warmup_lower_s", "warmup_compile_s", "warmup_cache_load_s")


def _run(model_dir, tmp_path, name, *extra) -> dict:
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo two\n")
    summary = tmp_path / f"{name}.json"
    args = ["--model", str(model_dir), "--prompts", str(prompts), *ENGINE]
    assert generate_main([*args, "--summary-json", str(summary), *extra]) == 0
    return json.loads(summary.read_text())


def test_cold_then_warm_start_per_phase(model_dir, tmp_path, capsys):
    cache = ["--compile-cache-dir", str(tmp_path / "cc")]
    cold = _run(model_dir, tmp_path, "cold", *cache)
    err = capsys.readouterr().err
    # Token buckets 16 and 32 (8 sequences each), 16's decode-only variant, the copy and
    # the prompt-logprobs program; the progress line names each.
    assert (cold["start"], cold["programs"], cold["programs_compiled"]) == ("cold", 5, 5)
    assert "compiling step tokens=16 seqs=8" in err and "compiling copy" in err
    assert "compiling prompt logprobs rows=32" in err
    assert "cold start: 5 compiled (trace" in err
    assert cold["warmup_compile_s"] > 0 and cold["warmup_cache_load_s"] == 0
    assert (tmp_path / "cc" / "executables").is_dir()
    warm = _run(model_dir, tmp_path, "warm", *cache)
    err = capsys.readouterr().err
    assert (warm["start"], warm["programs_loaded"], warm["programs_compiled"]) == ("warm", 5, 0)
    assert "loading step tokens=32 seqs=8" in err and "warm start: 5 loaded" in err
    assert warm["warmup_trace_s"] == warm["warmup_lower_s"] == warm["warmup_compile_s"] == 0
    assert warm["warmup_cache_load_s"] > 0
    for s in (cold, warm):
        assert s["compiles_after_warmup"] == 0 and s["executable_cache_problems"] == 0
        assert all(k in s for k in PHASES) and s["load_and_warmup_s"] > 0


def test_no_compile_cache_and_the_env_switch_turn_the_executables_off(
    model_dir, tmp_path, monkeypatch
):
    off = _run(model_dir, tmp_path, "off", "--no-compile-cache", "--no-tqdm")
    assert off["compile_cache"] is None and off["start"] == "cold"
    monkeypatch.setenv("PAGED_JAX_COMPILE_CACHE", "0")
    env_off = _run(model_dir, tmp_path, "env", "--compile-cache-dir", str(tmp_path / "cc"))
    assert env_off["compile_cache"] is None and not (tmp_path / "cc").exists()


SCRIPT = """
import json, sys
from paged_jax.compile_cache import enable_compile_cache
from paged_jax.llm import LLM
from paged_jax.sampling_params import SamplingParams

mode, model, cache, tp = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
engine = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64,
              tensor_parallel_size=tp, attention_backend="reference")
if mode == "jax-cache-only":  # JAX's persistent cache on, the executables off
    enable_compile_cache(cache)
    llm = LLM(model, compile_cache=False, **engine)
else:
    llm = LLM(model, compile_cache=cache, **engine)
outs = llm.generate([[1, 5, 9, 4], [7, 7]], SamplingParams(temperature=0, max_tokens=4),
                    use_tqdm=False)
runner = llm.engine.runner
caches = runner.kv_caches
before = [x for x in __import__("jax").tree.leaves(caches)]
llm.generate([[3, 3, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
report = llm.engine.warmup_report
print(json.dumps({
    "start": report.start, "problems": report.problems,
    "tokens": [o.outputs[0].token_ids for o in outs],
    "after": llm.get_stats()["num_compiles_after_warmup"],
    "donated": all(x.is_deleted() for x in before),
    "kv_sharding": sorted({str(x.sharding.spec) if hasattr(x.sharding, "spec") else "one"
                           for x in __import__("jax").tree.leaves(runner.kv_caches)}),
}))
"""


def _fresh(mode: str, model_dir, cache, tp: int = 1) -> dict:
    env = env_with_cpu_devices(tp) if tp > 1 else dict(os.environ)
    cmd = [sys.executable, "-c", SCRIPT, mode, str(model_dir), str(cache), str(tp)]
    # timeout: a hang guard only (minutes on a loaded 2-core machine are fine).
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_programs_compiled_after_a_jax_cache_hit_load_in_the_next_process(model_dir, tmp_path):
    # JAX's cache holds the step programs first; then the executables are built and saved;
    # a third process must load them all and run them (a re-serialized JAX-cache hit
    # does not: "Function ... not found"). Tensor parallel over 2 forced devices, so the
    # warm start also keeps the KV caches' shardings and their donation (one test for both:
    # each fresh process imports jax and builds the engine; the one-device warm start across
    # processes is test_generate_cli_requests.py's second CLI run).
    cache = tmp_path / "cc"
    first = _fresh("jax-cache-only", model_dir, cache, tp=2)
    built = _fresh("both", model_dir, cache, tp=2)
    loaded = _fresh("both", model_dir, cache, tp=2)
    assert (first["start"], built["start"], loaded["start"]) == ("cold", "cold", "warm")
    assert loaded["problems"] == [] and loaded["after"] == 0
    assert loaded["tokens"] == built["tokens"] == first["tokens"]
    assert loaded["donated"] and built["donated"]  # the KV caches were donated to each step
    assert loaded["kv_sharding"] == built["kv_sharding"] != ["one"]  # still split over devices
