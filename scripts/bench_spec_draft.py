"""Speculative decoding with a draft model: acceptance and speed-up against no speculation.

The target is the demo Llama's shape (random weights: hidden 256, 4 layers, vocab 259).
Three drafts, all with its vocabulary:

    self       the target itself (the mechanism's ceiling: every greedy proposal matches)
    layersN    the target's own first N layers (truncate_checkpoint), embeddings and head
    random     an independent random Llama (hidden 64, 1 layer)

Each setting gets one engine (warmed up), then ``--repeats`` timed greedy runs of the
same requests, interleaved over the settings (none, self, layers1, random, none, ...).
Reported per setting: output tokens per second of generation wall time (median and
spread), the speed-up of the medians over "none", the acceptance rate (accepted /
drafted) and the acceptance rate per draft position. Example:

    python scripts/bench_spec_draft.py --output docs/spec_decode_draft.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys

from paged_jax.baselines.json_report import write_json_atomic

# "none_sync": no speculation with synchronous steps (speculation runs synchronously, so
# this separates the cost of the lost host/device overlap from the draft's).
SETTINGS = ("none", "none_sync", "self", "layers1", "layers2", "layers3", "random")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--workdir", default="/tmp/paged_jax_bench_spec_draft")
    p.add_argument("--output", default="docs/spec_decode_draft.json")
    return p.parse_args(argv)


def write_checkpoints(workdir: pathlib.Path) -> dict[str, pathlib.Path]:
    """The target and the three drafts' directories (written once into workdir)."""
    from paged_jax.entrypoints.demo import DEMO_CONFIG, write_demo_model
    from paged_jax.spec_decode.draft_checkpoints import truncate_checkpoint
    from paged_jax.testing.tiny_models import build_tiny_hf_checkpoint

    target = workdir / "target"
    if not (target / "model.safetensors").is_file():
        write_demo_model(target)
    dirs = {"target": target, "self": target}
    for n in (1, 2, 3):
        dirs[f"layers{n}"] = workdir / f"layers{n}"
        if not (dirs[f"layers{n}"] / "model.safetensors").is_file():
            truncate_checkpoint(target, dirs[f"layers{n}"], n)
    small = workdir / "random"
    if not (small / "model.safetensors").is_file():
        build_tiny_hf_checkpoint(
            "llama",
            small,
            seed=1,
            vocab_size=DEMO_CONFIG["vocab_size"],
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=DEMO_CONFIG["max_position_embeddings"],
        )
    dirs["random"] = small
    return dirs


def prompts(args: argparse.Namespace) -> list[list[int]]:
    """Random byte-token prompts, every other one a repeated phrase (copy-style text)."""
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for i in range(args.num_requests):
        if i % 2:
            phrase = rng.integers(3, 259, 6).tolist()
            out.append((phrase * args.prompt_len)[: args.prompt_len])
        else:
            out.append(rng.integers(3, 259, args.prompt_len).tolist())
    return out


def build_engine(args: argparse.Namespace, dirs: dict[str, pathlib.Path], setting: str):
    from paged_jax.config import EngineConfig
    from paged_jax.engine import Engine
    from paged_jax.models import load_model

    spec = None
    if not setting.startswith("none"):
        spec = {
            "method": "draft_model",
            "model": str(dirs[setting]),
            "num_speculative_tokens": args.num_speculative_tokens,
        }
    k = args.num_speculative_tokens
    config = EngineConfig(
        block_size=16,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(64, args.max_num_seqs * (k + 1)),
        max_model_len=args.prompt_len + args.max_tokens + 2 * k + 16,
        attention_backend="reference",
        async_scheduling=setting != "none_sync",
        speculative_config=spec,
    )
    engine = Engine(load_model(dirs["target"], attention_backend="reference"), config)
    engine.warmup()
    return engine


def timed_run(engine, requests: list[list[int]], max_tokens: int, tag: str) -> dict:
    from bench_spec_decode import serve_all  # scripts/, this script's folder

    wall, outs, before, after = serve_all(engine, requests, max_tokens, f"{tag}-")
    tokens = sum(len(o.token_ids) for o in outs.values())
    drafted = after.get("spec_num_draft_tokens", 0) - before.get("spec_num_draft_tokens", 0)
    accepted = after.get("spec_num_accepted_tokens", 0) - before.get("spec_num_accepted_tokens", 0)
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "drafted": drafted,
        "accepted": accepted,
        "outputs": [outs[f"{tag}-{i}"].token_ids for i in range(len(requests))],
        "per_position": after.get("spec_acceptance_rate_per_position"),
        "compiles_after_warmup": after.get("num_compiles_after_warmup"),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = [s for s in args.settings.split(",") if s]
    workdir = pathlib.Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    dirs = write_checkpoints(workdir)
    requests = prompts(args)
    engines = {s: build_engine(args, dirs, s) for s in settings}
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    for r in range(args.repeats):
        for s in settings:
            runs[s].append(timed_run(engines[s], requests, args.max_tokens, f"{s}{r}"))
            last = runs[s][-1]
            print(f"round {r} {s:8s} {last['tokens_per_s']:8.1f} tok/s  "
                  f"accepted {last['accepted']}/{last['drafted']}")  # fmt: skip
    base = (
        statistics.median(x["tokens_per_s"] for x in runs.get("none", []))
        if "none" in runs
        else None
    )
    reference = runs["none"][0]["outputs"] if "none" in runs else None
    results = {}
    for s in settings:
        rates = [x["tokens_per_s"] for x in runs[s]]
        drafted = sum(x["drafted"] for x in runs[s])
        accepted = sum(x["accepted"] for x in runs[s])
        results[s] = {
            "tokens_per_s_median": statistics.median(rates),
            "tokens_per_s_min": min(rates),
            "tokens_per_s_max": max(rates),
            "speedup_vs_none": None if base is None else statistics.median(rates) / base,
            "acceptance_rate": accepted / drafted if drafted else None,
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate_per_position": runs[s][-1]["per_position"],
            "outputs_equal_no_speculation": None
            if reference is None
            else all(x["outputs"] == reference for x in runs[s]),
            "compiles_after_warmup": runs[s][-1]["compiles_after_warmup"],
        }
        print(json.dumps({s: results[s]}))
    record = {
        "command": " ".join(["python scripts/bench_spec_draft.py", *(argv or sys.argv[1:])]),
        "args": vars(args),
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "target": "demo Llama shape, random weights (hidden 256, 4 layers, vocab 259)",
        "drafts": {
            "self": "the target itself",
            "layersN": "the target's first N of its 4 layers (truncate_checkpoint)",
            "none_sync": "no speculation, synchronous steps (as speculation runs)",
            "random": "independent random Llama, hidden 64, 1 layer",
        },
        "results": results,
    }
    out = write_json_atomic(args.output, record)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
