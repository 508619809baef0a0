"""Engine benchmark: paged-jax vs a contiguous-KV JAX baseline vs HF static-batch generate.

    python scripts/bench_engine.py                       # built-in random Llama, ~2 min on CPU
    python scripts/bench_engine.py --num-requests 8 --systems paged,contiguous

Prints a table and writes JSON (--output). See docs/engine_benchmark.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import tempfile
import time

from paged_jax.baselines.workload import WorkloadConfig, make_trace, trace_summary

SYSTEMS = ("paged", "contiguous", "hf")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: random Llama)")
    p.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma list of " + "/".join(SYSTEMS)
    )
    p.add_argument("--output", default="bench_results/bench_engine.json")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    w = p.add_argument_group("workload (ShareGPT-like, log-normal lengths)")
    w.add_argument("--num-requests", type=int, default=100)
    w.add_argument("--input-median", type=float, default=128.0)
    w.add_argument("--input-sigma", type=float, default=0.8)
    w.add_argument("--input-max", type=int, default=480)
    w.add_argument("--output-median", type=float, default=256.0)
    w.add_argument("--output-sigma", type=float, default=0.8)
    w.add_argument("--output-max", type=int, default=500)
    w.add_argument("--seed", type=int, default=0)
    e = p.add_argument_group("KV budget and engine")
    e.add_argument("--max-model-len", type=int, default=1024)
    e.add_argument(
        "--kv-budget-bytes",
        type=int,
        default=None,
        help="KV budget of every system (default: --budget-full-requests full-length requests)",
    )
    e.add_argument("--budget-full-requests", type=int, default=8)
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=128)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--hf-batch-size", type=int, default=None, help="default: contiguous slots")
    e.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch threads for the HF baseline (0: torch's default); 1 is fastest on a "
        "shared CPU, see docs/engine_benchmark.md",
    )
    args = p.parse_args(argv)
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or "paged" not in systems:
        p.error(f"--systems={args.systems!r} must list paged plus any of {SYSTEMS}")
    args.systems = systems
    return args


def _device_info() -> dict[str, str]:
    import jax

    dev = jax.devices()[0]
    return {
        "jax_backend": jax.default_backend(),
        "jax_device": str(getattr(dev, "device_kind", dev)),
        "jax_version": jax.__version__,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def run(args: argparse.Namespace, model_dir: pathlib.Path) -> dict:
    """Runs the selected systems on one trace; returns the JSON report."""
    from paged_jax.baselines import harness
    from paged_jax.models import load_model

    model = load_model(model_dir, dtype=args.dtype)
    workload = WorkloadConfig(
        num_requests=args.num_requests,
        input_median=args.input_median,
        input_sigma=args.input_sigma,
        input_max=args.input_max,
        output_median=args.output_median,
        output_sigma=args.output_sigma,
        output_max=args.output_max,
        vocab_size=int(model.config.vocab_size),
        seed=args.seed,
    )
    if workload.max_total_len > args.max_model_len:
        raise SystemExit(
            f"--input-max + --output-max = {workload.max_total_len} must be <= "
            f"--max-model-len={args.max_model_len}"
        )
    trace = make_trace(workload)
    per_token = harness.kv_bytes_per_token(model)
    budget = args.kv_budget_bytes or args.budget_full_requests * args.max_model_len * per_token
    contiguous_slots = budget // (args.max_model_len * per_token)
    results: dict[str, harness.SystemResult] = {}
    print(f"trace: {trace_summary(trace)}", flush=True)
    print(f"KV budget {budget} bytes = {budget // per_token} token slots", flush=True)
    print("running paged-jax engine ...", flush=True)
    results["paged-jax"] = harness.run_paged(
        model,
        trace,
        budget_bytes=budget,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    if "contiguous" in args.systems:
        print("running contiguous-KV baseline ...", flush=True)
        results["contiguous-kv"] = harness.run_contiguous(
            model, trace, budget_bytes=budget, max_model_len=args.max_model_len
        )
    if "hf" in args.systems:
        print("running HF transformers static batches ...", flush=True)
        results["hf-static"] = harness.run_hf(
            model_dir,
            trace,
            batch_size=args.hf_batch_size or contiguous_slots,
            dtype=args.dtype,
            num_threads=args.torch_threads or None,
        )
    table = harness.format_table(results)
    report = {
        "command": " ".join(["python", "scripts/bench_engine.py", *sys.argv[1:]]),
        "device": _device_info(),
        "model": {
            "path": str(args.model) if args.model else "built-in random Llama",
            "num_hidden_layers": int(model.config.num_hidden_layers),
            "hidden_size": int(model.config.hidden_size),
            "num_key_value_heads": int(model.config.num_key_value_heads),
            "head_dim": int(model.config.head_dim),
            "vocab_size": int(model.config.vocab_size),
            "dtype": args.dtype,
        },
        "workload": {**vars(workload), "summary": trace_summary(trace)},
        "kv_budget": {
            "bytes": budget,
            "bytes_per_token": per_token,
            "token_slots": budget // per_token,
            "max_model_len": args.max_model_len,
            "contiguous_slots": contiguous_slots,
        },
        "results": {name: r.summary() for name, r in results.items()},
        **harness.compare(results),
        "table": table,
    }
    return report


def main(argv: list[str] | None = None) -> int:
    """Builds (or loads) the model, runs the benchmark, prints the table, writes the JSON."""
    args = _parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        if args.model:
            model_dir = pathlib.Path(args.model)
        else:
            from paged_jax.baselines.hf_generate import build_random_llama

            model_dir = build_random_llama(pathlib.Path(tmp) / "llama", seed=args.seed)
        report = run(args, model_dir)
    report["total_wall_s"] = time.perf_counter() - t0
    print()
    print(report["table"])
    print(
        json.dumps(
            {k: report[k] for k in ("ratios", "targets", "greedy_output_agreement")}, indent=2
        )
    )
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} (total {report['total_wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
