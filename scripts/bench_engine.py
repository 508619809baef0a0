"""Engine benchmark: paged-jax vs contiguous-KV baselines vs HF generate, repeated, one trace.

    python scripts/bench_engine.py                 # the default workload, ~15 min on 2 cores
    python scripts/bench_engine.py --systems paged,contiguous-max --repeats 3
    python scripts/bench_engine.py --systems paged --tensor-parallel-size 2,4 --repeats 1

Every system runs in its own worker process (JAX and torch never share one), is built
and compiled once, then serves the trace --repeats times, the systems interleaved round
by round so machine noise hits them alike. HF's batch size is swept first (one run each)
and the best is used for its timed runs. Greedy outputs of every run must equal the
paged engine's: any mismatch exits non-zero (after writing the JSON). See
docs/engine_benchmark.md.
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
import tempfile
import time

from paged_jax.baselines.workload import WorkloadConfig, make_trace, trace_summary

SYSTEMS = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle", "hf")
NAMES = {
    "paged": "paged-jax",
    "contiguous-max": "contiguous-max",
    "contiguous-pow2": "contiguous-pow2",
    "contiguous-oracle": "contiguous-oracle",
    "hf": "hf-static",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: random Llama)")
    p.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma list of " + ",".join(SYSTEMS)
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per system (>= 1)")
    p.add_argument("--output", default="bench_results/bench_engine.json")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count(),
        help="torch intra-op threads for HF (default: all cores; JAX uses all cores)",
    )
    p.add_argument("--hf-batch-sizes", default="8,16,32,64,128", help="swept; best is timed")
    w = p.add_argument_group("workload (log-normal prompt lengths, fixed output length)")
    w.add_argument("--num-requests", type=int, default=128)
    w.add_argument("--input-median", type=float, default=128.0)
    w.add_argument("--input-sigma", type=float, default=0.8)
    w.add_argument("--input-max", type=int, default=384)
    w.add_argument("--output-median", type=float, default=128.0)
    w.add_argument("--output-sigma", type=float, default=0.0)
    w.add_argument("--output-max", type=int, default=128)
    w.add_argument("--seed", type=int, default=0)
    e = p.add_argument_group("KV budget and engines")
    e.add_argument("--max-model-len", type=int, default=512)
    e.add_argument("--kv-budget-bytes", type=int, default=None)
    e.add_argument(
        "--budget-full-requests",
        type=int,
        default=16,
        help="KV budget = this many max_model_len requests (default when no bytes given)",
    )
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--max-num-seqs", type=int, default=64, help="paged and pow2/oracle rows")
    e.add_argument("--max-num-batched-tokens", type=int, default=256)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--no-async-scheduling", action="store_true")
    e.add_argument(
        "--kv-cache-dtype", default="auto", help="paged engine's KV dtype (auto, fp8_e4m3, ...)"
    )
    e.add_argument(
        "--tensor-parallel-size",
        default="1",
        help="N or a comma list: also serve the trace with the paged engine split over N "
        "devices (forced CPU devices on a CPU host: memory and agreement, not speed)",
    )
    args = p.parse_args(argv)
    try:
        sizes = sorted({int(n) for n in args.tensor_parallel_size.split(",")})
    except ValueError:
        sizes = [0]
    if min(sizes) < 1:
        p.error(f"--tensor-parallel-size={args.tensor_parallel_size!r} must be ints >= 1")
    args.tensor_parallel_sizes = [n for n in sizes if n > 1]
    args.systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad or "paged" not in args.systems:
        p.error(f"--systems={','.join(args.systems)!r} must list paged plus any of {SYSTEMS}")
    if args.repeats < 1:
        p.error(f"--repeats={args.repeats} must be >= 1")
    args.hf_batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b.strip()]
    return args


class Worker:
    """A system's worker process: started, warmed up, then one timed run per request."""

    def __init__(self, spec: dict):
        self.name = NAMES[spec["system"]]
        if spec.get("tensor_parallel_size", 1) > 1:
            self.name += f"-tp{spec['tensor_parallel_size']}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "paged_jax.baselines.bench_worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name} worker exited with {self.proc.wait()}")
        return json.loads(line)

    def run(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps({"op": "run", **cmd}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def _spread(values: list[float]) -> dict:
    med = statistics.median(values)
    return {
        "median": med,
        "min": min(values),
        "max": max(values),
        "spread_pct": 100 * (max(values) - min(values)) / med if med else 0.0,
        "runs": values,
    }


def _device_info() -> dict:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "loadavg_1min_at_start": round(os.getloadavg()[0], 2),
    }


def run(args: argparse.Namespace, model_dir: pathlib.Path) -> dict:
    """Starts the workers, sweeps HF, runs the interleaved rounds; returns the report."""
    config = json.loads((model_dir / "config.json").read_text())
    workload = WorkloadConfig(
        num_requests=args.num_requests,
        input_median=args.input_median,
        input_sigma=args.input_sigma,
        input_max=args.input_max,
        output_median=args.output_median,
        output_sigma=args.output_sigma,
        output_min=min(4, args.output_max),
        output_max=args.output_max,
        vocab_size=int(config["vocab_size"]),
        seed=args.seed,
    )
    if workload.max_total_len > args.max_model_len:
        raise SystemExit(
            f"--input-max + --output-max = {workload.max_total_len} must be <= "
            f"--max-model-len={args.max_model_len}"
        )
    trace = make_trace(workload)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    itemsize = 4 if args.dtype == "float32" else 2
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
    per_token *= itemsize
    budget = args.kv_budget_bytes or args.budget_full_requests * args.max_model_len * per_token
    # One pool size for every paged worker (tensor-parallel ones included), in the KV dtype.
    kv_itemsize = 1 if args.kv_cache_dtype.startswith("fp8") else itemsize
    num_kv_blocks = budget // (per_token // itemsize * kv_itemsize * args.block_size)
    spec = {
        "model_dir": str(model_dir),
        "dtype": args.dtype,
        "threads": args.threads,
        "workload": {k: v for k, v in vars(workload).items()},
        "paged": {
            "budget_bytes": budget,
            "num_kv_blocks": num_kv_blocks,
            "kv_cache_dtype": args.kv_cache_dtype,
            "block_size": args.block_size,
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "enable_prefix_caching": not args.no_prefix_caching,
            "async_scheduling": not args.no_async_scheduling,
        },
        "contiguous": {
            "budget_bytes": budget,
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
        },
    }
    print(f"trace: {trace_summary(trace)}", flush=True)
    print(f"KV budget {budget} bytes = {budget // per_token} token slots", flush=True)
    workers: dict[str, Worker] = {}
    try:
        for system in args.systems:  # one at a time: compiles do not overlap
            print(f"starting {NAMES[system]} worker ...", flush=True)
            workers[system] = Worker({**spec, "system": system})
        for n in args.tensor_parallel_sizes:  # the paged engine split over n devices
            print(f"starting paged-jax worker, tensor_parallel_size={n} ...", flush=True)
            workers[f"paged-tp{n}"] = Worker({**spec, "system": "paged", "tensor_parallel_size": n})
        sweep = {}
        if "hf" in workers:
            for bs in args.hf_batch_sizes:
                r = workers["hf"].run(batch_size=bs)
                sweep[bs] = r
                print(f"  hf batch {bs}: {r['summary']['tokens_per_s']:.1f} tok/s", flush=True)
        best_bs = max(sweep, key=lambda b: sweep[b]["summary"]["tokens_per_s"]) if sweep else None
        runs: dict[str, list[dict]] = {w.name: [] for w in workers.values()}
        for round_no in range(args.repeats):
            for system, worker in workers.items():
                r = worker.run(batch_size=best_bs) if system == "hf" else worker.run()
                runs[worker.name].append(r)
                tps = r["summary"]["tokens_per_s"]
                print(f"round {round_no}: {worker.name:<18} {tps:9.1f} tok/s", flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    return build_report(
        args, spec, trace, workload, per_token, budget, runs, sweep, best_bs, workers
    )


def build_report(args, spec, trace, workload, per_token, budget, runs, sweep, best_bs, workers):
    """The JSON report of one benchmark: settings, per-system results, agreement, ratios."""
    reference = runs["paged-jax"][0]["outputs"]
    # A quantized (fp8) paged KV cache is not expected to match full-precision baselines
    # token for token: their agreement is reported, and only paged runs must agree.
    exact = spec["paged"].get("kv_cache_dtype", "auto") == "auto"
    agreement, mismatches = {}, 0
    for name, rs in runs.items():
        same = [sum(r["outputs"].get(k) == v for k, v in reference.items()) for r in rs]
        agreement[name] = {"requests": len(reference), "equal_per_run": same}
        if exact or name.startswith("paged-jax"):
            mismatches += sum(len(reference) - n for n in same)
    for bs, r in sweep.items():
        same = sum(r["outputs"].get(k) == v for k, v in reference.items())
        agreement[f"hf-static (sweep, batch {bs})"] = {"requests": len(reference), "equal": same}
        mismatches += (len(reference) - same) if exact else 0
    results = {}
    for name, rs in runs.items():
        summaries = [r["summary"] for r in rs]
        tps = [s["tokens_per_s"] for s in summaries]
        median_run = sorted(summaries, key=lambda s: s["tokens_per_s"])[len(summaries) // 2]
        results[name] = {"tokens_per_s": _spread(tps), "median_run": median_run}
    ratios = {}
    paged = [r["summary"]["tokens_per_s"] for r in runs["paged-jax"]]
    for name, rs in runs.items():
        if name.startswith("paged-jax"):  # itself, or split over forced CPU devices
            continue
        per_round = [p / r["summary"]["tokens_per_s"] for p, r in zip(paged, rs)]
        ratios[f"throughput_paged_vs_{name}"] = _spread(per_round)
        conc = [
            r0["summary"]["max_concurrent_seqs"] / max(1, r["summary"]["max_concurrent_seqs"])
            for r0, r in zip(runs["paged-jax"], rs)
        ]
        ratios[f"concurrency_paged_vs_{name}"] = statistics.median(conc)
    targets = {}
    if "throughput_paged_vs_hf-static" in ratios:
        got = ratios["throughput_paged_vs_hf-static"]["median"]
        targets["throughput_vs_hf_at_best_settings"] = {
            "target": 2.0,
            "measured": got,
            "met": got >= 2.0,
        }
    keys = ("weight_bytes_per_device", "kv_cache_bytes_per_device", "num_compiles_after_warmup")
    tensor_parallel = {
        str(r["summary"].get("tensor_parallel_size", 1)): {
            **{k: r["summary"].get(k) for k in keys},
            "greedy_outputs_equal_to_tp1": agreement[name]["equal_per_run"],
        }
        for name, rs in runs.items()
        if name.startswith("paged-jax")
        for r in rs[:1]
    }
    return {
        "command": " ".join(["python", "scripts/bench_engine.py", *sys.argv[1:]]),
        "machine": _device_info(),
        "settings": {
            "jax_threads": "XLA CPU default (all cores)",
            "torch_threads": args.threads,
            "hf_batch_sizes_swept": args.hf_batch_sizes,
            "hf_best_batch_size": best_bs,
            "hf_batches": "length-sorted (prompt, then output)",
            "repeats": args.repeats,
            "processes": "one worker process per system; rounds interleave the systems",
            **{f"warmup_s_{w.name}": w.ready.get("warmup_s") for w in workers.values()},
        },
        "workload": {**spec["workload"], "summary": trace_summary(trace)},
        "kv_budget": {
            "bytes": budget,
            "bytes_per_token": per_token,
            "token_slots": budget // per_token,
            "max_model_len": args.max_model_len,
        },
        "engine": spec["paged"],
        "hf_sweep": {str(bs): r["summary"] for bs, r in sweep.items()},
        "results": results,
        "ratios": ratios,
        "targets": targets,
        "greedy_output_agreement": agreement,
        "tensor_parallel": tensor_parallel if len(tensor_parallel) > 1 else None,
        "num_mismatched_outputs": mismatches,
        "table": format_table(results),
    }


def format_table(results: dict) -> str:
    """Median tok/s with its range, and the median run's figures, one row per system."""
    header = (
        f"{'system':<18} {'tok/s median':>12} {'(min-max)':>17} {'max conc':>8} "
        f"{'KV util':>8} {'steps':>6}"
    )
    lines = [header, "-" * len(header)]
    for name, r in results.items():
        t, m = r["tokens_per_s"], r["median_run"]
        span = "({:.0f}-{:.0f})".format(t["min"], t["max"])
        lines.append(
            f"{name:<18} {t['median']:>12.1f} {span:>17} "
            f"{m['max_concurrent_seqs']:>8d} {m['kv_utilization']:>8.1%} "
            f"{m.get('num_steps', '-'):>6}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Builds (or loads) the model, runs the benchmark, prints the table, writes the JSON."""
    args = parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        if args.model:
            model_dir = pathlib.Path(args.model)
        else:  # built in a child process: this one never imports torch or jax
            model_dir = pathlib.Path(tmp) / "llama"
            code = (
                "import sys; from paged_jax.baselines.hf_generate import build_random_llama; "
                "build_random_llama(sys.argv[1], seed=int(sys.argv[2]))"
            )
            subprocess.run([sys.executable, "-c", code, str(model_dir), str(args.seed)], check=True)
        report = run(args, model_dir)
    report["total_wall_s"] = time.perf_counter() - t0
    print()
    print(report["table"])
    print(json.dumps({k: report[k] for k in ("ratios", "targets")}, indent=2))
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} (total {report['total_wall_s']:.0f} s)")
    if report["num_mismatched_outputs"]:
        print(
            f"FAILED: {report['num_mismatched_outputs']} greedy outputs differ from paged-jax's",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
