"""Online serving benchmark: mean normalized latency against request rate, paged vs contiguous.

    python scripts/bench_serving.py                      # tiny Llama, ShareGPT- and Alpaca-like
    python scripts/bench_serving.py --datasets sharegpt --rates-sharegpt 2,4,8 --repeats 1
    python scripts/bench_serving.py --trace-jsonl my.jsonl --rates-user 1,2,4
    python scripts/bench_serving.py --dry-run            # print the plan, run nothing
    python scripts/bench_serving.py --datasets alpaca --systems paged,orca-oracle \
        --workload parallel,beam --fanouts 2,4,6 --block-size 4   # n samples / n beams
    python scripts/bench_serving.py --replot docs/serving_benchmark.json --figures docs/figures
    python scripts/bench_serving.py --datasets sharegpt --systems paged,orca-oracle,paged-control \
        --rates-sharegpt 12,16,20 --duration-s 60 --repeats 5 --stop-factor 1000   # paired

Requests arrive by a seeded Poisson process at each rate on the wall clock; every system
(the paged engine; the paper's Orca, i.e. the paged engine behind buddy-placed
reservations under max / pow2 / oracle; a FasterTransformer-style static batch
("static"); the dense-cache contiguous-KV engine; and "paged-control", the paged engine
in a second worker, whose ratio to the first is the noise floor) serves them, admitting
a request only once it has arrived, under the same KV budget in bytes, with the same
model, greedy, EOS ignored. Per request: latency = finish - arrival, normalized by its output tokens; a
point is the mean over the trace, repeated --repeats times (seeds differ), systems
interleaved and rotated within a repeat. A system stops at the first rate whose median
exceeds --stop-factor x the bound. The bound is --latency-factor x the largest
unloaded latency (each system's median at the lowest rate); a system's sustained rate
is the highest rate under it (interpolated). Repeats are paired (every system serves a
repeat's arrivals): per repeat the ratios paged / other of sustained rates and other /
paged of latency at each rate are reported with a 95% t interval, beside the
time-averaged batch size (mean requests running over the run's wall clock). Every system runs in its own worker process
(paged_jax.baselines.serving_worker). Outputs of every run must equal the paged engine's
(same trace): any mismatch exits non-zero after writing the JSON. docs/serving_benchmark.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

from paged_jax.baselines.hf_generate import MODEL_PRESETS, llama_num_parameters
from paged_jax.baselines.json_report import write_json_atomic
from paged_jax.baselines.serving import (
    FANOUT_KINDS,
    PAGED,
    analyze_curves,
    paired_analysis,
    plot_fanout_curves,
    plot_latency_curves,
    system_curves,
)
from paged_jax.baselines.serving_worker import build_trace
from paged_jax.baselines.worker_process import WorkerProcess
from paged_jax.baselines.workload import (
    DATASET_NAMES,
    PAPER_MAX_MODEL_LEN,
    DatasetTraceConfig,
    trace_summary,
)

SYSTEMS = (
    "paged",
    "orca-oracle",
    "orca-pow2",
    "orca-max",
    "contiguous-oracle",
    "contiguous-pow2",
    "contiguous-max",
    "static",
    "paged-control",
)
DEFAULT_SYSTEMS = SYSTEMS[:4]
NAMES = {s: (PAGED if s == "paged" else s) for s in SYSTEMS}
DEFAULT_RATES = {"sharegpt": "1,2,4,6,8,10,12,16,20", "alpaca": "4,8,16,24,32,40,48,64"}
# The paper's ShareGPT figures (OPT-13B, Figure 12 and its text); its Alpaca panels give
# curves, not one range: the doc reads them per trace.
PAPER_RATIOS_SHAREGPT = {
    "orca-oracle": "1.7-2.7x",
    "orca-max": "2.7-8x",
    "contiguous-oracle": "1.7-2.7x",
    "contiguous-max": "2.7-8x",
    "static": "up to 22x",
}
PAPER_RATIOS = PAPER_RATIOS_SHAREGPT


def _float_list(p: argparse.ArgumentParser, flag: str, text: str) -> list[float]:
    try:
        values = sorted({float(v) for v in text.split(",") if v.strip()})
    except ValueError:
        values = []
    if not values or values[0] <= 0:
        p.error(f"{flag}={text!r} must be a comma list of numbers > 0")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    m = p.add_mutually_exclusive_group()
    m.add_argument("--model", default=None, help="HF checkpoint dir (default: a random Llama)")
    m.add_argument("--model-preset", default="tiny", choices=sorted(MODEL_PRESETS))
    p.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help="comma list of " + ",".join(SYSTEMS) + " (orca-*: the paged engine behind "
        "contiguous reservations; contiguous-*: the dense-cache baseline engine)",
    )
    p.add_argument("--datasets", default=",".join(DATASET_NAMES), help="synthetic traces to serve")
    p.add_argument(
        "--trace-jsonl",
        default=None,
        help='also serve a user trace "user": JSON lines {"prompt_len": P, "output_len": O}',
    )
    for name in (*DATASET_NAMES, "user"):
        p.add_argument(
            f"--rates-{name}",
            default=DEFAULT_RATES.get(name, "1,2,4,8"),
            help=f"request rates (requests/s) for the {name} trace",
        )
    p.add_argument(
        "--duration-s",
        type=float,
        default=10.0,
        help="arrivals span about this long at every rate: the run at rate R serves the "
        "trace's first round(R x T) requests, so an overloaded system's queue grows over "
        "the run as it would online (0: every rate serves --num-requests)",
    )
    p.add_argument(
        "--num-requests", type=int, default=100, help="requests per trace with --duration-s 0"
    )
    for name in (*DATASET_NAMES, "user"):
        p.add_argument(
            f"--num-requests-{name}",
            type=int,
            default=None,
            help=f"requests of the {name} trace (default: --num-requests)",
        )
    p.add_argument(
        "--unloaded-requests",
        type=int,
        default=16,
        help="the unloaded point (rate 0): the trace's first K requests served one at a time",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=0.25,
        help="factor on the paper's lengths and max_model_len 2048 (0.25: max_model_len 512)",
    )
    p.add_argument("--repeats", type=int, default=2, help="runs per point (arrival seeds differ)")
    p.add_argument("--seed", type=int, default=0, help="trace and model seed")
    p.add_argument(
        "--budget-max-requests",
        type=float,
        default=7.5,
        help="KV budget = this many max_model_len reservations (same bytes for every system)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="paged block size (default: 16 x --scale, the paper's 16 at full lengths)",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="paged and pow2/oracle rows")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--latency-factor", type=float, default=4.0, help="bound = this x unloaded")
    p.add_argument(
        "--stop-factor",
        type=float,
        default=2.5,
        help="a system stops at the first rate whose median is above this x the bound",
    )
    p.add_argument("--output", default="bench_results/serving_benchmark.json")
    p.add_argument(
        "--figures", default=None, help="folder for serving_<trace>.png (none: no figure)"
    )
    p.add_argument(
        "--compile-cache-dir",
        default=None,
        help="JAX compilation cache shared by the workers (default: a temp dir); warm-up only",
    )
    p.add_argument(
        "--workload",
        default="plain",
        help="comma list of plain (one sequence a request), parallel (each request asks "
        "for n samples: SamplingParams(n), seeded) and beam (beam search of width n); the "
        "paper's Figure 14 question. parallel / beam serve each n of --fanouts at the "
        "trace's rates divided by n, write their curves under 'fanout' and draw "
        "serving_parallel.png",
    )
    p.add_argument("--fanouts", default="2,4,6", help="n of parallel sampling and beam width")
    p.add_argument(
        "--replot",
        default=None,
        metavar="JSON",
        help="redraw the figures of a saved run into --figures; measures nothing",
    )
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    args.workload = tuple(w.strip() for w in args.workload.split(",") if w.strip())
    if not args.workload or any(w not in FANOUT_KINDS for w in args.workload):
        p.error(f"--workload={','.join(args.workload)!r} must list some of {FANOUT_KINDS}")
    try:
        args.fanouts = sorted({int(v) for v in args.fanouts.split(",") if v.strip()})
    except ValueError:
        args.fanouts = []
    if not args.fanouts or not 1 <= args.fanouts[0] <= args.fanouts[-1] <= 10:
        p.error(f"--fanouts={args.fanouts!r} must be a comma list of ints in [1, 10]")
    if set(args.workload) - {"plain"} and any(
        not (s == "paged" or s.startswith("orca-")) for s in args.systems.split(",")
    ):
        p.error("--workload parallel / beam serve the paged engine and orca-* systems only")
    args.systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    if any(s not in SYSTEMS for s in args.systems) or not args.systems:
        p.error(f"--systems={','.join(args.systems)!r} must list some of {SYSTEMS}")
    args.datasets = tuple(s.strip() for s in args.datasets.split(",") if s.strip())
    if any(d not in DATASET_NAMES for d in args.datasets):
        p.error(f"--datasets={','.join(args.datasets)!r} must list some of {DATASET_NAMES}")
    if not args.datasets and not args.trace_jsonl:
        p.error("--datasets is empty and no --trace-jsonl: nothing to serve")
    args.rates = {
        name: _float_list(p, f"--rates-{name}", getattr(args, f"rates_{name}"))
        for name in (*args.datasets, *(["user"] if args.trace_jsonl else []))
    }
    if args.duration_s < 0:
        p.error(f"--duration-s={args.duration_s} must be >= 0")
    args.requests = {
        name: math.ceil(max(args.rates[name]) * args.duration_s)
        if args.duration_s and name != "user"
        else getattr(args, f"num_requests_{name}") or args.num_requests
        for name in args.rates
    }
    if args.repeats < 1 or min(args.requests.values()) < 1 or args.unloaded_requests < 1:
        p.error(
            f"--repeats={args.repeats}, --unloaded-requests={args.unloaded_requests} and "
            f"the request counts {args.requests} must be >= 1"
        )
    if not (args.latency_factor > 1 and args.stop_factor >= 1):
        p.error(
            f"--latency-factor={args.latency_factor} must be > 1 and "
            f"--stop-factor={args.stop_factor} >= 1"
        )
    if not 0 < args.scale <= 1:
        p.error(f"--scale={args.scale} must be in (0, 1]")
    if args.block_size is None:
        args.block_size = max(1, round(16 * args.scale))
    if args.block_size < 1:
        p.error(f"--block-size={args.block_size} must be >= 1")
    return args


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int:
    """K and V of one token over all layers, from the HF config (no model is loaded)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    itemsize = 4 if dtype == "float32" else 2
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * itemsize


def make_plan(args: argparse.Namespace, model_config: dict[str, Any]) -> dict[str, Any]:
    """Traces, the shared KV budget and each system's worker spec (JSON-ready)."""
    max_model_len = max(2, round(PAPER_MAX_MODEL_LEN * args.scale))
    per_token = kv_bytes_per_token(model_config, args.dtype)
    budget_tokens = int(args.budget_max_requests * max_model_len)
    budget_tokens -= budget_tokens % args.block_size  # whole blocks: paged holds it exactly
    budget = budget_tokens * per_token
    traces: dict[str, dict[str, Any]] = {}
    for d in args.datasets:
        traces[d] = dataclass_dict(
            DatasetTraceConfig(
                dataset=d,
                num_requests=args.requests[d],
                scale=args.scale,
                vocab_size=model_config["vocab_size"],
                seed=args.seed,
            )
        )
    if args.trace_jsonl:
        traces["user"] = {
            "jsonl": str(args.trace_jsonl),
            "max_model_len": max_model_len,
            "num_requests": args.requests["user"],
            "vocab_size": model_config["vocab_size"],
            "seed": args.seed,
        }
    paged = {
        # One more block than the budget: the engine's null block holds no tokens.
        "budget_bytes": budget + args.block_size * per_token,
        "block_size": args.block_size,
        "max_model_len": max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "async_scheduling": not args.no_async_scheduling,
    }
    # The same pool: reservations are made in whole blocks of it, so they never need
    # more blocks than it holds (the engine never preempts) and the programs are the
    # paged worker's (its compilation cache entries serve this warm-up).
    orca = {**paged, "reservation_budget_tokens": budget_tokens}
    contiguous = {
        "budget_bytes": budget,
        "max_model_len": max_model_len,
        "max_num_seqs": args.max_num_seqs,
    }
    return {
        "max_model_len": max_model_len,
        "kv_bytes_per_token": per_token,
        "kv_budget_bytes": budget,
        "kv_budget_tokens": budget_tokens,
        "kv_budget_max_len_requests": budget_tokens / max_model_len,
        "traces": traces,
        "paged": paged,
        "orca": orca,
        "contiguous": contiguous,
    }


def dataclass_dict(obj: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(obj)


class Worker(WorkerProcess):
    """A system's worker process: started and warmed up, then one online run per call."""

    module = "paged_jax.baselines.serving_worker"

    def serve(
        self,
        trace: str,
        rate: float,
        seed: int,
        num_requests: int,
        kind: str = "plain",
        fanout: int = 1,
    ) -> dict:
        """One run over the trace's first num_requests (rate 0: one at a time), each
        request one sequence, `fanout` parallel samples or `fanout` beams (kind)."""
        return self.request(
            "serve", trace=trace, rate=rate, seed=seed, n=num_requests, kind=kind, fanout=fanout
        )


def fanout_rates(rates: list[float], kind: str, fanout: int) -> list[float]:
    """The rates a fanout sweep serves: the trace's divided by n (n sequences a request),
    so every n meets its knee within the same grid."""
    if kind == "plain":
        return list(rates)
    return [round(r / fanout, 3) for r in rates]


def requests_at(args: argparse.Namespace, trace: str, rate: float, num_trace: int) -> int:
    """Requests served at `rate`: the unloaded prefix, about rate x duration, or all."""
    if rate == 0:
        return min(num_trace, args.unloaded_requests)
    if args.duration_s and trace != "user":
        return min(num_trace, max(2, round(rate * args.duration_s)))
    return num_trace


def sweep(
    args: argparse.Namespace,
    workers: dict[str, Worker],
    trace: str,
    num_trace: int,
    kind: str = "plain",
    fanout: int = 1,
) -> tuple[list[dict], dict[str, Any], dict[str, Any]]:
    """Rate 0 (unloaded), then every rate ascending; at each, --repeats rounds over the
    systems still active, started in rotated order. With a fanout (kind "parallel" or
    "beam", fanout n) every rate of the trace is divided by n: n sequences a request.

    Returns the points (one per run), the output check (check_outputs) and per system
    the equal count of every run.
    """
    points: list[dict] = []
    runs: list[tuple[str, int, dict[str, list[int]]]] = []
    active = list(workers)
    for rate in [0.0, *fanout_rates(args.rates[trace], kind, fanout)]:
        if not active:
            break
        for rep in range(args.repeats):
            seed = args.seed * 1000 + rep
            order = active[rep % len(active) :] + active[: rep % len(active)]
            for name in order:
                n = requests_at(args, trace, rate, num_trace)
                res = workers[name].serve(trace, rate, seed, n, kind, fanout)
                s = res["summary"]
                label = trace if kind == "plain" else f"{trace} {kind} {fanout}"
                print(
                    f"  {label} rate {rate:g} rep {rep} {name}: "
                    f"{s['mean_normalized_latency_s'] * 1e3:.1f} ms/token, "
                    f"max batch {s['max_running']}, {s['wall_s']:.1f} s",
                    flush=True,
                )
                points.append({"system": name, "trace": trace, "repeat": rep, "kind": kind, **s})
                points[-1]["loadavg_1min"] = round(os.getloadavg()[0], 2)
                if kind != "plain":
                    points[-1]["fanout"] = fanout
                runs.append((name, n, res["outputs"]))
        curves = system_curves(points)
        bound = analyze_curves(curves, args.latency_factor)["main"]["bound_s_per_token"]
        for name in list(active):
            last = curves[name][-1]
            if last["rate"] == rate and last["median"] > args.stop_factor * bound:
                active.remove(name)
                print(f"  {name} saturated at {rate:g} req/s: stopped", flush=True)
    check, agreement = check_outputs(runs)
    return points, check, agreement


def check_outputs(
    runs: list[tuple[str, int, dict[str, list[int]]]],
) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Every run's outputs against the paged engine's output of each request.

    runs: (system, requests it was given, its outputs). A run must return all of its
    requests; a missing one or one that differs from the paged engine's is a mismatch.
    Requests the paged engine never served (a rate it did not reach) are counted as
    unchecked. Without a paged run the first system's outputs are the reference.
    """
    reference: dict[str, list[int]] = {}
    first = next((n for n, _, _ in runs if n == PAGED), runs[0][0] if runs else None)
    for name, _, outs in runs:
        if name == first:
            for k, v in outs.items():
                reference.setdefault(k, v)
    check = {"mismatched": 0, "missing": 0, "unchecked": 0, "compared": 0}
    agreement: dict[str, list[int]] = {}
    for name, n, outs in runs:
        known = [k for k in outs if k in reference]
        same = sum(reference[k] == outs[k] for k in known)
        agreement.setdefault(name, []).append(same)
        check["compared"] += len(known)
        check["mismatched"] += len(known) - same
        check["unchecked"] += len(outs) - len(known)
        check["missing"] += n - len(outs)
    return check, agreement


def _source() -> dict:
    root = pathlib.Path(__file__).resolve().parents[1]
    commit = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    )
    if commit.returncode:
        return {"commit": os.environ.get("BENCH_SOURCE_COMMIT"), "export": True}
    return {"commit": commit.stdout.strip(), "uncommitted_changes": bool(dirty.stdout.strip())}


def build_model(args: argparse.Namespace, tmp: pathlib.Path) -> pathlib.Path:
    """--model, or the preset's random Llama built in a child process (torch stays there)."""
    if args.model:
        return pathlib.Path(args.model)
    model_dir = tmp / "llama"
    code = (
        "import sys; from paged_jax.baselines.hf_generate import build_random_llama; "
        "build_random_llama(sys.argv[1], seed=int(sys.argv[2]), preset=sys.argv[3])"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(model_dir), str(args.seed), args.model_preset], check=True
    )
    return model_dir


def plan_text(args: argparse.Namespace, plan: dict[str, Any]) -> str:
    lines = [
        f"systems: {', '.join(NAMES[s] for s in args.systems)}",
        f"max_model_len {plan['max_model_len']} (scale {args.scale:g} of {PAPER_MAX_MODEL_LEN})",
        f"KV budget: {plan['kv_budget_tokens']} token slots = {plan['kv_budget_bytes']} bytes "
        f"({plan['kv_budget_max_len_requests']:.2f} max-length requests)",
        f"block size {args.block_size}, max_num_seqs {args.max_num_seqs}, "
        f"max_num_batched_tokens {args.max_num_batched_tokens}",
        f"repeats {args.repeats}; unloaded point: {args.unloaded_requests} requests one at a time",
    ]
    for name, rates in args.rates.items():
        per_rate = ", ".join(
            f"{r:g} ({requests_at(args, name, r, args.requests[name])})" for r in rates
        )
        lines.append(f"{name}: {args.requests[name]} requests; rate (requests): {per_rate}")
    return "\n".join(lines)


def build_report(
    args: argparse.Namespace,
    plan: dict[str, Any],
    results: dict[str, dict[str, Any]],
    workers_ready: dict[str, dict],
    model_config: dict[str, Any],
) -> dict[str, Any]:
    traces = {}
    for name, spec in plan["traces"].items():
        res = results.get(name, {})
        curves = system_curves(res.get("points", []))
        analysis = analyze_curves(curves, args.latency_factor) if curves else None
        paired = {}
        if analysis:
            for a in (analysis["main"], *analysis["sensitivity"]):
                paired[f"{a['factor']:g}x"] = paired_analysis(
                    res.get("points", []), a["bound_s_per_token"]
                )
        entry = {
            "spec": spec,
            "summary": trace_summary(build_trace(spec)),
            "rates": args.rates[name],
            "curves": curves,
            "analysis": analysis,
            "paired": paired,
            "output_check": res.get("check", {}),
            "num_mismatched_outputs": sum(
                res.get("check", {}).get(k, 0) for k in ("mismatched", "missing")
            ),
            "greedy_output_agreement": res.get("agreement", {}),
            "points": res.get("points", []),
        }
        traces[name] = entry
    return {
        "command": "python " + " ".join([sys.argv[0], *sys.argv[1:]]),
        "source": _source(),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "loadavg_1min_at_start": round(os.getloadavg()[0], 2),
            "loadavg_1min_at_end": round(os.getloadavg()[0], 2),
        },
        "model": {
            "preset": None if args.model else args.model_preset,
            "path": args.model,
            "dtype": args.dtype,
            "num_parameters": llama_num_parameters(model_config),
        },
        "settings": vars(args),
        "plan": plan,
        "workers": workers_ready,
        "paper_ratios": PAPER_RATIOS,
        "traces": traces,
        "num_mismatched_outputs": sum(t["num_mismatched_outputs"] for t in traces.values()),
    }


def ratio_text(report: dict[str, Any]) -> str:
    lines = []
    for name, t in report["traces"].items():
        a = t["analysis"]
        if not a:
            continue
        main = a["main"]
        lines.append(f"{name}: bound {main['bound_s_per_token'] * 1e3:.1f} ms/token")
        for system, s in main["sustained"].items():
            more = "+" if s["lower_bound_only"] else ""
            lines.append(f"  {system}: sustained {s['rate']:.2f}{more} req/s")
        for other, r in main["paged_over"].items():
            value = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
            paper = PAPER_RATIOS.get(other, "-") if name == "sharegpt" else "see the doc"
            flag = " (grid-censored)" if r["censored"] else ""
            lines.append(f"  paged / {other}: {value}{flag}  (paper {paper})")
        paired = t.get("paired", {}).get(f"{main['factor']:g}x", {})
        for other, e in paired.items():
            vs = e.get("vs_reference")
            if not vs:
                continue
            per = ", ".join(
                "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}{'+' if r['censored'] else ''}"
                for r in vs["sustained_ratio_per_repeat"]
            )
            iv = vs["sustained_ratio"]
            shown = "no uncensored repeat" if iv is None else _interval_text(iv)
            lines.append(f"  paged / {other} per repeat: {per}; {shown}")
            for rate, lat in vs["latency_ratio_by_rate"].items():
                lines.append(
                    f"    latency {other} / paged at {float(rate):g} req/s: {_interval_text(lat)}"
                )
        for system, e in paired.items():
            batch = ", ".join(f"{float(r):g}: {v:.1f}" for r, v in e["mean_running_median"].items())
            lines.append(f"  {system} time-averaged batch by rate: {batch}")
    return "\n".join(lines)


def _interval_text(iv: dict[str, Any]) -> str:
    if iv["low"] is None:
        return f"{iv['geomean']:.2f}x (n = 1)"
    return f"{iv['geomean']:.2f}x [{iv['low']:.2f}, {iv['high']:.2f}] 95% (n = {iv['n']})"


DISPLAY = {"sharegpt": "ShareGPT", "alpaca": "Alpaca"}


def replot(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Draws a report's figures into --figures: serving_<trace>.png per plain trace and
    serving_parallel.png for the fanout sweeps (from the JSON alone)."""
    fig_dir = pathlib.Path(args.figures or "docs/figures")
    fig_dir.mkdir(parents=True, exist_ok=True)
    budget = report["plan"]["kv_budget_tokens"]
    scale = report["settings"]["scale"]
    for name, t in report["traces"].items():
        if not t["analysis"]:
            continue
        s = t["summary"]
        what = "User trace" if name == "user" else f"{DISPLAY.get(name, name)}-like trace"
        title = (
            f"{what} x{scale:g}: prompt mean {s['input_mean']:.0f}, output "
            f"mean {s['output_mean']:.0f} tokens; KV {budget} slots"
        )
        path = fig_dir / f"serving_{name}.png"
        plot_latency_curves(t["curves"], t["analysis"], path, title=title)
        print(f"drew {path}")
    for trace, kinds in report.get("fanout", {}).items():
        what = "User trace" if trace == "user" else f"{DISPLAY.get(trace, trace)}-like trace"
        path = fig_dir / (
            "serving_parallel.png" if trace == "alpaca" else f"serving_{trace}_parallel.png"
        )
        block = report["plan"]["paged"]["block_size"]
        title = f"{what} x{scale:g}, KV {budget} slots, blocks of {block}, 1 repeat a point"
        if report["settings"]["repeats"] != 1:
            title = title.replace("1 repeat a point", f"median of {report['settings']['repeats']}")
        plot_fanout_curves(kinds, path, title=title)
        print(f"drew {path}")


def fanout_report(
    args: argparse.Namespace, results: dict[str, dict[str, dict[int, dict[str, Any]]]]
) -> dict[str, Any]:
    """Per trace, kind and n: curves, analysis, output check and the block tally."""
    report: dict[str, Any] = {}
    for trace, kinds in results.items():
        for kind, ns in kinds.items():
            for n, res in ns.items():
                curves = system_curves(res["points"])
                blocks = {}
                for system in curves:
                    mine = [p for p in res["points"] if p["system"] == system]
                    blocks[system] = {
                        "peak_physical_blocks": max(p.get("peak_physical_blocks", 0) for p in mine),
                        "peak_logical_blocks": max(p.get("peak_logical_blocks", 0) for p in mine),
                        "blocks_saved_by_sharing": [
                            round(p.get("blocks_saved_by_sharing", 0.0), 4) for p in mine
                        ],
                        "max_running_sequences": max(p["max_running"] for p in mine),
                        "num_preemptions": sum(p.get("num_preemptions", 0) for p in mine),
                        "num_compiles_after_warmup": sum(
                            p.get("num_compiles_after_warmup") or 0 for p in mine
                        ),
                    }
                report.setdefault(trace, {}).setdefault(kind, {})[str(n)] = {
                    "rates": fanout_rates(args.rates[trace], kind, n),
                    "curves": curves,
                    "analysis": analyze_curves(curves, args.latency_factor) if curves else None,
                    "blocks": blocks,
                    "output_check": res["check"],
                    "output_agreement": res["agreement"],
                    "num_mismatched_outputs": res["check"].get("mismatched", 0)
                    + res["check"].get("missing", 0),
                    "points": res["points"],
                }
    return report


def fanout_text(report: dict[str, Any]) -> str:
    lines = []
    for trace, kinds in report.get("fanout", {}).items():
        for kind, ns in kinds.items():
            for n, e in ns.items():
                a = e["analysis"]
                if not a:
                    continue
                rates = a["main"]["sustained"]
                text = ", ".join(
                    f"{k} {v['rate']:.2f}{'+' if v['lower_bound_only'] else ''}"
                    for k, v in rates.items()
                )
                ratio = a["main"]["paged_over"].get("orca-oracle", {}).get("ratio")
                shown = "n/a" if ratio is None else f"{ratio:.2f}x"
                lines.append(f"{trace} {kind} n={n}: {text} req/s; paged / Oracle {shown}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.replot:
        replot(args, json.loads(pathlib.Path(args.replot).read_text()))
        return 0
    if args.model:
        model_config = json.loads((pathlib.Path(args.model) / "config.json").read_text())
    else:
        model_config = dict(MODEL_PRESETS[args.model_preset])
    plan = make_plan(args, model_config)
    print(plan_text(args, plan), flush=True)
    if args.dry_run:
        return 0
    results: dict[str, dict[str, Any]] = {}
    fanout_results: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}
    ready: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_serving_") as tmp:
        model_dir = build_model(args, pathlib.Path(tmp))
        base = {
            "model_dir": str(model_dir),
            "dtype": args.dtype,
            "compile_cache_dir": args.compile_cache_dir or str(pathlib.Path(tmp) / "jax_cache"),
            "traces": plan["traces"],
            "paged": plan["paged"],
            "orca": plan["orca"],
            "contiguous": plan["contiguous"],
        }
        workers: dict[str, Worker] = {}
        try:
            for s in args.systems:  # built one at a time: warm-up is the heavy part
                workers[NAMES[s]] = Worker({**base, "system": s}, NAMES[s])
                ready[NAMES[s]] = workers[NAMES[s]].ready
                print(f"{NAMES[s]} ready (warm-up {ready[NAMES[s]]['warmup_s']:.1f} s)", flush=True)
            for trace in plan["traces"]:
                num_trace = len(build_trace(plan["traces"][trace]))
                if "plain" in args.workload:
                    points, check, agreement = sweep(args, workers, trace, num_trace)
                    results[trace] = {"points": points, "check": check, "agreement": agreement}
                for kind in args.workload:
                    if kind == "plain":
                        continue
                    for n in args.fanouts:
                        points, check, agreement = sweep(args, workers, trace, num_trace, kind, n)
                        fanout_results.setdefault(trace, {}).setdefault(kind, {})[n] = {
                            "points": points,
                            "check": check,
                            "agreement": agreement,
                        }
        finally:
            for w in workers.values():
                w.close()
    report = build_report(args, plan, results, ready, model_config)
    if "plain" not in args.workload:
        report["traces"] = {}
    report["fanout"] = fanout_report(args, fanout_results)
    report["num_mismatched_outputs"] += sum(
        e["num_mismatched_outputs"] for kinds in report["fanout"].values()
        for ns in kinds.values() for e in ns.values()
    )  # fmt: skip
    report["total_wall_s"] = time.perf_counter() - t0
    out = write_json_atomic(args.output, report)
    if args.figures:
        replot(args, report)
    print(ratio_text(report))
    print(fanout_text(report))
    print(f"wrote {out} (total {report['total_wall_s']:.0f} s)")
    if report["num_mismatched_outputs"]:
        n = report["num_mismatched_outputs"]
        print(f"FAILED: {n} greedy outputs differ from paged-jax's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
