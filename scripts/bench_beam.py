"""Beam search and n>1 sampling: forks (shared KV, copy-on-write) vs independent requests.

    python scripts/bench_beam.py --output docs/beam_benchmark.json   # random Llama, CPU
    python scripts/bench_beam.py --num-prompts 4 --beam-width 2 --max-tokens 8

Beam search: every step's beams as forks of their parents (paged-jax) vs every beam
of every step as a new request of its whole token list that finds its prefix in the
prefix cache (vLLM V1's LLM.beam_search). Parallel sampling: one prefill plus n forks
vs n requests of the prompt sharing full blocks through the prefix cache. One warmed
engine runs every system in turn (prefix cache reset in between). Prints a table and
writes JSON (--output).
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import sys
import tempfile
import time

from paged_jax.baselines.json_report import write_json_atomic


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: random Llama)")
    p.add_argument("--output", default="bench_results/bench_beam.json")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="parallel samples per prompt")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class _Meter:
    """Counts computed tokens, copies and peak used blocks of an engine's steps."""

    def __init__(self, engine):
        self.engine = engine
        self.reset()
        prepare = engine.input_batch.prepare

        def counting(seqs, block_copies=()):
            self.computed += sum(s.num_new_tokens for s in seqs)
            self.copies += len(block_copies)
            self.steps += 1
            return prepare(seqs, block_copies)

        engine.input_batch.prepare = counting

    def reset(self):
        self.computed = self.copies = self.steps = 0
        self.engine.reset_peak_stats()  # the engine samples usage after each step's allocations

    def on_step(self, engine):
        pass

    def result(self, seconds: float, generated: int) -> dict:
        return {
            "seconds": round(seconds, 3),
            "generated_tokens": generated,
            "generated_tok_per_s": round(generated / seconds, 1),
            "computed_tokens": self.computed,
            "device_steps": self.steps,
            "block_copies": self.copies,
            "peak_used_blocks": round(
                self.engine.get_stats()["kv_cache_usage_peak"]
                * self.engine.kv_cache_manager.num_usable_blocks
            ),
        }


def _beam(engine, meter, prompts, params, forks: bool) -> tuple[dict, list]:
    from paged_jax.beam_search import run_beam_search

    engine.kv_cache_manager.reset_prefix_cache()
    meter.reset()
    t0 = time.perf_counter()
    outs = run_beam_search(engine, prompts, params, forks=forks, on_step=meter.on_step)
    seconds = time.perf_counter() - t0
    generated = sum(len(s.output_token_ids) for o in outs for s in o.sequences)
    return meter.result(seconds, generated), [[s.tokens for s in o.sequences] for o in outs]


def _parallel(engine, meter, prompts, n, max_tokens, forks: bool) -> dict:
    from paged_jax.sampling_params import SamplingParams

    engine.kv_cache_manager.reset_prefix_cache()
    meter.reset()
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        if forks:  # one request with n samples: sample j gets seed j
            params = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=max_tokens)
            engine.add_request(f"par{i}", prompt, params)
        else:
            for j in range(n):
                params = SamplingParams(temperature=1.0, seed=j, max_tokens=max_tokens)
                engine.add_request(f"par{i}_{j}", prompt, params)
    generated = 0
    while engine.has_unfinished():
        outs = engine.step()
        meter.on_step(engine)
        generated += sum(len(c.token_ids) for o in outs for c in o.completions)
    return meter.result(time.perf_counter() - t0, generated)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    import numpy as np

    from paged_jax import BeamSearchParams
    from paged_jax.config import EngineConfig
    from paged_jax.engine import Engine
    from paged_jax.models import load_model

    with tempfile.TemporaryDirectory(prefix="bench_beam_") as tmp:
        model_dir = args.model
        if model_dir is None:
            from paged_jax.baselines.hf_generate import build_random_llama

            model_dir = build_random_llama(pathlib.Path(tmp) / "llama", seed=args.seed)
        model = load_model(model_dir, dtype="float32")
        config = EngineConfig(
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
        )
        engine = Engine(model, config)
        t0 = time.perf_counter()
        engine.warmup()
        warmup_s = time.perf_counter() - t0
    meter = _Meter(engine)
    rng = np.random.default_rng(args.seed)
    vocab = engine.vocab_size
    prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(args.num_prompts)]
    params = BeamSearchParams(args.beam_width, args.max_tokens, ignore_eos=True)
    results = {}
    beams = {}
    for name, forks in (("beam_forks", True), ("beam_independent_requests", False)):
        results[name], beams[name] = _beam(engine, meter, prompts, params, forks)
        print(name, results[name], flush=True)
    same = beams["beam_forks"] == beams["beam_independent_requests"]
    for name, forks in (("parallel_forks", True), ("parallel_prefix_cache", False)):
        results[name] = _parallel(engine, meter, prompts, args.n, args.max_tokens, forks)
        print(name, results[name], flush=True)
    kv = engine.kv_cache_manager
    kv.check_invariants()
    summary = {
        "command": "python scripts/bench_beam.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "model": str(args.model) if args.model else "built-in random Llama",
        "settings": vars(args),
        "backend": __import__("jax").default_backend(),
        "warmup_seconds": round(warmup_s, 1),
        "beams_equal": same,
        "results": results,
        "speedup_beam": round(
            results["beam_independent_requests"]["seconds"] / results["beam_forks"]["seconds"], 2
        ),
        "speedup_parallel": round(
            results["parallel_prefix_cache"]["seconds"] / results["parallel_forks"]["seconds"], 2
        ),
    }
    print(
        f"beams equal: {same}; beam speedup {summary['speedup_beam']}x, "
        f"parallel sampling speedup {summary['speedup_parallel']}x"
    )
    out = write_json_atomic(args.output, summary)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
