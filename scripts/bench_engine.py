"""Engine benchmark: paged-jax vs contiguous-KV baselines vs HF generate, every system swept.

    python scripts/bench_engine.py                          # tiny Llama, both comparisons
    python scripts/bench_engine.py --model-preset 80m       # the 80M-parameter Llama
    python scripts/bench_engine.py --comparisons same-budget --systems paged,contiguous-max
    python scripts/bench_engine.py --dry-run                # print the plan, run nothing
    python scripts/bench_engine.py --device-run --time-limit 60 --output bench_engine.json
    python scripts/bench_engine.py --device-run --rehearse  # the same on CPU, cut shape

One trace, two comparisons, timed in the same interleaved rounds:

- best vs best: each system's own knobs are swept first, one run per setting (paged:
  max_num_seqs x max_num_batched_tokens; contiguous: its rows; HF: batch size x torch
  threads: each thread count at the middle batch size, then each batch size at the best
  thread count), at one generous KV budget; each system's best setting is then timed.
- same budget (the paper's question): one KV budget in bytes and one max_num_seqs for
  the paged engine and the contiguous baselines; HF (no budget) at its best setting.

Every system runs in its own worker process (JAX and torch never share one), built and
compiled once per setting. The timed runs are --repeats rounds, each running every timed
worker once, the start rotated round by round, so machine noise hits them alike; ratios
are taken within a round. Greedy outputs of every run (sweeps included) must equal the
paged engine's: any mismatch exits non-zero after writing the JSON. See
docs/engine_benchmark.md.

--device-run is the GPU device run's engine cell instead (paged_jax.baselines.engine_cell):
one in-process engine on a Llama-3-8B-shaped bf16 model with random weights drawn on the
device, a point per batch size, the JSON rewritten after every point with a top-level
"metrics" dict (points, tok_s, compiles_after_warmup); --rehearse runs the same on CPU at a
cut shape. It exits non-zero when no point ran, a point lost tokens or a step compiled
after warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from paged_jax.baselines.hf_generate import MODEL_PRESETS, llama_num_parameters
from paged_jax.baselines.json_report import write_json_atomic
from paged_jax.baselines.worker_process import WorkerError, WorkerProcess
from paged_jax.baselines.workload import WorkloadConfig, make_trace, trace_summary
from paged_jax.config import EngineConfig

ENGINE_SYSTEMS = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle", "hf")
SYSTEM_LABELS = {
    "paged": "paged-jax",
    "contiguous-max": "contiguous-max",
    "contiguous-pow2": "contiguous-pow2",
    "contiguous-oracle": "contiguous-oracle",
    "hf": "hf-static",
}
COMPARISONS = ("best", "same-budget")
TARGET_VS_HF = 3.0  # best vs best, paged / HF generate


def _int_list(p: argparse.ArgumentParser, flag: str, text: str, low: int = 1) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        values = []
    if not values or values[0] < low:
        p.error(f"{flag}={text!r} must be a comma list of ints >= {low}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    m = p.add_mutually_exclusive_group()
    m.add_argument("--model", default=None, help="HF checkpoint dir (default: a random Llama)")
    m.add_argument(
        "--model-preset",
        default="tiny",
        choices=sorted(MODEL_PRESETS),
        help="random-weight Llama built into a temp dir: tiny (2.9M parameters) or 80m",
    )
    p.add_argument(
        "--systems",
        default=",".join(ENGINE_SYSTEMS),
        help="comma list of " + ",".join(ENGINE_SYSTEMS),
    )
    p.add_argument(
        "--comparisons",
        default=",".join(COMPARISONS),
        help="best (every system at its best swept setting) and/or same-budget",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (>= 1)")
    p.add_argument("--output", default="bench_results/bench_engine.json")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--dry-run", action="store_true", help="print the plan; build and run nothing")
    p.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="do not share a JAX compilation cache (a temp dir) between the JAX workers",
    )
    s = p.add_argument_group("sweeps (best vs best; one run per setting)")
    s.add_argument("--sweep-max-num-seqs", default="32,64,128,256")
    s.add_argument("--sweep-max-num-batched-tokens", default="512,1024,2048,4096")
    s.add_argument("--hf-batch-sizes", default="8,16,32,64,128")
    s.add_argument(
        "--hf-threads",
        default=None,
        help="torch intra-op thread counts swept with the batch size (default: all cores)",
    )
    s.add_argument(
        "--best-kv-budget-bytes",
        type=int,
        default=None,
        help="KV budget of the swept paged and contiguous systems (default: the largest "
        "useful swept max_num_seqs x max_model_len tokens, so no setting is KV-bound)",
    )
    w = p.add_argument_group("workload (log-normal prompt lengths, fixed output length)")
    w.add_argument("--num-requests", type=int, default=128)
    w.add_argument("--input-median", type=float, default=128.0)
    w.add_argument("--input-sigma", type=float, default=0.8)
    w.add_argument("--input-max", type=int, default=384)
    w.add_argument("--output-median", type=float, default=128.0)
    w.add_argument("--output-sigma", type=float, default=0.0)
    w.add_argument("--output-max", type=int, default=128)
    w.add_argument("--seed", type=int, default=0)
    e = p.add_argument_group("same-budget comparison and engine options")
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
        help="N or a comma list: also serve the trace with the same-budget paged engine "
        "split over N devices (forced CPU devices on a CPU host: memory and agreement, "
        "not speed)",
    )
    d = p.add_argument_group(
        "device run (one in-process engine; the comparison options above are ignored)"
    )
    d.add_argument(
        "--device-run",
        action="store_true",
        help="the device run's engine cell: a Llama-3-8B-shaped bf16 model, random weights "
        "drawn on the device, a point per batch size, the JSON rewritten after each",
    )
    d.add_argument(
        "--rehearse", action="store_true", help="with --device-run: CPU-sized shape (2 layers)"
    )
    d.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="with --device-run: seconds from the start after which no point starts (a "
        "point starts only if the time used plus the last point's duration fits)",
    )
    d.add_argument("--batches", default=None, help="requests per point, run in this order")
    d.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt")
    d.add_argument("--output-len", type=int, default=None, help="tokens generated per request")
    args = p.parse_args(argv)
    if not args.device_run:
        for flag in ("rehearse", "time_limit", "batches", "prompt_len", "output_len"):
            if getattr(args, flag) not in (None, False):
                p.error(f"--{flag.replace('_', '-')} needs --device-run")
    if args.time_limit is not None and not args.time_limit > 0:
        p.error(f"--time-limit={args.time_limit} must be > 0 seconds")
    if args.batches is not None:
        try:
            batches = tuple(int(b) for b in args.batches.split(",") if b.strip())
        except ValueError:
            batches = ()
        if not batches or min(batches) < 1:
            p.error(f"--batches={args.batches!r} must be a comma list of ints >= 1")
        args.batches = batches
    sizes = _int_list(p, "--tensor-parallel-size", args.tensor_parallel_size)
    args.tensor_parallel_sizes = [n for n in sizes if n > 1]
    args.systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    bad = [s for s in args.systems if s not in ENGINE_SYSTEMS]
    if bad or "paged" not in args.systems:
        p.error(
            f"--systems={','.join(args.systems)!r} must list paged plus any of {ENGINE_SYSTEMS}"
        )
    args.comparisons = tuple(c.strip() for c in args.comparisons.split(",") if c.strip())
    if not args.comparisons or any(c not in COMPARISONS for c in args.comparisons):
        p.error(f"--comparisons={','.join(args.comparisons)!r} must list some of {COMPARISONS}")
    if args.tensor_parallel_sizes and "same-budget" not in args.comparisons:
        p.error("--tensor-parallel-size > 1 needs --comparisons to include same-budget")
    if args.repeats < 1:
        p.error(f"--repeats={args.repeats} must be >= 1")
    args.hf_batch_sizes = _int_list(p, "--hf-batch-sizes", args.hf_batch_sizes)
    threads = args.hf_threads or str(os.cpu_count() or 1)
    args.hf_threads = _int_list(p, "--hf-threads", threads)
    args.sweep_max_num_seqs = _int_list(p, "--sweep-max-num-seqs", args.sweep_max_num_seqs)
    args.sweep_max_num_batched_tokens = _int_list(
        p, "--sweep-max-num-batched-tokens", args.sweep_max_num_batched_tokens
    )
    return args


# ---------------------------------------------------------------------------- the plan


def useful_values(values: list[int], limit: int) -> tuple[list[int], dict[int, int]]:
    """The values worth trying when anything >= limit behaves as limit does.

    Returns the kept values (all below limit, plus the smallest one >= limit) and, for
    each dropped value, the kept value it would repeat.
    """
    kept: list[int] = []
    same_as: dict[int, int] = {}
    for v in sorted(values):
        if kept and kept[-1] >= limit:
            same_as[v] = kept[-1]
        else:
            kept.append(v)
    return kept, same_as


@dataclasses.dataclass
class Plan:
    """Everything decided before a worker starts: trace, budgets, the settings to run."""

    workload: WorkloadConfig
    model_config: dict[str, Any]
    per_token: int  # KV bytes per token (all layers, K and V, model dtype)
    same_budget: int  # bytes
    best_budget: int  # bytes
    paged_grid: list[dict[str, int]]  # best-vs-best paged settings
    rows_grid: list[int]  # best-vs-best contiguous rows (max_num_seqs)
    pruned: list[dict[str, Any]]  # settings left out of the grids, each with why

    def budget_summary(self, budget: int, max_model_len: int) -> dict[str, int]:
        return {
            "bytes": budget,
            "bytes_per_token": self.per_token,
            "token_slots": budget // self.per_token,
            "max_model_len": max_model_len,
        }


def make_plan(args: argparse.Namespace, model_config: dict[str, Any]) -> Plan:
    """The trace, the two KV budgets and every swept setting (pruned to useful ones)."""
    workload = WorkloadConfig(
        num_requests=args.num_requests,
        input_median=args.input_median,
        input_sigma=args.input_sigma,
        input_max=args.input_max,
        output_median=args.output_median,
        output_sigma=args.output_sigma,
        output_min=min(4, args.output_max),
        output_max=args.output_max,
        vocab_size=int(model_config["vocab_size"]),
        seed=args.seed,
    )
    if workload.max_total_len > args.max_model_len:
        raise SystemExit(
            f"--input-max + --output-max = {workload.max_total_len} must be <= "
            f"--max-model-len={args.max_model_len}"
        )
    summary = trace_summary(make_trace(workload))
    cfg = model_config
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    itemsize = 4 if args.dtype == "float32" else 2
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * itemsize
    same_budget = args.kv_budget_bytes or (
        args.budget_full_requests * args.max_model_len * per_token
    )
    pruned: list[dict[str, Any]] = []
    # More sequences than requests, or a step budget above every prompt token of the
    # trace, schedules exactly as the smallest grid value past that limit does.
    seqs, seqs_same = useful_values(args.sweep_max_num_seqs, summary["num_requests"])
    tokens, tokens_same = useful_values(
        args.sweep_max_num_batched_tokens, summary["total_prompt_tokens"]
    )
    for s, like in seqs_same.items():
        pruned.append(
            {"max_num_seqs": s, "why": f"> {summary['num_requests']} requests: as {like}"}
        )
    for t, like in tokens_same.items():
        why = f"> {summary['total_prompt_tokens']} prompt tokens in all: as {like}"
        pruned.append({"max_num_batched_tokens": t, "why": why})
    best_budget = args.best_kv_budget_bytes or max(seqs) * args.max_model_len * per_token
    block_bytes = per_token * args.block_size
    paged_grid = []
    for s in seqs:
        for t in tokens:
            try:  # the engine's own rule for a valid pair (config.py imports no jax)
                EngineConfig(
                    block_size=args.block_size,
                    num_kv_blocks=best_budget // block_bytes,
                    max_model_len=args.max_model_len,
                    max_num_seqs=s,
                    max_num_batched_tokens=t,
                )
            except ValueError as err:
                pruned.append({"max_num_seqs": s, "max_num_batched_tokens": t, "why": str(err)})
                continue
            paged_grid.append({"max_num_seqs": s, "max_num_batched_tokens": t})
    rows_grid = list(seqs)
    return Plan(
        workload=workload,
        model_config=model_config,
        per_token=per_token,
        same_budget=same_budget,
        best_budget=best_budget,
        paged_grid=paged_grid,
        rows_grid=rows_grid,
        pruned=pruned,
    )


def paged_spec(args: argparse.Namespace, budget: int, **knobs: int) -> dict[str, Any]:
    """PagedSystem's keywords for one setting."""
    return {
        "budget_bytes": budget,
        "kv_cache_dtype": args.kv_cache_dtype,
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": not args.no_prefix_caching,
        "async_scheduling": not args.no_async_scheduling,
        **knobs,
    }


def contiguous_spec(args: argparse.Namespace, budget: int, rows: int) -> dict[str, Any]:
    """ContiguousSystem's keywords ("max" takes its rows from the budget, not max_num_seqs)."""
    return {"budget_bytes": budget, "max_model_len": args.max_model_len, "max_num_seqs": rows}


def contiguous_sweep_specs(args: argparse.Namespace, plan: Plan, system: str) -> list:
    """(setting, spec) per swept row count: "max" gets rows x max_model_len of budget."""
    settings = []
    for rows in plan.rows_grid:
        budget = plan.best_budget
        if system == "contiguous-max":
            budget = rows * args.max_model_len * plan.per_token
            if budget > plan.best_budget:
                continue
        spec = {"system": system, "contiguous": contiguous_spec(args, budget, rows)}
        settings.append(({"max_num_seqs": rows}, spec))
    return settings


def pool_blocks(args: argparse.Namespace, plan: Plan, budget: int) -> int:
    """Blocks of the budget in the paged KV dtype (fp8 holds twice or four times as many)."""
    itemsize = 4 if args.dtype == "float32" else 2
    kv_itemsize = 1 if args.kv_cache_dtype.startswith("fp8") else itemsize
    return budget // (plan.per_token // itemsize * kv_itemsize * args.block_size)


# ------------------------------------------------------------------------------ workers


class Worker(WorkerProcess):
    """A system's worker process: started, warmed up, then one timed run per request."""

    module = "paged_jax.baselines.bench_worker"

    def run(self, **cmd: Any) -> dict:
        """One run; the record gets the 1-minute load average at its start."""
        return self.request("run", **cmd)


def _tps(result: dict) -> float:
    return result["summary"]["tokens_per_s"]


def _setting_text(setting: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in setting.items())


@dataclasses.dataclass
class Sweep:
    """One system's sweep: a record per setting, and the best setting's live worker."""

    name: str
    records: list[dict] = dataclasses.field(default_factory=list)
    best: dict | None = None  # the best record
    worker: Worker | None = None  # the best setting's worker, kept for the timed rounds
    run_kwargs: dict = dataclasses.field(default_factory=dict)


def sweep_workers(name: str, base: dict, settings: list[tuple[dict, dict]]) -> Sweep:
    """One worker per setting, one run each; keeps the best one's worker alive.

    settings: (the setting as reported, the spec keys it sets) pairs.
    """
    sweep = Sweep(name)
    for setting, spec in settings:
        label = f"{name} ({_setting_text(setting)})"
        try:
            worker = Worker({**base, **spec}, label)
            result = worker.run()
        except WorkerError as err:
            sweep.records.append({"setting": setting, "error": str(err)})
            print(f"  {label}: FAILED {err}", flush=True)
            continue
        record = {"setting": setting, "warmup_s": worker.ready.get("warmup_s"), "run": result}
        sweep.records.append(record)
        print(f"  {label}: {_tps(result):.1f} tok/s", flush=True)
        if sweep.best is None or _tps(result) > _tps(sweep.best["run"]):
            if sweep.worker is not None:
                sweep.worker.close()
            sweep.best, sweep.worker = record, worker
        else:
            worker.close()
    return sweep


def sweep_hf(worker: Worker, batch_sizes: list[int], threads: list[int]) -> Sweep:
    """HF's settings are run arguments: one worker, one run per setting, swept as a user
    would: every thread count at the middle batch size, then every other batch size at
    the best thread count (a thread count that collapses on a loaded machine costs one
    run, not one per batch size)."""
    sweep = Sweep(SYSTEM_LABELS["hf"], worker=worker)

    def try_setting(batch_size: int, num_threads: int) -> None:
        setting = {"batch_size": batch_size, "threads": num_threads}
        result = worker.run(**setting)
        sweep.records.append({"setting": setting, "warmup_s": 0.0, "run": result})
        print(f"  hf-static ({_setting_text(setting)}): {_tps(result):.1f} tok/s", flush=True)
        if sweep.best is None or _tps(result) > _tps(sweep.best["run"]):
            sweep.best = sweep.records[-1]

    middle = batch_sizes[len(batch_sizes) // 2]
    for n in threads:
        try_setting(middle, n)
    best_threads = sweep.best["setting"]["threads"]
    for b in batch_sizes:
        if b != middle:
            try_setting(b, best_threads)
    sweep.run_kwargs = dict(sweep.best["setting"])
    return sweep


def run(args: argparse.Namespace, model_dir: pathlib.Path, plan: Plan, cache_dir) -> dict:
    """Sweeps every system, starts the same-budget workers, runs the timed rounds."""
    base = {
        "model_dir": str(model_dir),
        "dtype": args.dtype,
        "threads": args.hf_threads[-1],
        "workload": dict(vars(plan.workload)),
        "compile_cache_dir": None if cache_dir is None else str(cache_dir),
    }
    best = "best" in args.comparisons
    same = "same-budget" in args.comparisons
    sweeps: dict[str, Sweep] = {}
    same_workers: dict[str, Worker] = {}
    # timed entries: (table, name) -> (worker, run kwargs); HF's serves both tables.
    entries: dict[tuple[str, str], tuple[Worker, dict]] = {}
    try:
        if "hf" in args.systems:
            print("starting hf-static worker, sweeping batch size x threads ...", flush=True)
            worker = Worker({**base, "system": "hf"}, "hf-static")
            hf = sweep_hf(worker, args.hf_batch_sizes, args.hf_threads)
            sweeps["hf-static"] = hf
        if best:
            print(f"best vs best: KV budget {plan.best_budget} bytes", flush=True)
            settings = [
                (s, {"system": "paged", "paged": paged_spec(args, plan.best_budget, **s)})
                for s in plan.paged_grid
            ]
            sweeps["paged-jax"] = sweep_workers("paged-jax", base, settings)
            for system in args.systems:
                if system.startswith("contiguous-"):
                    settings = contiguous_sweep_specs(args, plan, system)
                    sweeps[SYSTEM_LABELS[system]] = sweep_workers(
                        SYSTEM_LABELS[system], base, settings
                    )
            for name, sw in sweeps.items():
                if sw.worker is not None and sw.best is not None:
                    entries["best", name] = (sw.worker, sw.run_kwargs)
        if same:
            print(f"same budget: KV budget {plan.same_budget} bytes", flush=True)
            knobs = {
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
            }
            # One pool size for every same-budget paged worker (tensor-parallel ones too).
            paged = {**paged_spec(args, plan.same_budget, **knobs)}
            paged["num_kv_blocks"] = pool_blocks(args, plan, plan.same_budget)
            for system in args.systems:
                if system == "hf":
                    continue
                print(f"starting {SYSTEM_LABELS[system]} worker ...", flush=True)
                if system == "paged":
                    spec = {"paged": paged}
                else:
                    spec = {
                        "contiguous": contiguous_spec(args, plan.same_budget, args.max_num_seqs)
                    }
                same_workers[SYSTEM_LABELS[system]] = Worker(
                    {**base, "system": system, **spec}, SYSTEM_LABELS[system]
                )
            for n in args.tensor_parallel_sizes:
                print(f"starting paged-jax worker, tensor_parallel_size={n} ...", flush=True)
                same_workers[f"paged-jax-tp{n}"] = Worker(
                    {**base, "system": "paged", "tensor_parallel_size": n, "paged": paged},
                    f"paged-jax-tp{n}",
                )
            for name, worker in same_workers.items():
                entries["same-budget", name] = (worker, {})
            if "hf-static" in sweeps:
                entries["same-budget", "hf-static"] = (sweeps["hf-static"].worker, {})
        runs = timed_rounds(args.repeats, entries, sweeps)
    finally:
        for sw in sweeps.values():
            if sw.worker is not None:
                sw.worker.close()
        for worker in same_workers.values():
            worker.close()
    warmups = {f"{t}/{n}": w.ready.get("warmup_s") for (t, n), (w, _) in entries.items()}
    return build_report(args, plan, runs, sweeps, warmups)


def timed_rounds(
    repeats: int, entries: dict[tuple[str, str], tuple[Worker, dict]], sweeps: dict[str, Sweep]
) -> dict[str, dict[str, list[dict]]]:
    """Runs every timed worker once per round, the start rotated; HF runs once per round.

    Returns table -> system name -> its runs (HF's list is shared by both tables).
    """
    order: list[tuple[Worker, dict, list[tuple[str, str]]]] = []
    for key, (worker, kwargs) in entries.items():
        if key[1] == "hf-static":  # one HF run per round serves both tables
            kwargs = sweeps["hf-static"].run_kwargs
        for w, _, keys in order:
            if w is worker:
                keys.append(key)
                break
        else:
            order.append((worker, kwargs, [key]))
    runs: dict[str, dict[str, list[dict]]] = {}
    for _worker, _, keys in order:
        shared: list[dict] = []
        for table, name in keys:
            runs.setdefault(table, {})[name] = shared
    for round_no in range(repeats):
        shift = round_no % max(1, len(order))
        for worker, kwargs, keys in order[shift:] + order[:shift]:
            result = worker.run(**kwargs)
            runs[keys[0][0]][keys[0][1]].append(result)
            where = ", ".join(f"{t}/{n}" for t, n in keys)
            print(f"round {round_no}: {where:<40} {_tps(result):9.1f} tok/s", flush=True)
    return runs


# ----------------------------------------------------------------------------- report


def _spread(values: list[float]) -> dict:
    med = statistics.median(values)
    return {
        "median": med,
        "min": min(values),
        "max": max(values),
        "spread_pct": 100 * (max(values) - min(values)) / med if med else 0.0,
        "runs": values,
    }


def _source() -> dict:
    """The code measured: the checkout's commit and whether tracked files differ from it
    (outside a git checkout, e.g. a `git archive` export, $BENCH_SOURCE_COMMIT)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        )
    except OSError:
        commit = None
    if commit is None or commit.returncode:
        return {"commit": os.environ.get("BENCH_SOURCE_COMMIT"), "export": True}
    return {"commit": commit.stdout.strip(), "uncommitted_changes": bool(dirty.stdout.strip())}


def _device_info() -> dict:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "loadavg_1min_at_start": round(os.getloadavg()[0], 2),
    }


def _results(table: dict[str, list[dict]]) -> dict:
    results = {}
    for name, rs in table.items():
        summaries = [r["summary"] for r in rs]
        median_run = sorted(summaries, key=lambda s: s["tokens_per_s"])[len(summaries) // 2]
        results[name] = {
            "tokens_per_s": _spread([s["tokens_per_s"] for s in summaries]),
            "median_run": median_run,
        }
    return results


def _ratios(table: dict[str, list[dict]]) -> dict:
    """paged-jax / each other system, round by round (the runs of one round pair up)."""
    ratios: dict[str, Any] = {}
    paged = table.get("paged-jax", [])
    for name, rs in table.items():
        if name.startswith("paged-jax") or not paged:
            continue
        per_round = [_tps(p) / _tps(r) for p, r in zip(paged, rs)]
        ratios[f"throughput_paged_vs_{name}"] = _spread(per_round)
        conc = [
            p["summary"]["max_concurrent_seqs"] / max(1, r["summary"]["max_concurrent_seqs"])
            for p, r in zip(paged, rs)
        ]
        ratios[f"concurrency_paged_vs_{name}"] = statistics.median(conc)
    return ratios


def check_agreement(
    runs: dict[str, dict[str, list[dict]]], sweeps: dict[str, Sweep], exact: bool
) -> tuple[dict, int]:
    """Every run's greedy outputs against a paged run's; returns (agreement, mismatches).

    A quantized (fp8) paged KV cache is not expected to match full-precision systems
    token for token (exact=False): their agreement is reported, only paged runs count.
    """
    paged = [r for t in runs.values() for r in t.get("paged-jax", [])]
    paged += [rec["run"] for rec in sweeps.get("paged-jax", Sweep("")).records if "run" in rec]
    if not paged:
        return {}, 0
    reference = paged[0]["outputs"]

    def equal(result: dict) -> int:
        return sum(result["outputs"].get(k) == v for k, v in reference.items())

    agreement, mismatches, seen = {}, 0, set()
    for table, systems in runs.items():
        for name, rs in systems.items():
            if id(rs) in seen:
                continue
            seen.add(id(rs))
            key = name if table == "same-budget" else f"{name} (best)"
            same = [equal(r) for r in rs]
            agreement[key] = {"requests": len(reference), "equal_per_run": same}
            if exact or name.startswith("paged-jax"):
                mismatches += sum(len(reference) - n for n in same)
    for name, sw in sweeps.items():
        for rec in sw.records:
            if "run" not in rec:
                continue
            same = equal(rec["run"])
            key = f"{name} (sweep, {_setting_text(rec['setting'])})"
            agreement[key] = {"requests": len(reference), "equal": same}
            if exact or name == "paged-jax":
                mismatches += len(reference) - same
    return agreement, mismatches


def build_report(
    args: argparse.Namespace,
    plan: Plan,
    runs: dict[str, dict[str, list[dict]]],
    sweeps: dict[str, Sweep],
    warmups: dict[str, float],
) -> dict:
    """The JSON report: settings, sweeps, both comparisons' results and ratios, agreement."""
    exact = args.kv_cache_dtype == "auto"
    agreement, mismatches = check_agreement(runs, sweeps, exact)
    failed = [
        {"system": n, **rec} for n, sw in sweeps.items() for rec in sw.records if "error" in rec
    ]
    same, best = runs.get("same-budget", {}), runs.get("best", {})
    hf = sweeps.get("hf-static")
    hf_best = hf.best["setting"] if hf is not None and hf.best is not None else None
    best_ratios = _ratios(best)
    targets = {}
    if "throughput_paged_vs_hf-static" in best_ratios:
        got = best_ratios["throughput_paged_vs_hf-static"]["median"]
        targets["throughput_vs_hf_best_vs_best"] = {
            "target": TARGET_VS_HF,
            "measured": got,
            "met": got >= TARGET_VS_HF,
        }
    keys = ("weight_bytes_per_device", "kv_cache_bytes_per_device", "num_compiles_after_warmup")
    tensor_parallel = {
        str(rs[0]["summary"].get("tensor_parallel_size", 1)): {
            **{k: rs[0]["summary"].get(k) for k in keys},
            "greedy_outputs_equal_to_tp1": agreement[name]["equal_per_run"],
        }
        for name, rs in same.items()
        if name.startswith("paged-jax") and rs
    }
    workload = plan.workload
    return {
        "command": " ".join(["python", "scripts/bench_engine.py", *(sys.argv[1:])]),
        "machine": _device_info(),
        "source": _source(),
        "model": {
            "checkpoint": args.model or f"random Llama, preset {args.model_preset}",
            "config": plan.model_config,
            "num_parameters": llama_num_parameters(plan.model_config)
            if args.model is None
            else None,
            "dtype": args.dtype,
        },
        "settings": {
            "jax_threads": "XLA CPU default (all cores)",
            "hf_batch_sizes_swept": args.hf_batch_sizes,
            "hf_threads_swept": args.hf_threads,
            "hf_best_batch_size": None if hf_best is None else hf_best["batch_size"],
            "hf_best_threads": None if hf_best is None else hf_best["threads"],
            "hf_batches": "length-sorted (prompt, then output)",
            "repeats": args.repeats,
            "comparisons": list(args.comparisons),
            "processes": "one worker process per system and setting; rounds interleave "
            "the timed workers, the start rotated each round",
            "compile_cache": "one JAX compilation cache shared by the JAX workers "
            "(warm-ups after the first reuse its executables; no timed run includes one)"
            if not args.no_compile_cache
            else "off",
            "warmup_s": warmups,
        },
        "workload": {**vars(workload), "summary": trace_summary(make_trace(workload))},
        # The same-budget comparison (the paper's question) keeps the top-level keys.
        "kv_budget": plan.budget_summary(plan.same_budget, args.max_model_len),
        "engine": paged_spec(
            args,
            plan.same_budget,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        ),
        "hf_sweep": {
            str(rec["setting"]["batch_size"]): rec["run"]["summary"]
            for rec in (hf.records if hf is not None else [])
            if rec["setting"]["threads"] == (hf_best or {}).get("threads")
        },
        "results": _results(same),
        "ratios": _ratios(same),
        "table": format_table(_results(same)),
        "best_vs_best": {
            "kv_budget": plan.budget_summary(plan.best_budget, args.max_model_len),
            "sweeps": {
                name: [
                    {
                        "setting": rec["setting"],
                        **(
                            {"error": rec["error"]}
                            if "error" in rec
                            else {
                                "tokens_per_s": _tps(rec["run"]),
                                "warmup_s": rec["warmup_s"],
                                "summary": rec["run"]["summary"],
                            }
                        ),
                    }
                    for rec in sw.records
                ]
                for name, sw in sweeps.items()
            },
            "pruned": plan.pruned,
            "best_settings": {
                name: sw.best["setting"] for name, sw in sweeps.items() if sw.best is not None
            },
            "results": _results(best),
            "ratios": best_ratios,
            "table": format_table(_results(best)),
        },
        "targets": targets,
        "greedy_output_agreement": agreement,
        "tensor_parallel": tensor_parallel if len(tensor_parallel) > 1 else None,
        "failed_settings": failed,
        "num_mismatched_outputs": mismatches,
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


def plan_text(args: argparse.Namespace, plan: Plan) -> str:
    """What a run would do (the --dry-run output)."""
    lines = [f"trace: {trace_summary(make_trace(plan.workload))}"]
    if "best" in args.comparisons:
        lines.append(f"best vs best: KV budget {plan.best_budget} bytes")
        grid = ", ".join(
            f"{s['max_num_seqs']}/{s['max_num_batched_tokens']}" for s in plan.paged_grid
        )
        lines.append(f"  paged-jax max_num_seqs/max_num_batched_tokens: {grid}")
        contiguous = [s for s in args.systems if s.startswith("contiguous-")]
        if contiguous:
            lines.append(f"  {', '.join(contiguous)} rows: {plan.rows_grid}")
        for p in plan.pruned:
            lines.append(f"  pruned: {p}")
    if "hf" in args.systems:
        middle = args.hf_batch_sizes[len(args.hf_batch_sizes) // 2]
        lines.append(
            f"  hf-static: threads {args.hf_threads} at batch size {middle}, then batch "
            f"sizes {args.hf_batch_sizes} at the best thread count"
        )
    if "same-budget" in args.comparisons:
        lines.append(
            f"same budget: KV budget {plan.same_budget} bytes, max_num_seqs "
            f"{args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}"
        )
    lines.append(f"timed rounds: {args.repeats}")
    return "\n".join(lines)


def build_model(args: argparse.Namespace, tmp: pathlib.Path) -> pathlib.Path:
    """--model, or the preset's random Llama built in a child process (this one never
    imports torch or jax)."""
    if args.model:
        return pathlib.Path(args.model)
    model_dir = tmp / "llama"
    code = (
        "import sys; from paged_jax.baselines.hf_generate import build_random_llama; "
        "build_random_llama(sys.argv[1], seed=int(sys.argv[2]), preset=sys.argv[3])"
    )
    argv = [sys.executable, "-c", code, str(model_dir), str(args.seed), args.model_preset]
    subprocess.run(argv, check=True)
    return model_dir


def device_run(args: argparse.Namespace, argv: list[str], start: float) -> int:
    """The device run's engine cell (paged_jax.baselines.engine_cell); 0 when it is ok."""
    from paged_jax.baselines import engine_cell

    plan = engine_cell.REHEARSAL_PLAN if args.rehearse else engine_cell.DEVICE_PLAN
    overrides = {"batches": args.batches, "prompt_len": args.prompt_len}
    overrides["output_len"] = args.output_len
    try:
        plan = dataclasses.replace(plan, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as err:
        print(f"bench_engine.py: error: {err}", file=sys.stderr)
        return 2
    header = {
        "command": " ".join(["python", "scripts/bench_engine.py", *argv]),
        "mode": "rehearsal (CPU, cut shape)" if args.rehearse else "device run",
        "machine": _device_info(),
        "source": _source(),
    }
    report = engine_cell.run_cell(
        plan, args.output, time_limit=args.time_limit, header=header, start=start
    )
    print(json.dumps(report["metrics"]))
    print(f"wrote {args.output} ({report['elapsed_s']:.0f} s)")
    problems = engine_cell.cell_ok(report)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    """Builds (or loads) the model, sweeps and times every system, writes the JSON."""
    t0 = time.perf_counter()
    args = parse_args(argv)
    if args.device_run:
        return device_run(args, sys.argv[1:] if argv is None else argv, t0)
    if args.model:
        model_config = json.loads((pathlib.Path(args.model) / "config.json").read_text())
    else:
        model_config = dict(MODEL_PRESETS[args.model_preset])
    plan = make_plan(args, model_config)
    print(plan_text(args, plan), flush=True)
    if args.dry_run:
        return 0
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        model_dir = build_model(args, pathlib.Path(tmp))
        cache_dir = None if args.no_compile_cache else pathlib.Path(tmp) / "jax_compile_cache"
        report = run(args, model_dir, plan, cache_dir)
    report["total_wall_s"] = time.perf_counter() - t0
    print()
    print(f"same budget:\n{report['table']}\n")
    print(f"best vs best:\n{report['best_vs_best']['table']}\n")
    print(json.dumps(report["best_vs_best"]["best_settings"], indent=2))
    summary = {"same_budget": report["ratios"], "best_vs_best": report["best_vs_best"]["ratios"]}
    print(json.dumps({**summary, "targets": report["targets"]}, indent=2))
    out = write_json_atomic(args.output, report)
    print(f"wrote {out} (total {report['total_wall_s']:.0f} s)")
    status = 0
    if report["num_mismatched_outputs"]:
        n = report["num_mismatched_outputs"]
        print(f"FAILED: {n} greedy outputs differ from paged-jax's", file=sys.stderr)
        status = 1
    if report["failed_settings"]:
        n = len(report["failed_settings"])
        print(f"FAILED: {n} swept settings' workers exited", file=sys.stderr)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
