"""The main job: offline batched generation from the command line (`paged-jax-generate`).

paged-jax-generate                          # built-in demo model and prompts
paged-jax-generate --model DIR --prompts prompts.jsonl --output out.jsonl
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from paged_jax.config import ATTENTION_BACKENDS, DTYPES, PREEMPTION_MODES, EngineConfig
from paged_jax.sampling_params import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="paged-jax-generate",
        description="Offline batched generation with paged-jax.",
    )
    p.add_argument("--model", help="Hugging Face model directory (default: the demo model)")
    p.add_argument(
        "--cache-dir", help="where the demo model is written (default ~/.cache/paged_jax)"
    )
    p.add_argument("--prompts", help=".jsonl with a 'prompt' field, or .txt with one per line")
    p.add_argument("--num-prompts", type=int, default=200, help="size of the built-in set")
    p.add_argument("--output", help="write one JSON line per prompt here")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--min-tokens", type=int, default=0)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--n", type=int, default=1, help="completions per prompt")
    s.add_argument("--ignore-eos", action="store_true")
    e = p.add_argument_group("engine")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-kv-blocks", type=int, default=None)
    e.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        help="KV budget: bytes (> 1) or a fraction of free device memory (<= 1)",
    )
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=512)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="read each step's tokens before scheduling the next (for debugging)",
    )
    e.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default="recompute")
    e.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    e.add_argument("--dtype", choices=DTYPES, default="auto")
    e.add_argument("--engine-seed", type=int, default=0)
    p.add_argument("--no-tqdm", action="store_true", help="no progress bar")
    return p


def read_prompts(path: str) -> list[str]:
    """Prompts from a .jsonl ('prompt' field) or .txt (one per line) file."""
    file = pathlib.Path(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--prompts={path!r} cannot be read: {err}") from err
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if file.suffix == ".jsonl":
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"--prompts={path!r} line {n} is not JSON: {err}") from err
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f"--prompts={path!r} line {n} must have a string 'prompt' field")
            prompts.append(record["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"--prompts={path!r} holds no prompts")
    return prompts


def _engine_args(args: argparse.Namespace) -> dict:
    memory = args.kv_cache_memory
    if memory is not None and memory > 1:
        memory = int(memory)
    return dict(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=args.preemption_mode,
        attention_backend=args.attention_backend,
        dtype=args.dtype,
        seed=args.engine_seed,
        async_scheduling=not args.no_async_scheduling,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        engine_args = _engine_args(args)
        EngineConfig(**engine_args)  # validate flags before loading anything
        params = SamplingParams(
            n=args.n,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            max_tokens=args.max_tokens,
            min_tokens=args.min_tokens,
            ignore_eos=args.ignore_eos,
        )
        if args.prompts:
            prompts = read_prompts(args.prompts)
        else:
            from paged_jax.entrypoints.demo_prompts import builtin_prompts

            if args.num_prompts < 1:
                raise ValueError(f"--num-prompts={args.num_prompts!r} must be >= 1")
            prompts = builtin_prompts(args.num_prompts)
        if args.model is None:
            from paged_jax.entrypoints.demo import ensure_demo_model

            model_dir = ensure_demo_model(args.cache_dir)
            print(f"using the built-in demo model (random weights) at {model_dir}", file=sys.stderr)
        else:
            model_dir = pathlib.Path(args.model)
            if not (model_dir / "config.json").is_file():
                raise ValueError(
                    f"--model={args.model!r} must be a Hugging Face model directory with config.json"
                )
    except ValueError as err:
        parser.error(str(err))

    from paged_jax.llm import LLM

    try:
        t0 = time.perf_counter()
        llm = LLM(str(model_dir), **engine_args)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
        wall = time.perf_counter() - t0
    except (ValueError, FileNotFoundError) as err:
        print(f"paged-jax-generate: error: {err}", file=sys.stderr)
        return 2

    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            for out in outputs:
                record = {
                    "request_id": out.request_id,
                    "prompt": out.prompt,
                    "prompt_token_ids": out.prompt_token_ids,
                    "outputs": [
                        {
                            "index": c.index,
                            "text": c.text,
                            "token_ids": c.token_ids,
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                        }
                        for c in out.outputs
                    ],
                    "time_to_first_token": out.metrics.time_to_first_token,
                }
                f.write(json.dumps(record) + "\n")
    stats = llm.get_stats()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    gen_tokens = sum(o.metrics.num_generated_tokens for o in outputs)
    summary = {
        "requests": len(outputs),
        "completions": sum(len(o.outputs) for o in outputs),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": gen_tokens,
        "load_and_warmup_s": round(load_s, 2),
        "wall_s": round(wall, 2),
        "generated_tokens_per_s": round(gen_tokens / wall, 1),
        "total_tokens_per_s": round((prompt_tokens + gen_tokens) / wall, 1),
        "kv_blocks": stats["num_kv_blocks"],
        "peak_kv_usage": round(stats["kv_cache_usage_peak"], 3),
        "prefix_cache_hit_rate": round(stats["prefix_cache_hit_rate"], 3),
        "preemptions": stats["num_preemptions"],
        "compiles_after_warmup": stats["num_compiles_after_warmup"],
        "steps": stats["num_steps"],
        "median_step_ms": round(stats["step_time_ms"], 2),
    }
    print("\n== paged-jax generate summary ==")
    for key, value in summary.items():
        print(f"{key:>24}: {value}")
    if outputs and outputs[0].outputs:
        print(f"\nfirst completion: {outputs[0].outputs[0].text[:120]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
