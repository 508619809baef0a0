"""Speculative decoding benchmark: one workload with and without speculation, side by side.

    python scripts/bench_spec_decode.py --model-preset membound --out docs/spec_decode.json
    python scripts/bench_spec_decode.py                           # n-gram, demo model
    python scripts/bench_spec_decode.py --model-preset 80m       # a 75M random Llama
    python scripts/bench_spec_decode.py --method draft_model --draft-model PATH

The workload is copy/summarise style: every prompt is a random passage followed by its
first tokens again, so a continuation that copies the passage, or repeats what it
already produced, is what prompt lookup finds. One run sweeps the number of concurrent
requests (--concurrency, e.g. 1,2,4,8) and k (--k, e.g. 2,4): one warmed-up engine per
setting (the baseline with async scheduling, its default; the baseline with
async_scheduling=False; one speculative engine per k), all with the same EngineConfig
except speculative_config, timed in interleaved rounds (every engine at every
concurrency, then again) so machine noise hits them alike. Speed-ups are taken within
each round and their median and spread reported. Outputs are greedy, so every engine's
must equal the async baseline's: any difference exits 1 after writing the JSON. No
compiles are allowed after warm-up (reported).

Speculation pays where a decode step is bound by reading the weights: few concurrent
sequences and a model whose weights dominate the step. `--model-preset membound` is
such a model for a CPU: a seeded random Llama (hidden 1024, 8 layers, vocabulary 256,
90.7M parameters, 363 MB in float32) whose layer weights are scaled down
(--layer-scale, 0.1) so the next token depends mostly on the current one and greedy
output falls into short cycles that prompt lookup finds. That is a property of these
random weights chosen on purpose (unscaled random Llamas do not repeat themselves and
accept nearly nothing), so its figures measure the mechanism where acceptance is high,
not what a trained model's text would accept.
"""

from __future__ import annotations

import argparse
import json
import os
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
    model_path: str,
    args: argparse.Namespace,
    speculative: dict | None,
    async_scheduling: bool = True,
):
    """One warmed-up engine: the shared EngineConfig plus this setting's options."""
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


def serve_all(engine, prompts: list[list[int]], max_tokens: int, tag: str = "q"):
    """Adds every prompt at once (greedy, max_tokens each, ids tag0, tag1, ...) and steps
    the engine until all finish: (wall seconds, id -> finished output, stats before,
    stats after). bench_spec_draft.py times its runs with it too."""
    from paged_jax.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.get_stats()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, params)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    return time.perf_counter() - t0, outs, before, engine.get_stats()


def run_once(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Serves every prompt at once (greedy, max_tokens each); wall time, steps, stats."""
    wall, outs, before, stats = serve_all(engine, prompts, max_tokens)
    tokens = sum(len(o.token_ids) for o in outs.values())
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
    return {"run": run, "outputs": [outs[f"q{i}"].token_ids for i in range(len(prompts))]}


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# The memory-bound preset's LlamaConfig fields over hf_generate's small bench config.
MEMBOUND_CONFIG: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def build_membound(directory: pathlib.Path, layer_scale: float) -> None:
    """The membound preset: a random Llama with its layers' matrices scaled by layer_scale.

    Embeddings, head and norms keep build_random_llama's scale; only matrices inside
    the decoder layers shrink, so the residual stream stays close to the current
    token's embedding and greedy decoding follows a near-deterministic token map.
    """
    from safetensors.numpy import load_file, save_file

    from paged_jax.baselines.hf_generate import build_random_llama

    build_random_llama(directory, preset="tiny", **MEMBOUND_CONFIG)
    for shard in sorted(directory.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for name, value in tensors.items():
            if ".layers." in name and value.ndim > 1:
                tensors[name] = (value * layer_scale).astype(value.dtype)
        save_file(tensors, str(shard), metadata={"format": "pt"})


def weight_figures(model_path: str) -> dict[str, Any]:
    """Parameter count and weight bytes of a checkpoint, read from its safetensors headers."""
    params = 0
    nbytes = 0
    for shard in sorted(pathlib.Path(model_path).glob("*.safetensors")):
        with open(shard, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            params += int(np.prod(meta["shape"], dtype=np.int64))
            start, end = meta["data_offsets"]
            nbytes += end - start
    return {"parameters": params, "weight_bytes": nbytes}


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="HF checkpoint directory (default: the built-in demo model)")
    p.add_argument(
        "--model-preset",
        choices=("tiny", "80m", "membound"),
        help="write a seeded random Llama of this preset (paged_jax.baselines.hf_generate; "
        "needs torch) into --cache-dir and use it",
    )
    p.add_argument("--layer-scale", type=float, default=0.1, help="membound: layer scale")
    p.add_argument("--cache-dir", default="/tmp/paged_jax_bench_spec", help="for --model-preset")
    p.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    p.add_argument("--draft-model", help="draft checkpoint (--method draft_model)")
    p.add_argument("--k", type=int_list, default=[2, 4], help="num_speculative_tokens list")
    p.add_argument(
        "--concurrency", type=int_list, default=[1, 2, 4, 8], help="concurrent requests list"
    )
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=1)
    p.add_argument("--passage-len", type=int, default=64)
    p.add_argument("--repeat-len", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help="default: the largest concurrency"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON here (e.g. docs/spec_decode.json)")
    args = p.parse_args(argv)
    if args.max_num_seqs is None:
        args.max_num_seqs = max(args.concurrency)
    if max(args.concurrency) > args.max_num_seqs:
        p.error(f"--concurrency {max(args.concurrency)} exceeds --max-num-seqs")

    def speculative_for(k: int) -> dict[str, Any]:
        if args.method == "draft_model":
            if not args.draft_model:
                p.error("--method draft_model needs --draft-model PATH")
            return {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": k}
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min,
        }

    model_path = args.model
    if args.model_preset is not None:
        name = args.model_preset
        if name == "membound":
            name = f"membound-{args.layer_scale:g}"
        target = pathlib.Path(args.cache_dir) / name
        if not (target / "config.json").is_file():
            if args.model_preset == "membound":
                build_membound(target, args.layer_scale)
            else:
                from paged_jax.baselines.hf_generate import build_random_llama

                build_random_llama(target, preset=args.model_preset)
        model_path = str(target)
    if model_path is None:
        from paged_jax.entrypoints.demo import ensure_demo_model

        model_path = str(ensure_demo_model())
    model_config = json.loads((pathlib.Path(model_path) / "config.json").read_text())
    weights = weight_figures(model_path)
    print(
        f"model {model_path}: {weights['parameters']:,} parameters, "
        f"{weights['weight_bytes'] / 2**20:.0f} MiB of weights",
        flush=True,
    )
    prompts = make_prompts(
        max(args.concurrency),
        args.passage_len,
        args.repeat_len,
        model_config["vocab_size"],
        args.seed,
    )

    engines = {
        "baseline": build_engine(model_path, args, None),
        "baseline_sync": build_engine(model_path, args, None, async_scheduling=False),
    }
    for k in args.k:
        engines[f"k{k}"] = build_engine(model_path, args, speculative_for(k))
    rounds: list[dict[str, Any]] = []
    mismatches: list[str] = []
    reference: dict[int, list[list[int]]] = {}
    for r in range(args.repeats):
        for c in args.concurrency:
            row: dict[str, Any] = {"round": r, "concurrency": c}
            for name, engine in engines.items():
                result = run_once(engine, prompts[:c], args.max_tokens)
                row[name] = result["run"]
                if name == "baseline":
                    reference.setdefault(c, result["outputs"])
                if result["outputs"] != reference[c]:
                    mismatches.append(f"round {r} concurrency {c} {name}")
            for k in args.k:
                spec = row[f"k{k}"]
                spec["speedup"] = spec["tokens_per_s"] / row["baseline"]["tokens_per_s"]
                spec["speedup_vs_sync"] = (
                    spec["tokens_per_s"] / row["baseline_sync"]["tokens_per_s"]
                )
            rounds.append(row)
            print(
                f"round {r} c={c}: baseline {row['baseline']['tokens_per_s']:.1f} tok/s, "
                + ", ".join(
                    f"k={k} {row[f'k{k}']['tokens_per_s']:.1f} tok/s "
                    f"({row[f'k{k}']['speedup']:.2f}x, acc {row[f'k{k}']['acceptance_rate']:.2f})"
                    for k in args.k
                ),
                flush=True,
            )

    table = []
    for c in args.concurrency:
        rows = [row for row in rounds if row["concurrency"] == c]
        for name in engines:
            runs = [row[name] for row in rows]
            entry: dict[str, Any] = {
                "concurrency": c,
                "engine": name,
                "tokens_per_s": spread([x["tokens_per_s"] for x in runs]),
                "steps": statistics.median(x["steps"] for x in runs),
                "ms_per_step": statistics.median(x["step_time_ms"] for x in runs),
                "host_phase_time_ms": runs[-1]["host_phase_time_ms"],
            }
            if name.startswith("k"):
                entry["acceptance_rate"] = statistics.median(x["acceptance_rate"] for x in runs)
                entry["acceptance_rate_per_position"] = runs[-1]["acceptance_rate_per_position"]
                entry["speedup"] = spread([x["speedup"] for x in runs])
                entry["speedup_vs_sync"] = spread([x["speedup_vs_sync"] for x in runs])
            table.append(entry)
    summary = {
        "command": "python scripts/bench_spec_decode.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model_preset or args.model or "demo",
        "model_config": {
            key: model_config.get(key)
            for key in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "torch_dtype",
            )
        },
        "layer_scale": args.layer_scale if args.model_preset == "membound" else None,
        **weights,
        "speculative_configs": {f"k{k}": speculative_for(k) for k in args.k},
        "workload": {
            "concurrency": args.concurrency,
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
        "repeats": args.repeats,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "outputs_identical": not mismatches,
        "mismatches": mismatches,
        "compiles_after_warmup": max(
            row[name]["compiles_after_warmup"] or 0 for row in rounds for name in engines
        ),
        "table": table,
        "rounds": rounds,
    }
    print(
        f"{'c':>2} {'engine':<14} {'tok/s (min-max)':<22} {'steps':>6} {'ms/step':>8} "
        f"{'accept':>7} {'vs async':>9} {'vs sync':>8}"
    )
    for e in table:
        tps = e["tokens_per_s"]
        line = (
            f"{e['concurrency']:>2} {e['engine']:<14} "
            f"{tps['median']:7.1f} ({tps['min']:.0f}-{tps['max']:.0f}){'':<4} "
            f"{e['steps']:>6.0f} {e['ms_per_step']:>8.1f}"
        )
        if "speedup" in e:
            line += (
                f" {e['acceptance_rate']:>7.2f} {e['speedup']['median']:>8.2f}x "
                f"{e['speedup_vs_sync']['median']:>7.2f}x"
            )
        print(line)
    print(
        f"outputs identical: {not mismatches}; compiles after warm-up: "
        f"{summary['compiles_after_warmup']}",
        flush=True,
    )
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    if mismatches:
        print(f"ERROR: outputs differ from the async baseline's: {mismatches}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
