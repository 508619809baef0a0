"""Speculative decoding benchmark: one workload with and without speculation, side by side.

    python scripts/bench_spec_decode.py                           # n-gram, demo model
    python scripts/bench_spec_decode.py --k 4 --repeats 5 --out docs/spec_decode.json
    python scripts/bench_spec_decode.py --model-preset 80m       # a 75M random Llama
    python scripts/bench_spec_decode.py --method draft_model --draft-model PATH

The workload is copy/summarise style: every prompt is a random passage followed by its
first words again, so a continuation that copies the passage is what prompt lookup
finds. Both engines get the same EngineConfig except speculative_config, are warmed up
(no compiles in the timed runs, checked), and are timed in interleaved rounds
(baseline, speculative, baseline, ...) so machine noise hits them alike; the speed-up
is taken within each round and its median and spread are reported. Outputs are greedy,
so they must be identical: any difference exits 1 after writing the JSON. The baseline
runs with async scheduling (its default); speculative steps are synchronous. A third
engine, the baseline with async_scheduling=False, is timed too (--sync-baseline) to
separate what the synchronous loop costs from what speculation saves.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np


def make_prompts(
    n: int, passage_len: int, repeat_len: int, vocab: int, seed: int
) -> list[list[int]]:
    """n prompts: a random passage of passage_len tokens, then its first repeat_len again."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        passage = rng.integers(3, vocab, passage_len).tolist()
        out.append(passage + passage[:repeat_len])
    return out


def build_engine(
    model_path: str, args: argparse.Namespace, speculative: dict | None, async_scheduling=True
):
    from paged_jax.config import EngineConfig
    from paged_jax.engine import Engine
    from paged_jax.models import load_model

    model = load_model(model_path)
    config = EngineConfig(
        block_size=16,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        speculative_config=speculative,
        async_scheduling=async_scheduling,
    )
    engine = Engine(model, config)
    engine.warmup()
    return engine


def run_once(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from paged_jax.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.get_stats()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o.token_ids for o in engine.step()})
    wall = time.perf_counter() - t0
    stats = engine.get_stats()
    tokens = sum(len(v) for v in outs.values())
    run = {
        "wall_s": wall,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "steps": stats["num_steps"] - before["num_steps"],
        "compiles_after_warmup": stats["num_compiles_after_warmup"],
        "step_time_ms": 1e3 * wall / max(stats["num_steps"] - before["num_steps"], 1),
        # Medians since the engine started (warm-up steps excluded by the reset below).
        "host_phase_time_ms": stats["host_phase_time_ms"],
    }
    engine.reset_step_times()
    if "spec_num_draft_tokens" in stats:
        drafted = stats["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
        accepted = stats["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
        run["draft_tokens"] = drafted
        run["accepted_tokens"] = accepted
        run["acceptance_rate"] = accepted / drafted if drafted else 0.0
        run["acceptance_rate_per_position"] = stats["spec_acceptance_rate_per_position"]
    return {"run": run, "outputs": [outs[f"q{i}"] for i in range(len(prompts))]}


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="HF checkpoint directory (default: the built-in demo model)")
    p.add_argument(
        "--model-preset",
        choices=("tiny", "80m"),
        help="write a seeded random Llama of this preset (paged_jax.baselines.hf_generate; "
        "needs torch) into --cache-dir and use it",
    )
    p.add_argument("--cache-dir", default="/tmp/paged_jax_bench_spec", help="for --model-preset")
    p.add_argument(
        "--sync-baseline", action="store_true", help="also time the synchronous baseline"
    )
    p.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    p.add_argument("--draft-model", help="draft checkpoint (--method draft_model)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--passage-len", type=int, default=96)
    p.add_argument("--repeat-len", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON here (e.g. docs/spec_decode.json)")
    args = p.parse_args(argv)

    if args.method == "draft_model":
        if not args.draft_model:
            p.error("--method draft_model needs --draft-model PATH")
        speculative = {
            "method": "draft_model",
            "model": args.draft_model,
            "num_speculative_tokens": args.k,
        }
    else:
        speculative = {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min,
        }
    model_path = args.model
    if args.model_preset is not None:
        from paged_jax.baselines.hf_generate import build_random_llama

        target = pathlib.Path(args.cache_dir) / args.model_preset
        if not (target / "config.json").is_file():
            build_random_llama(target, preset=args.model_preset)
        model_path = str(target)
    if model_path is None:
        from paged_jax.entrypoints.demo import ensure_demo_model

        model_path = str(ensure_demo_model())
    vocab = json.loads((pathlib.Path(model_path) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.num_prompts, args.passage_len, args.repeat_len, vocab, args.seed)

    engines = {
        "baseline": build_engine(model_path, args, None),
        "speculative": build_engine(model_path, args, speculative),
    }
    if args.sync_baseline:
        engines["baseline_sync"] = build_engine(model_path, args, None, async_scheduling=False)
    rounds = []
    reference = None
    mismatches = 0
    for r in range(args.repeats):
        row = {}
        for name, engine in engines.items():
            result = run_once(engine, prompts, args.max_tokens)
            row[name] = result["run"]
            if reference is None:
                reference = result["outputs"]
            elif result["outputs"] != reference:
                mismatches += 1
        row["speedup"] = row["speculative"]["tokens_per_s"] / row["baseline"]["tokens_per_s"]
        if "baseline_sync" in row:
            row["speedup_vs_sync"] = (
                row["speculative"]["tokens_per_s"] / row["baseline_sync"]["tokens_per_s"]
            )
        rounds.append(row)
        print(
            f"round {r}: baseline {row['baseline']['tokens_per_s']:.1f} tok/s, speculative "
            f"{row['speculative']['tokens_per_s']:.1f} tok/s ({row['speedup']:.2f}x), acceptance "
            f"{row['speculative'].get('acceptance_rate', 0):.2f}",
            flush=True,
        )
    spec_runs = [row["speculative"] for row in rounds]
    summary = {
        "command": "python scripts/bench_spec_decode.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model_preset or args.model or "demo",
        "speculative_config": speculative,
        "workload": {
            "num_prompts": args.num_prompts,
            "passage_len": args.passage_len,
            "repeat_len": args.repeat_len,
            "max_tokens": args.max_tokens,
            "greedy": True,
        },
        "engine": {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len,
        },
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "baseline_tokens_per_s": spread([row["baseline"]["tokens_per_s"] for row in rounds]),
        "speculative_tokens_per_s": spread([r["tokens_per_s"] for r in spec_runs]),
        "speedup": spread([row["speedup"] for row in rounds]),
        "speedup_vs_sync_baseline": (
            spread([row["speedup_vs_sync"] for row in rounds]) if args.sync_baseline else None
        ),
        "step_time_ms": {
            name: statistics.median(row[name]["step_time_ms"] for row in rounds) for name in engines
        },
        "acceptance_rate": spread([r.get("acceptance_rate", 0.0) for r in spec_runs]),
        "acceptance_rate_per_position": spec_runs[-1].get("acceptance_rate_per_position"),
        "steps": {
            "baseline": rounds[-1]["baseline"]["steps"],
            "speculative": spec_runs[-1]["steps"],
        },
        "outputs_identical": mismatches == 0,
        "compiles_after_warmup": max(
            row[name]["compiles_after_warmup"] or 0 for row in rounds for name in engines
        ),
        "rounds": rounds,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=2))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    if mismatches:
        print(f"ERROR: {mismatches} run(s) gave outputs different from the first", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
