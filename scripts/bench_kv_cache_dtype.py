"""KV memory study for fp8: blocks, KV tokens and max concurrency at one fixed byte budget.

    python scripts/bench_kv_cache_dtype.py --output docs/fp8_kv_memory.json

Two parts. (1) Arithmetic for published model shapes (bytes per block = 2 * layers *
kv_heads * head_dim * block_size * itemsize, checked against the engine's own sizing on a
real model): blocks, KV tokens and how many max-length requests fit. (2) Measured: the
paged engine serves one seeded trace (random-weight Llama, as bench_engine.py) with its KV
pool sized from the same byte budget, for the model dtype and each fp8 dtype; it records
the blocks, the most sequences in flight, preemptions, steps and greedy agreement with the
unquantized cache.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import sys
import tempfile
import time

from paged_jax.baselines.json_report import write_json_atomic
from paged_jax.constants import cdiv

KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
# (layers, kv heads, head_dim) from the models' config.json files.
PUBLISHED = {
    "Llama-3-8B": (32, 8, 128),
    "Qwen2-7B": (28, 4, 128),
    "Mistral-7B-v0.1": (32, 8, 128),
    "Llama-2-13B (MHA)": (40, 40, 128),
}


def bytes_per_block(layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: str):
    return 2 * layers * kv_heads * head_dim * block_size * ITEMSIZE[dtype]


def arithmetic(budget: int, block_size: int, max_len: int) -> dict:
    """Blocks / KV tokens / full-length requests per dtype for the published shapes."""
    out = {}
    for name, (layers, heads, dim) in PUBLISHED.items():
        row = {}
        for dtype in ("bfloat16", "fp8_e4m3"):
            per_block = bytes_per_block(layers, heads, dim, block_size, dtype)
            blocks = budget // per_block
            row[dtype] = {
                "bytes_per_block": per_block,
                "num_blocks": blocks,
                "kv_tokens": (blocks - 1) * block_size,  # block 0 is the null block
                "max_len_requests": (blocks - 1) // cdiv(max_len, block_size),
            }
        out[name] = row
    return out


def measured(args, model_dir: pathlib.Path) -> dict:
    from paged_jax.baselines import harness
    from paged_jax.baselines.workload import WorkloadConfig, make_trace, trace_summary
    from paged_jax.models import load_model

    model = load_model(model_dir, dtype=args.dtype)
    cfg = model.config
    # The formula of part (1) against the engine's own sizing of this model.
    for dtype, kv in ((args.dtype, None), ("fp8_e4m3", "float8_e4m3fn")):
        formula = bytes_per_block(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, args.block_size, dtype
        )
        assert model.kv_bytes_per_block(args.block_size, kv) == formula, "sizing formula is off"
    workload = WorkloadConfig(
        num_requests=args.num_requests,
        input_median=args.input_median,
        output_median=args.output_median,
        input_max=args.max_model_len // 2,
        output_max=args.max_model_len // 2,
        vocab_size=int(cfg.vocab_size),
        seed=args.seed,
    )
    trace = make_trace(workload)
    per_token = harness.kv_bytes_per_token(model)  # model dtype
    budget = args.budget_full_requests * args.max_model_len * per_token
    print(f"trace: {trace_summary(trace)}; budget {budget} bytes", flush=True)
    runs = {}
    for kv in KV_DTYPES:
        print(f"running kv_cache_dtype={kv} ...", flush=True)
        r = harness.run_paged(
            model,
            trace,
            budget_bytes=budget,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_dtype=kv,
        )
        runs[kv] = r
    base = runs["auto"].outputs
    results = {}
    for kv, r in runs.items():
        same = sum(r.outputs[k] == base[k] for k in base)
        results[kv] = {
            "num_kv_blocks": r.extra["num_kv_blocks"],
            "kv_pool_bytes": r.extra["kv_pool_bytes"],
            "max_concurrent_seqs": r.max_concurrent_seqs,
            "num_preemptions": r.extra["num_preemptions"],
            "num_steps": r.extra["num_steps"],
            "elapsed_s": r.elapsed_s,
            "output_tokens_per_s": r.tokens_per_s,
            "kv_cache_usage_peak": r.extra["kv_cache_usage_peak"],
            "requests_identical_to_unquantized": same / len(base),
            "num_compiles_after_warmup": r.extra["num_compiles_after_warmup"],
        }
    return {
        "model": {
            "dtype": args.dtype,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
        },
        "workload": {**vars(workload), "summary": trace_summary(trace)},
        "budget_bytes": budget,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=pathlib.Path, help="HF checkpoint (default: random Llama)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--input-median", type=float, default=48.0)
    p.add_argument("--output-median", type=float, default=48.0)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--budget-full-requests", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arith-budget-gib", type=float, default=40.0)
    p.add_argument("--arith-max-len", type=int, default=8192)
    p.add_argument("--output", type=pathlib.Path, default=pathlib.Path("fp8_kv_memory.json"))
    args = p.parse_args(argv)
    import jax

    start = time.time()
    report = {
        "command": "python scripts/bench_kv_cache_dtype.py " + " ".join(sys.argv[1:]),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "platform": platform.platform(),
        "arithmetic": {
            "budget_bytes": int(args.arith_budget_gib * 2**30),
            "block_size": args.block_size,
            "max_len": args.arith_max_len,
            "models": arithmetic(
                int(args.arith_budget_gib * 2**30), args.block_size, args.arith_max_len
            ),
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from paged_jax.baselines.hf_generate import build_random_llama

            model_dir = build_random_llama(pathlib.Path(tmp) / "llama", seed=args.seed)
        else:
            model_dir = args.model
        report["measured"] = measured(args, model_dir)
    report["seconds"] = round(time.time() - start, 1)
    print(f"\narithmetic: {args.arith_budget_gib} GiB, block {args.block_size}")
    for name, row in report["arithmetic"]["models"].items():
        bf, f8 = row["bfloat16"], row["fp8_e4m3"]
        print(
            f"  {name:20s} blocks {bf['num_blocks']:>8d} -> {f8['num_blocks']:>8d}  "
            f"{args.arith_max_len}-token requests {bf['max_len_requests']:>5d} -> "
            f"{f8['max_len_requests']:>5d}"
        )
    print(f"\nmeasured ({args.dtype} model, budget {report['measured']['budget_bytes']} bytes)")
    for kv, r in report["measured"]["results"].items():
        print(
            f"  {kv:9s} blocks {r['num_kv_blocks']:>5d}  max concurrent {r['max_concurrent_seqs']:>3d}"
            f"  preemptions {r['num_preemptions']:>3d}  steps {r['num_steps']:>4d}  "
            f"identical outputs {r['requests_identical_to_unquantized']:.0%}"
        )
    write_json_atomic(args.output, report)
    print(f"wrote {args.output} ({report['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
