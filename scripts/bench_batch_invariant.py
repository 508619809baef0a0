"""batch_invariant=True vs the default mode: throughput of one workload, side by side.

    python scripts/bench_batch_invariant.py                      # tiny Llama, budgets 64, 256
    python scripts/bench_batch_invariant.py --model-preset 80m   # the 80M-class Llama
    python scripts/bench_batch_invariant.py --output docs/batch_invariant.json

Builds a seeded random-weight Llama (paged_jax.baselines.hf_generate, nothing downloaded)
and, per step budget (--max-num-batched-tokens, the mode's one bucket), two engines over
it in this process, identical but for batch_invariant, each warmed up (every program
compiled before timing). The workload is the same every run: prompts of
random lengths, seeded sampling (temperature 1), logprobs of the sampled tokens, a fixed
number of output tokens (ignore_eos). --repeats rounds each run both engines once, the
first one alternating round by round so machine noise hits both alike; the cost is the
ratio of the two wall times within a round (invariant / default), reported as median, min
and max, and the same ratio of the process's CPU seconds (user + system, all threads),
which other processes' load disturbs far less than wall time on a shared machine. The run also checks what the mode promises on this workload: the invariant
engine's first request, run alone afterwards, gives the same tokens and logprobs as in
the batch (recorded, and a mismatch exits 1), and no step compiled after warm-up.
Prints and saves JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

from paged_jax.baselines.hf_generate import MODEL_PRESETS, build_random_llama
from paged_jax.baselines.json_report import write_json_atomic

COMPARED_MODES = ("default", "batch_invariant")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-preset", choices=sorted(MODEL_PRESETS), default="tiny")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument(
        "--max-num-batched-tokens",
        default="64,256",
        help="comma list of step budgets, one comparison each (the batch-invariant mode's "
        "one bucket is the budget)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (both modes each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="where to write the JSON report")
    return p.parse_args(argv)


def _workload(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[Any]]:
    from paged_jax import SamplingParams

    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_prompt_len, args.max_prompt_len + 1, args.num_prompts)
    prompts = [[int(t) for t in rng.integers(3, vocab_size, int(n))] for n in lengths]
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0
        )
        for i in range(args.num_prompts)
    ]
    return prompts, params


def _signature(output) -> tuple:
    """(token ids, their logprobs) of a request's one completion: compared exactly."""
    completion = output.outputs[0]
    lps = tuple(entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids))
    return tuple(completion.token_ids), lps


def run_point(args: argparse.Namespace, budget: int) -> dict[str, Any]:
    """Both modes at one step budget: build, warm up, time the rounds, check invariance."""
    from paged_jax import LLM

    engine_kwargs = dict(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=args.max_prompt_len + args.max_tokens,
        seed=args.seed,
    )
    tmp = tempfile.mkdtemp(prefix="bench_batch_invariant_")
    try:
        path = build_random_llama(tmp, seed=args.seed, preset=args.model_preset)
        llms = {}
        build_s = {}
        for mode in COMPARED_MODES:
            t0 = time.perf_counter()
            llms[mode] = LLM(str(path), batch_invariant=mode == "batch_invariant", **engine_kwargs)
            build_s[mode] = time.perf_counter() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    vocab = MODEL_PRESETS[args.model_preset]["vocab_size"]
    prompts, params = _workload(args, vocab)
    num_out = args.num_prompts * args.max_tokens
    rounds = []
    batch_signature = None
    for r in range(args.repeats):
        order = COMPARED_MODES if r % 2 == 0 else COMPARED_MODES[::-1]
        wall, cpu = {}, {}
        for mode in order:
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llms[mode].generate(prompts, params, use_tqdm=False)
            wall[mode] = time.perf_counter() - t0
            cpu[mode] = time.process_time() - c0
            assert sum(len(o.outputs[0].token_ids) for o in outs) == num_out, "lost tokens"
            if mode == "batch_invariant":
                batch_signature = _signature(outs[0])
        rounds.append(
            {
                "order": list(order),
                "wall_s": {m: round(wall[m], 4) for m in COMPARED_MODES},
                "output_tok_s": {m: round(num_out / wall[m], 1) for m in COMPARED_MODES},
                "cost_ratio": round(wall["batch_invariant"] / wall["default"], 4),
                "cpu_s": {m: round(cpu[m], 3) for m in COMPARED_MODES},
                "cpu_cost_ratio": round(cpu["batch_invariant"] / cpu["default"], 4),
            }
        )
        print(
            f"budget {budget} round {r}: default {num_out / wall['default']:.1f} tok/s, batch_invariant "
            f"{num_out / wall['batch_invariant']:.1f} tok/s, cost x"
            f"{rounds[-1]['cost_ratio']:.3f} (CPU seconds x{rounds[-1]['cpu_cost_ratio']:.3f})",
            flush=True,
        )
    invariant = llms["batch_invariant"]
    alone = _signature(invariant.generate(prompts[:1], params[0], use_tqdm=False)[0])
    ratios = [r["cost_ratio"] for r in rounds]
    cpu_ratios = [r["cpu_cost_ratio"] for r in rounds]
    stats = {m: llms[m].get_stats() for m in COMPARED_MODES}
    return {
        "workload": {
            "num_prompts": args.num_prompts,
            "prompt_len": [args.min_prompt_len, args.max_prompt_len],
            "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": num_out,
            "sampling": "temperature 1, seeded per request, logprobs=0, ignore_eos",
        },
        "engine": engine_kwargs,
        "token_buckets": {m: list(llms[m].engine.config.token_buckets) for m in COMPARED_MODES},
        "build_and_warmup_s": {m: round(build_s[m], 2) for m in COMPARED_MODES},
        "rounds": rounds,
        "cost_ratio": {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        },
        "cpu_cost_ratio": {
            "median": statistics.median(cpu_ratios),
            "min": min(cpu_ratios),
            "max": max(cpu_ratios),
        },
        "output_tok_s_median": {
            m: round(statistics.median(r["output_tok_s"][m] for r in rounds), 1)
            for m in COMPARED_MODES
        },
        "compiles_after_warmup": {m: stats[m]["num_compiles_after_warmup"] for m in COMPARED_MODES},
        "first_request_alone_equals_batched": alone == batch_signature,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    budgets = [int(b) for b in str(args.max_num_batched_tokens).split(",")]
    return {
        "command": "python scripts/bench_batch_invariant.py " + " ".join(sys.argv[1:]),
        "model_preset": args.model_preset,
        "repeats": args.repeats,
        "points": [run_point(args, budget) for budget in budgets],
        "platform": {
            "machine": platform.machine(),
            "python": platform.python_version(),
            "jax_backend": _backend(),
        },
    }


def _backend() -> str:
    import jax

    return jax.default_backend()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    summary = {
        f"max_num_batched_tokens={p['engine']['max_num_batched_tokens']}": {
            k: p[k] for k in ("cost_ratio", "cpu_cost_ratio", "output_tok_s_median")
        }
        for p in report["points"]
    }
    print(json.dumps(summary, indent=2))
    if args.output:
        print(f"wrote {write_json_atomic(args.output, report)}")
    ok = all(
        p["first_request_alone_equals_batched"] and not any(p["compiles_after_warmup"].values())
        for p in report["points"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
