"""Engine benchmark: paged-jax vs a contiguous-KV JAX baseline vs HF static-batch generate.

    python scripts/bench_engine.py                       # built-in random Llama, ~2 min on CPU
    python scripts/bench_engine.py --num-requests 8 --systems paged,contiguous
    python scripts/bench_engine.py --tensor-parallel-size 2,4,8 --num-requests 8   # TP vs N=1

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
    e.add_argument(
        "--tensor-parallel-size",
        default="1",
        help="N or a comma list: also serve the trace split over N devices and compare "
        "per-device memory and greedy outputs with N=1 (on CPU the N devices are faked "
        "and speed is not reported)",
    )
    e.add_argument(
        "--kv-cache-dtype", default="auto", help="paged engine's KV dtype (auto, fp8_e4m3, ...)"
    )
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
    try:
        sizes = sorted({int(n) for n in args.tensor_parallel_size.split(",")})
    except ValueError:
        sizes = [0]
    if sizes[0] < 1:
        p.error(f"--tensor-parallel-size={args.tensor_parallel_size!r} must be ints >= 1")
    args.tensor_parallel_sizes = [n for n in sizes if n > 1]
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
    report_base = _report_base(args, model, workload, trace, budget, per_token, contiguous_slots)
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
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.tensor_parallel_sizes:
        return run_tensor_parallel(args, model_dir, trace, results["paged-jax"], report_base)
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
    report = {**report_base, "results": {name: r.summary() for name, r in results.items()}}
    report.update(**harness.compare(results), table=table)
    return report


def run_tensor_parallel(
    args: argparse.Namespace, model_dir: pathlib.Path, trace, one, report_base: dict
) -> dict:
    """The paged engine at each N next to its N=1 run `one`: per-device bytes, outputs."""
    import jax

    from paged_jax.baselines import harness
    from paged_jax.models import load_model
    from paged_jax.worker.sharding import make_mesh

    keys = ("weight_bytes_per_device", "kv_cache_bytes_per_device", "num_compiles_after_warmup")
    speed = jax.default_backend() != "cpu"  # fake CPU devices share the host's cores
    rows = {1: {**{k: one.extra[k] for k in keys}, "greedy_outputs_equal_to_tp1": 1.0}}
    rows[1]["num_kv_heads_per_device"] = report_base["model"]["num_key_value_heads"]
    for n in args.tensor_parallel_sizes:
        print(f"running paged-jax engine, tensor_parallel_size={n} ...", flush=True)
        model = load_model(model_dir, dtype=args.dtype, mesh=make_mesh(n))
        split = harness.run_paged(
            model,
            trace,
            budget_bytes=0,
            num_kv_blocks=one.extra["num_kv_blocks"],
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            tensor_parallel_size=n,
        )
        same = sum(one.outputs[r] == split.outputs[r] for r in one.outputs) / len(one.outputs)
        rows[n] = {**{k: split.extra[k] for k in keys}, "greedy_outputs_equal_to_tp1": same}
        rows[n]["num_kv_heads_per_device"] = int(model.config.num_key_value_heads) // n
        if speed:
            rows[n]["tokens_per_s"] = split.tokens_per_s
    if speed:
        rows[1]["tokens_per_s"] = one.tokens_per_s
    header = f"{'N':>3} {'weights B/dev':>14} {'KV B/dev':>12} {'compiles':>9} {'= N=1':>6}"
    lines = [header, "-" * len(header)]
    for n, row in rows.items():
        lines.append(
            f"{n:>3} {row['weight_bytes_per_device']:>14} {row['kv_cache_bytes_per_device']:>12}"
            f" {row['num_compiles_after_warmup']:>9} {row['greedy_outputs_equal_to_tp1']:>6.0%}"
        )
    if not speed:
        lines.append("speed not reported: the CPU devices are faked (memory and correctness only)")
    tp = {"per_size": {str(n): row for n, row in rows.items()}, "speed_reported": speed}
    return {**report_base, "tensor_parallel": tp, "table": "\n".join(lines)}


def _report_base(
    args: argparse.Namespace,
    model,
    workload: WorkloadConfig,
    trace,
    budget: int,
    per_token: int,
    contiguous_slots: int,
) -> dict:
    """The run's description shared by both report kinds: command, device, model, trace."""
    return {
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
    }


def main(argv: list[str] | None = None) -> int:
    """Builds (or loads) the model, runs the benchmark, prints the table, writes the JSON."""
    args = _parse_args(argv)
    if args.tensor_parallel_sizes:
        import jax

        # On a CPU host, fake N devices (must precede jax's first device query); GPUs
        # and TPUs are unaffected.
        jax.config.update("jax_num_cpu_devices", max(args.tensor_parallel_sizes))
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
    keys = ("tensor_parallel",) if "tensor_parallel" in report else ("ratios", "targets")
    print(
        json.dumps(
            {k: report[k] for k in (*keys, "greedy_output_agreement") if k in report}, indent=2
        )
    )
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} (total {report['total_wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
