"""Structured outputs through the engine: generation throughput with every request under a
JSON schema against the same workload unconstrained, the host time per constrained
sequence per step, and grammar compile time per distinct schema (cold and cached).

The checkpoint is the demo Llama's shape (random weights) with a byte-level BPE trained
on the structured-output corpus (multi-character tokens, so the schema crosses token
boundaries), written once into --workdir. Each mode runs in its own process (no compile
or allocator state shared), repeats interleaved (free, free_sync, json, free, ...), and the
spread of each figure is reported. Unconstrained requests ignore EOS and run to
max_tokens; constrained ones end when the schema is complete (or at max_tokens), so the
figure compared is generated tokens per second of generation wall time. Example:

    python scripts/bench_structured_engine.py --repeats 3 --output docs/structured_outputs_engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

from paged_jax.baselines.json_report import write_json_atomic

# free_sync: unconstrained with synchronous scheduling, which the engine switches to while a
# constrained request is live: it separates the lost host/device overlap from the mask.
MODES = ("free", "free_sync", "json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=2048, help="the trained BPE's target")
    p.add_argument("--num-schemas", type=int, default=8, help="distinct schemas in the batch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default="/tmp/paged_jax_bench_structured_engine")
    p.add_argument("--output", default="docs/structured_outputs_engine.json")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one child process
    return p.parse_args(argv)


def write_checkpoint(workdir: pathlib.Path, vocab_size: int) -> pathlib.Path:
    """The demo checkpoint with a trained BPE and embeddings / head widened to its vocabulary."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from paged_jax.entrypoints.demo import write_demo_model
    from paged_jax.testing.bpe_tokenizer import structured_corpus, train_byte_level_bpe

    path = workdir / f"model_v{vocab_size}"
    if (path / "done").is_file():
        return path
    write_demo_model(path)
    tok = train_byte_level_bpe(structured_corpus(2000), vocab_size=vocab_size)
    tok.save(str(path / "tokenizer.json"))
    v = tok.get_vocab_size()
    config = json.loads((path / "config.json").read_text())
    config["vocab_size"] = v
    (path / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(0)
    h = config["hidden_size"]
    weights["model.embed_tokens.weight"] = rng.standard_normal((v, h)).astype(np.float32)
    head = rng.standard_normal((v, h)) * (4.0 / np.sqrt(h))
    weights["lm_head.weight"] = head.astype(np.float32)
    save_file(weights, str(path / "model.safetensors"))
    (path / "done").write_text("")
    return path


def run_mode(args: argparse.Namespace, mode: str) -> dict:
    """One process's run: warm-up, one untimed pass, then the timed pass."""
    from paged_jax import LLM, SamplingParams, StructuredOutputsParams
    from paged_jax.structured_outputs import GrammarCompiler, Matcher
    from paged_jax.testing.bpe_tokenizer import structured_corpus
    from paged_jax.testing.structured_cases import nested_schema

    path = write_checkpoint(pathlib.Path(args.workdir), args.vocab_size)
    # Host time of the constraint work the engine does per step: mask fill and accept.
    host = {"fill_s": 0.0, "fill_rows": 0, "fill_calls": 0, "accept_s": 0.0, "accepts": 0}
    fill, accept = GrammarCompiler.fill_bitmasks, Matcher.accept

    def timed_fill(self, matchers, words):
        t0 = time.perf_counter()
        fill(self, matchers, words)
        host["fill_s"] += time.perf_counter() - t0
        host["fill_rows"] += sum(m is not None for m in matchers)
        host["fill_calls"] += 1

    def timed_accept(self, token_id):
        t0 = time.perf_counter()
        ok = accept(self, token_id)
        host["accept_s"] += time.perf_counter() - t0
        host["accepts"] += 1
        return ok

    GrammarCompiler.fill_bitmasks = timed_fill
    Matcher.accept = timed_accept
    t0 = time.perf_counter()
    llm = LLM(
        str(path),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=256,
        seed=0,
        async_scheduling=mode != "free_sync",
    )
    load_s = time.perf_counter() - t0
    corpus = structured_corpus(args.num_requests, seed=1)
    prompts = [line[:60] for line in corpus][: args.num_requests]
    schemas = [
        StructuredOutputsParams(json=nested_schema(i), disable_any_whitespace=True)
        for i in range(args.num_schemas)
    ]

    def params(i: int) -> SamplingParams:
        if mode != "json":
            return SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        return SamplingParams(
            temperature=0.0,
            max_tokens=args.max_tokens,
            structured_outputs=schemas[i % len(schemas)],
        )

    batch = [params(i) for i in range(len(prompts))]
    llm.generate(prompts, batch, use_tqdm=False)  # untimed: first-use costs (grammars too)
    for k in host:
        host[k] = type(host[k])(0)
    stats0 = llm.get_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, batch, use_tqdm=False)
    wall = time.perf_counter() - t0
    stats = llm.get_stats()
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    finish = {}
    for o in outs:
        finish[o.outputs[0].finish_reason] = finish.get(o.outputs[0].finish_reason, 0) + 1
    valid = None
    if mode == "json":
        valid = 0
        for o in outs:
            try:
                json.loads(o.outputs[0].text)
                valid += 1
            except json.JSONDecodeError:
                pass
    result = {
        "mode": mode,
        "load_and_warmup_s": round(load_s, 2),
        "wall_s": round(wall, 3),
        "generated_tokens": gen,
        "generated_tokens_per_s": round(gen / wall, 1),
        "steps": stats["num_steps"] - stats0["num_steps"],
        "finish_reasons": finish,
        "outputs_that_parse_as_json": valid,
        "compiles_after_warmup": stats["num_compiles_after_warmup"],
    }
    if mode == "json":
        rows = max(host["fill_rows"], 1)
        result.update(
            fill_us_per_seq_step=round(1e6 * host["fill_s"] / rows, 1),
            accept_us_per_seq_step=round(1e6 * host["accept_s"] / max(host["accepts"], 1), 1),
            host_us_per_seq_step=round(
                1e6 * host["fill_s"] / rows + 1e6 * host["accept_s"] / max(host["accepts"], 1), 1
            ),
            host_s_total=round(host["fill_s"] + host["accept_s"], 3),
            constrained_rows=host["fill_rows"],
            host_share_of_wall=round((host["fill_s"] + host["accept_s"]) / wall, 3),
            compile=compile_times(path, args.num_schemas, llm),
        )
    return result


def compile_times(path: pathlib.Path, num_schemas: int, llm) -> dict:
    """Grammar compile time per distinct schema on a fresh compiler: cold, then cached."""
    from bench_structured import compile_seconds  # scripts/, this script's folder

    from paged_jax.structured_outputs import GrammarCompiler, StructuredOutputsParams
    from paged_jax.testing.structured_cases import nested_schema

    t0 = time.perf_counter()
    compiler = GrammarCompiler(
        str(path / "tokenizer.json"),
        eos_token_ids=(2,),
        vocab_size=llm.engine.model_config.vocab_size,
    )
    setup_s = time.perf_counter() - t0
    # Distinct from the run's schemas (offset), so nothing is shared with it.
    params = [
        StructuredOutputsParams(json=nested_schema(100 + i), disable_any_whitespace=True)
        for i in range(num_schemas)
    ]
    cold, cached = compile_seconds(compiler, params)
    return {
        "vocabulary_setup_s": round(setup_s, 3),
        "cold_ms_median": round(1e3 * statistics.median(cold), 3),
        "cold_ms_max": round(1e3 * max(cold), 3),
        "cached_us_median": round(1e6 * statistics.median(cached), 2),
        "cache_info": compiler.cache_info()._asdict(),
    }


def spread(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
        "all": values,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode is not None:
        print(json.dumps(run_mode(args, args.mode)))
        return 0
    write_checkpoint(pathlib.Path(args.workdir), args.vocab_size)  # once, before timing
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    passthrough = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k not in ("mode", "output", "repeats")
    ]
    for r in range(args.repeats):
        for mode in MODES:
            cmd = [sys.executable, __file__, *passthrough, "--mode", mode]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr)
                return proc.returncode
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[mode].append(result)
            print(f"repeat {r} {mode}: {result['generated_tokens_per_s']} tok/s", flush=True)
    free = [x["generated_tokens_per_s"] for x in runs["free"]]
    free_sync = [x["generated_tokens_per_s"] for x in runs["free_sync"]]
    constrained = [x["generated_tokens_per_s"] for x in runs["json"]]
    ratios = [round(c / f, 3) for c, f in zip(constrained, free)]
    sync_ratios = [round(c / f, 3) for c, f in zip(constrained, free_sync)]
    report = {
        "command": "python scripts/bench_structured_engine.py " + " ".join(passthrough),
        "host": {
            "cpus": os.cpu_count(),
            "load_1min": round(os.getloadavg()[0], 2),
            "python": platform.python_version(),
        },
        "unconstrained_tokens_per_s": spread(free),
        "unconstrained_sync_tokens_per_s": spread(free_sync),
        "json_tokens_per_s": spread(constrained),
        "ratio_json_over_free": spread(ratios),
        "ratio_json_over_free_sync": spread(sync_ratios),
        "target_ratio": 0.8,
        "host_us_per_constrained_seq_step": spread(
            [x["host_us_per_seq_step"] for x in runs["json"]]
        ),
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    write_json_atomic(args.output, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
