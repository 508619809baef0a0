"""Data-parallel offline generation on Ray Data: N engine replicas behind map_batches.

    generate_dataset(ds, "model_dir", SamplingParams(...), data_parallel_size=2)
    paged-jax-generate --model DIR --prompts p.jsonl --output o.jsonl --data-parallel-size 2

Each replica is a Ray actor of an actor pool (entrypoints/replica.py) holding one LLM,
built once, with its own devices (tensor_parallel_size of them). Ray Data streams the
request rows to the pool in batches and the records back; the CLI writes each record as
its batch arrives. A replica that dies is restarted by Ray (its LLM built again, warm
from the compile cache) and its unfinished batch retried, so no request is lost; a
batch's records come back together or not at all, and the CLI's writer drops a record
whose index it already wrote, so none is written twice. A request's hidden states come
back beside its record as .npz bytes, and the CLI writes the single-process run's .npy
files from them. ray is imported only when a job runs (the optional extra `paged-jax[ray]`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from paged_jax.constants import WARMUP_OTHER_KEY, WARMUP_SUMMARY_KEYS
from paged_jax.entrypoints.hidden_state_files import (
    decode_hidden_states,
    write_hidden_state_files,
)
from paged_jax.entrypoints.records import NOT_SERVED, request_record
from paged_jax.entrypoints.replica import (
    CRASH_HOOK_ENV,
    REQUEST_JSON,
    Replica,
    parse_crash_hook,
    request_json,
)
from paged_jax.sampling_params import SamplingParams

# Rows per map_batches call: a batch is the unit a crash retries, and a replica drains
# its engine at the end of each, so it should hold several engine steps' sequences.
DEFAULT_BATCH_SIZE = 64
# A batch whose replica died is tried this many times more before the job fails (a
# request that kills every replica must not loop forever).
DEFAULT_MAX_BATCH_RETRIES = 3


def add_data_parallel_flags(parser: argparse.ArgumentParser) -> None:
    """The CLI's data-parallel group (vLLM's flag name for the replica count)."""
    g = parser.add_argument_group("data parallel (Ray Data; pip install 'paged-jax[ray]')")
    g.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="engine replicas, each with --tensor-parallel-size devices; N > 1 runs the "
        "job on Ray Data (docs/scale_out.md)",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. 'auto' or 'HOST:6379') (default: start a local one)",
    )
    g.add_argument(
        "--cpus-per-replica",
        type=int,
        default=None,
        metavar="C",
        help="Ray CPUs per replica; a CPU replica is pinned to C cores, so XLA runs C threads "
        "(default: the cluster's CPUs / N on CPU, 1 with GPUs)",
    )


def check_data_parallel_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag when the data-parallel flags cannot work."""
    n = args.data_parallel_size
    if n < 1:
        raise ValueError(f"--data-parallel-size={n!r} must be an int >= 1")
    if args.cpus_per_replica is not None and args.cpus_per_replica < 1:
        raise ValueError(f"--cpus-per-replica={args.cpus_per_replica!r} must be an int >= 1")
    if n > 1 or args.ray_address is not None:
        _import_ray()


def _import_ray():
    try:
        import ray
        import ray.data  # noqa: F401 - the extra installs ray[data]
    except ImportError as err:
        raise ValueError(
            f"--data-parallel-size needs Ray Data ({err}): pip install 'paged-jax[ray]'"
        ) from err
    return ray


def start_ray(address: str | None, *, num_cpus: int | None = None) -> bool:
    """Connects to the cluster at `address`, or starts a local one; True if started here.

    A local cluster gets num_cpus logical CPUs (default: this host's) plus one, so Ray
    Data's own read tasks still run while every core holds a replica.

    Raises:
        ValueError: `address` names no reachable cluster.
    """
    ray = _import_ray()
    if ray.is_initialized():
        return False
    quiet = {"logging_level": logging.WARNING, "include_dashboard": False}
    with warnings.catch_warnings():
        # Ray starts its processes with fork + exec; jax's fork warning is about a
        # forked child that keeps running Python, which these never do.
        warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
        if address is not None:
            try:
                ray.init(address=address, **quiet)
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise ValueError(
                    f"--ray-address={address!r}: cannot join the cluster: {err}"
                ) from err
            return False
        ray.init(num_cpus=(num_cpus or os.cpu_count() or 1) + 1, **quiet)
    return True


def new_job_dir() -> str:
    """A fresh per-job directory name under the temporary directory (made on use)."""
    return os.path.join(tempfile.gettempdir(), "paged-jax-replicas", uuid.uuid4().hex)


def replica_resources(
    data_parallel_size: int,
    tensor_parallel_size: int,
    cpus_per_replica: int | None,
    gpus_per_replica: int | None,
) -> tuple[int, int]:
    """(CPUs, GPUs) per replica, defaulted from the connected cluster and checked to fit.

    With GPUs in the cluster a replica takes tensor_parallel_size of them (and 1 CPU);
    without, it takes the cluster's CPUs / data_parallel_size (at least 1).

    Raises:
        ValueError: the cluster cannot hold data_parallel_size replicas of that size.
    """
    import ray

    total = ray.cluster_resources()
    cluster_cpus, cluster_gpus = int(total.get("CPU", 0)), int(total.get("GPU", 0))
    if gpus_per_replica is None:
        gpus_per_replica = tensor_parallel_size if cluster_gpus else 0
    if cpus_per_replica is None:
        cpus_per_replica = 1 if gpus_per_replica else max(1, cluster_cpus // data_parallel_size)
    for kind, each, have in (
        ("CPU", cpus_per_replica, cluster_cpus),
        ("GPU", gpus_per_replica, cluster_gpus),
    ):
        if each * data_parallel_size > have:
            raise ValueError(
                f"data_parallel_size={data_parallel_size} replicas of {each} {kind} each need "
                f"{each * data_parallel_size} {kind}s; the Ray cluster has {have}"
            )
    return cpus_per_replica, gpus_per_replica


def generate_dataset(
    ds: Any,
    model: str | os.PathLike,
    sampling_params: SamplingParams | None = None,
    *,
    data_parallel_size: int = 1,
    batch_size: int = DEFAULT_BATCH_SIZE,
    cpus_per_replica: int | None = None,
    gpus_per_replica: int | None = None,
    pin_cpus: bool = True,
    chat_template: str | None = None,
    compile_cache: bool | str = True,
    max_batch_retries: int = DEFAULT_MAX_BATCH_RETRIES,
    job_dir: str | None = None,
    **engine_args: Any,
) -> Any:
    """Generates for every row of a Ray Dataset on data_parallel_size engine replicas.

    Connect to Ray first (ray.init) or let this start a local cluster. The result is
    lazy, like any Ray Dataset: iterate it, write it (write_parquet, ...) or
    materialize it.

    Args:
        ds: rows shaped like the CLI's JSONL lines: exactly one of "prompt",
            "prompt_token_ids" or "messages", optional "id", optional SamplingParams
            fields (overrides; null = not given), optional "index" and "line" (echoed;
            errors then name the line); other columns are ignored.
        model: a Hugging Face model directory every replica can read.
        sampling_params: the run's SamplingParams (default SamplingParams()).
        data_parallel_size: replicas (Ray actors), each with its own LLM.
        batch_size: rows per replica call (the unit a crash retries).
        cpus_per_replica, gpus_per_replica: Ray resources per replica (default: see
            replica_resources).
        pin_cpus: pin each CPU replica to cpus_per_replica cores of its host, so XLA's
            thread pools match its share (False: every replica sees every core).
        chat_template: Jinja text for "messages" rows instead of the checkpoint's.
        compile_cache: LLM's compile_cache, shared by the replicas (warm restarts).
        max_batch_retries: a batch whose replica died is served again at most this
            many times; then its rows get error records.
        job_dir: a directory the job's replicas share on each host (default: a fresh
            one under the temporary directory).
        **engine_args: EngineConfig fields (tensor_parallel_size is per replica).

    Returns:
        A Dataset with one row per input row: "index" (the row's, or null), "record" (the
        CLI's output record as JSON text), "hidden_states" (with return_hidden_states and
        engine_args' hidden_state_layers: the rows as .npz bytes, which
        ``paged_jax.entrypoints.hidden_state_files.decode_hidden_states`` turns into
        {"prompt": {layer: f32[P, hidden]}, "out<j>": {layer: f32[N_j - 1, hidden]}};
        null for a row that asked for none) and "replica" (the serving replica's
        figures as JSON text).
    """
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size={data_parallel_size!r} must be an int >= 1")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
    crash_hook = os.environ.get(CRASH_HOOK_ENV)
    parse_crash_hook(crash_hook)  # a bad value fails here, not in every replica
    ray = _import_ray()
    if not ray.is_initialized():
        start_ray(None)
    tp = int(engine_args.get("tensor_parallel_size", 1))
    cpus, gpus = replica_resources(data_parallel_size, tp, cpus_per_replica, gpus_per_replica)
    on_cpu = gpus == 0
    replica = {
        "engine_args": engine_args,
        "chat_template": chat_template,
        "compile_cache": compile_cache,
        "cpu_cores": cpus if on_cpu and pin_cpus else None,
        "job_dir": job_dir or new_job_dir(),
        "max_batch_retries": max_batch_retries,
        "cpu_devices": tp if on_cpu else 1,
        "platform": "cpu" if on_cpu else None,
        "crash_hook": crash_hook,
    }
    return ds.map_batches(
        Replica,
        fn_constructor_args=(str(model), sampling_params or SamplingParams()),
        fn_constructor_kwargs=replica,
        batch_size=batch_size,
        batch_format="pyarrow",
        zero_copy_batch=True,
        # Ray Data's actor pools restart a dead actor and resubmit its tasks (Ray's
        # defaults, unbounded); the replicas bound the retries of a batch themselves.
        # One batch in flight per replica: a replica that is ready first does not queue
        # the batches a slower-starting one would serve.
        compute=ray.data.ActorPoolStrategy(
            size=data_parallel_size, max_tasks_in_flight_per_actor=1
        ),
        num_cpus=cpus,
        num_gpus=gpus,
    )


def run_data_parallel(args: argparse.Namespace, plan: Any, records: Any) -> dict[str, Any]:
    """The CLI's job on data_parallel_size replicas; returns the run's summary.

    Bad lines get their records here, before Ray starts (as in the single-process run);
    the servable lines go to the replicas as rows, and each record is written as its
    batch comes back, a repeated index dropped. If the pipeline fails (a batch out of
    retries, the cluster lost), every request without a record gets an error record.

    Args:
        args: the parsed command line (data-parallel flags included).
        plan: the checked job (generate_cli's plan: lines, requests, engine_args, ...).
        records: the CLI's record writer (emit, bad_lines, failed, bar).
    """
    ray = _import_ray()

    t_job = time.perf_counter()
    started = start_ray(args.ray_address)
    ray_start_s = time.perf_counter() - t_job
    try:
        cpus, gpus = replica_resources(
            args.data_parallel_size,
            int(plan.engine_args.get("tensor_parallel_size", 1)),
            args.cpus_per_replica,
            None,
        )
    except ValueError:
        ray.shutdown()
        raise
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.ERROR)  # the CLI prints its own lines
    if not args.no_tqdm:
        from tqdm.auto import tqdm

        records.bar = tqdm(total=len(plan.lines), desc="requests", unit="req", dynamic_ncols=True)
    records.bad_lines()
    rows = [
        {"index": r.line.index, "line": r.line.line, REQUEST_JSON: request_json(r.line)}
        for r in plan.requests
    ]
    pending = {r.line.index: r.line for r in plan.requests}
    # At least two batches per replica, so a slow batch does not idle the others.
    batch_size = min(DEFAULT_BATCH_SIZE, max(1, -(-len(rows) // (2 * args.data_parallel_size))))
    job_dir = new_job_dir()
    replicas: dict[str, dict[str, Any]] = {}
    results: list[dict[str, Any]] = []
    duplicates = 0
    error: BaseException | None = None
    try:
        try:
            ds = ray.data.from_items(rows)
            out = generate_dataset(
                ds,
                plan.model_dir,
                plan.params,
                data_parallel_size=args.data_parallel_size,
                batch_size=batch_size,
                job_dir=job_dir,
                cpus_per_replica=cpus,
                gpus_per_replica=gpus,
                chat_template=plan.chat_template,
                compile_cache=plan.compile_cache,
                **plan.engine_args,
            )
            for batch in out.iter_batches(batch_size=None, batch_format="pyarrow"):
                for index, text, states, stats in zip(
                    batch["index"].to_pylist(),
                    batch["record"].to_pylist(),
                    batch["hidden_states"].to_pylist(),
                    batch["replica"].to_pylist(),
                ):
                    if index not in pending:
                        duplicates += 1
                        continue
                    del pending[index]
                    record = json.loads(text)
                    if states is not None and plan.output is not None:  # as the single run
                        rows = decode_hidden_states(states)
                        record.update(write_hidden_state_files(plan.output.target, index, rows))
                    if records.emit(record) and record.get("error") is None:
                        results.append(record)
                    info = json.loads(stats)
                    seen = replicas.get(info["name"])
                    if seen is None or info["batches"] >= seen["batches"]:
                        replicas[info["name"]] = info
                if records.output_error is not None:  # no further record can be kept
                    break
        except Exception as err:  # noqa: BLE001 - the unfinished requests get records
            error = err
    finally:
        if started or ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(job_dir, ignore_errors=True)
    if error is not None:
        _fail_unfinished(error, pending, records)
    else:  # stopped early by the output file (the CLI's _finish reports it)
        for line in pending.values():
            records.emit(request_record(line, error=f"line {line.line}: {NOT_SERVED}"))
    summary = _summary(plan, args, results, records, replicas, duplicates)
    summary["ray_start_s"] = round(ray_start_s, 2)
    summary["job_s"] = round(time.perf_counter() - t_job, 2)
    summary["engine_error"] = None if error is None else f"{type(error).__name__}: {error}"
    if records.bar is not None:
        records.bar.set_postfix_str(f"out {summary['generated_tokens_per_s']} tok/s", refresh=True)
        records.bar.close()
    return summary


def _fail_unfinished(error: BaseException, pending: Mapping[int, Any], records: Any) -> None:
    what = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"
    frame = traceback.extract_tb(error.__traceback__)
    where = f" at {os.path.basename(frame[-1].filename)}:{frame[-1].lineno}" if frame else ""
    print(
        f"paged-jax-generate: error: the data-parallel run failed ({what}){where}; the "
        f"{len(pending)} unfinished requests get error records",
        file=sys.stderr,
    )
    for line in pending.values():
        error_text = (
            f"line {line.line}: the data-parallel run failed before this request finished ({what})"
        )
        records.emit(request_record(line, error=error_text))


def _summary(plan, args, results, records, replicas, duplicates) -> dict[str, Any]:
    """The single-process summary's keys, each replica's engine figures merged, plus the
    data-parallel ones."""
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in results)
    gen_tokens = sum(len(c["token_ids"]) for r in results for c in r["outputs"])
    each = list(replicas.values())
    starts = [r["first_start"] for r in each if r["first_start"] is not None]
    ends = [r["last_end"] for r in each if r["last_end"] is not None]
    # Generation wall: first batch started to last batch ended, on any replica (the
    # single-process wall_s also starts after load and warm-up).
    wall = max(ends) - min(starts) if starts and ends else 0.0
    merged = merge_replica_figures(each)
    return {
        "requests": len(plan.lines),
        "succeeded": len(results),
        "failed": len(records.failed),
        "completions": sum(len(r["outputs"]) for r in results),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": gen_tokens,
        **{k: merged.pop(k) for k in ("load_s", "warmup_s", "load_and_warmup_s")},
        "wall_s": round(wall, 2),
        "generated_tokens_per_s": round(gen_tokens / max(wall, 1e-9), 1),
        "total_tokens_per_s": round((prompt_tokens + gen_tokens) / max(wall, 1e-9), 1),
        **merged,
        "data_parallel_size": args.data_parallel_size,
        "replica_processes": len(each),
        "duplicates_dropped": duplicates,
        "replicas": [{k: r[k] for k in _PER_REPLICA_KEYS if k in r} for r in each],
    }


# Warm-up's seconds per phase: the summary gives the largest over the replicas.
_WARMUP_SECONDS = (*WARMUP_SUMMARY_KEYS.values(), WARMUP_OTHER_KEY)
# Each replica's own line in the summary's "replicas" list.
_PER_REPLICA_KEYS = (
    "name",
    "cores",
    "load_s",
    "warmup_s",
    "start",
    "programs_compiled",
    "programs_loaded",
    "requests",
    "busy_s",
    "steps",
)


def merge_replica_figures(each: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The single-process summary's engine figures from each replica process's figures.

    How each kind of figure is merged:

    - counts are summed over the processes (a replica restarted by Ray is a process of
      its own): steps, preemptions, compiles after warm-up, programs compiled and loaded
      at start-up, executable-cache problems, compile-cache hits and misses,
      speculative draft and accepted tokens;
    - rates are recomputed from the summed counts, never averaged: the prefix-cache hit
      rate, the speculative acceptance rate and its rate per draft position;
    - sizes and start-up seconds (load, warm-up and each warm-up phase) are the largest
      over the replicas, key by key (the job waits for its slowest start; each
      replica's own start is in the summary's "replicas"); warmup_compiles and programs
      likewise (every replica builds the same programs);
    - start is the replicas' common "cold" / "warm", else "partial";
    - median_step_ms is the median of the replicas' medians.

    Args:
        each: Replica.stats() of every replica process, in any order (may be empty).

    Returns:
        The keys of the single-process summary from load_s on, but for the job's own
        (wall time and token rates), in its order; spec_* keys when the replicas
        speculated, compile_cache_* keys when the compile cache was on.
    """

    def most(key: str) -> Any:
        return max((r[key] for r in each if key in r), default=0)

    def total(key: str) -> Any:
        return sum(r.get(key, 0) for r in each)

    def rate(num: float, den: float) -> float:
        return round(num / den, 3) if den else 0.0

    starts = {r["start"] for r in each if "start" in r}
    merged: dict[str, Any] = {
        "load_s": round(most("load_s"), 2),
        "warmup_s": round(most("warmup_s"), 2),
        "load_and_warmup_s": round(max((r["load_s"] + r["warmup_s"] for r in each), default=0), 2),
        "kv_blocks": most("kv_blocks"),
        "peak_kv_usage": round(most("peak_kv_usage"), 3),
        "prefix_cache_hit_rate": rate(total("prefix_cache_hits"), total("prefix_cache_queries")),
        "max_num_seqs": most("max_num_seqs"),
        "max_num_batched_tokens": most("max_num_batched_tokens"),
        "preemptions": total("preemptions"),
        "start": starts.pop() if len(starts) == 1 else ("partial" if starts else None),
        "programs": most("programs"),
        "programs_compiled": total("programs_compiled"),
        "programs_loaded": total("programs_loaded"),
        **{k: round(most(k), 3) for k in _WARMUP_SECONDS},
        "executable_cache_problems": total("executable_cache_problems"),
        "warmup_compiles": most("warmup_compiles"),
        "compiles_after_warmup": total("compiles_after_warmup"),
        "steps": total("steps"),
        "median_step_ms": round(statistics.median(r["median_step_ms"] for r in each), 2)
        if each
        else 0.0,
        "compile_cache": each[0]["compile_cache"] if each else None,
    }
    if any("compile_cache_hits" in r for r in each):
        merged["compile_cache_hits"] = total("compile_cache_hits")
        merged["compile_cache_misses"] = total("compile_cache_misses")
    spec = [r for r in each if "spec_method" in r]
    if spec:
        drafted = _sum_lists(r["spec_drafted_per_position"] for r in spec)
        accepted = _sum_lists(r["spec_accepted_per_position"] for r in spec)
        merged.update(
            spec_method=spec[0]["spec_method"],
            spec_draft_tokens=total("spec_num_draft_tokens"),
            spec_accepted_tokens=total("spec_num_accepted_tokens"),
            spec_acceptance_rate=rate(
                total("spec_num_accepted_tokens"), total("spec_num_draft_tokens")
            ),
            spec_accept_per_position=[rate(a, d) for a, d in zip(accepted, drafted)],
        )
    return merged


def _sum_lists(lists: Any) -> list[int]:
    """Element-wise sum of lists of counts (a shorter list counts as zeros past its end)."""
    out: list[int] = []
    for values in lists:
        out.extend([0] * (len(values) - len(out)))
        for i, v in enumerate(values):
            out[i] += v
    return out
