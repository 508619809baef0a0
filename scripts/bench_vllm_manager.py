"""Our host KVCacheManager against vLLM's V1 KVCacheManager: one trace, one process.

Both managers replay the same seeded trace (bench_host.make_trace) through the same
minimal FCFS scheduler as scripts/bench_host.py: chunked prefill, a token budget,
recompute preemption of the latest-admitted running request. Runs alternate
between the two managers for --rounds rounds (the first manager of a round
alternates too). Every get_computed_blocks / allocate_slots / free call is timed.

Every run writes a decision log: per call, the request, the hit length and hit
block ids, the tokens asked for, success or failure and the new block ids; per
step, the free-block count, the number of scheduled requests and preemptions. All
logs must be equal, step by step, to the first run's; on the first difference the
script prints both sides of that step and exits 1.

vLLM is not a dependency of this project: the script exits 0 with a note when
`import vllm` fails (--require-vllm makes that exit 2). scripts/setup_vllm_venv.sh
builds a side venv in which it runs:

    bash scripts/setup_vllm_venv.sh /work/venv-vllm
    /work/venv-vllm/bin/python scripts/bench_vllm_manager.py
"""

from __future__ import annotations

import argparse
import array
import gc
import importlib.util
import json
import os
import pathlib
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections import deque
from types import SimpleNamespace

REPO = pathlib.Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench_host import add_trace_args, make_trace  # noqa: E402

from paged_jax import KVCacheManager, Request, RequestStatus  # noqa: E402
from paged_jax.constants import cdiv  # noqa: E402

SIDES = ("paged_jax", "vllm")

# Decision-log record tags (int64 stream; see Run.log).
GET, ALLOC, FREE, STEP = 1, 2, 3, 4
FREE_FINISHED, FREE_PREEMPTED = 0, 1


def load_vllm(hash_algo: str) -> SimpleNamespace:
    """Imports vLLM's V1 block stack; raises ImportError (or anything) if it cannot."""
    if importlib.util.find_spec("vllm") is None:  # fail fast, before importing torch
        raise ImportError("No module named 'vllm'")
    import torch
    import vllm
    from vllm.sampling_params import SamplingParams as VSamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VKVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request as VRequest
    from vllm.v1.request import RequestStatus as VRequestStatus

    hash_fn = get_hash_fn_by_name(hash_algo)
    init_none_hash(hash_fn)  # vLLM's engine core does this once per process
    return SimpleNamespace(
        version=vllm.__version__,
        torch_version=torch.__version__,
        torch=torch,
        SamplingParams=VSamplingParams,
        KVCacheManager=VKVCacheManager,
        get_request_block_hasher=get_request_block_hasher,
        hash_fn=hash_fn,
        FullAttentionSpec=FullAttentionSpec,
        KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec,
        Request=VRequest,
        RequestStatus=VRequestStatus,
    )


def build_side(side: str, trace, args, V) -> SimpleNamespace:
    """The manager, the requests (created and hashed here, timed) and the status values."""
    caching = not args.no_prefix_caching
    if side == "paged_jax":
        kv = KVCacheManager(
            args.num_blocks,
            args.block_size,
            enable_prefix_caching=caching,
            hash_algo=args.hash_algo,
            max_model_len=args.max_model_len,
        )
        t0 = time.perf_counter_ns()
        requests = [
            Request(f"req-{i}", prompt, arrival_time=float(i), block_hasher=kv.block_hasher)
            for i, (prompt, _) in enumerate(trace)
        ]
        create_ns = time.perf_counter_ns() - t0
        return SimpleNamespace(
            kv=kv,
            requests=requests,
            create_ns=create_ns,
            status=RequestStatus,
            finished=RequestStatus.FINISHED_LENGTH,
            num_free=lambda: kv.num_free_blocks,
            blocks=lambda: kv.block_pool.blocks,
        )
    # vLLM, configured as its scheduler does for one full-attention group.
    spec = V.FullAttentionSpec(
        block_size=args.block_size, num_kv_heads=1, head_size=64, dtype=V.torch.float16
    )
    config = V.KVCacheConfig(
        num_blocks=args.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[V.KVCacheGroupSpec(["layers.0.attn"], spec)],
    )
    kv = V.KVCacheManager(
        config,
        max_model_len=args.max_model_len,
        scheduler_block_size=args.block_size,
        hash_block_size=args.block_size,
        enable_caching=caching,
        # Our manager always keeps prefix-cache counters; vLLM's only with log_stats
        # (recorded by record_prefix_cache_stats, timed with get_computed_blocks).
        log_stats=True,
    )
    hasher = V.get_request_block_hasher(args.block_size, V.hash_fn) if caching else None
    params = [V.SamplingParams(max_tokens=out) for _, out in trace]  # not timed
    t0 = time.perf_counter_ns()
    requests = [
        V.Request(f"req-{i}", prompt, params[i], None, arrival_time=float(i), block_hasher=hasher)
        for i, (prompt, _) in enumerate(trace)
    ]
    create_ns = time.perf_counter_ns() - t0
    return SimpleNamespace(
        kv=kv,
        requests=requests,
        create_ns=create_ns,
        status=V.RequestStatus,
        finished=V.RequestStatus.FINISHED_LENGTH_CAPPED,
        num_free=kv.block_pool.get_num_free_blocks,
        blocks=lambda: kv.block_pool.blocks,
    )


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks.blocks[0]] if blocks.blocks else []


def run_once(side: str, trace, args, V) -> SimpleNamespace:
    """One full replay of the trace through one manager; returns timings and the log."""
    is_vllm = side == "vllm"
    s = build_side(side, trace, args, V)
    kv, requests = s.kv, s.requests
    RUNNING, PREEMPTED = s.status.RUNNING, s.status.PREEMPTED
    FINISHED = s.finished
    rng = random.Random(args.seed + 1)  # the sampled tokens, as in bench_host
    index = {r.request_id: i for i, r in enumerate(requests)}
    max_output = [out for _, out in trace]
    num_prompt_tokens = sum(r.num_tokens for r in requests)
    usable = args.num_blocks - 1

    get_computed = kv.get_computed_blocks
    allocate = kv.allocate_slots
    free = kv.free
    record_stats = kv.record_prefix_cache_stats if is_vllm else None
    clock = time.perf_counter_ns

    calls: dict[str, list[int]] = {"get_computed_blocks": [], "allocate_slots": [], "free": []}
    t_get, t_alloc, t_free = calls["get_computed_blocks"], calls["allocate_slots"], calls["free"]
    step_manager_ns: list[int] = []
    step_housekeeping_ns: list[int] = []  # vLLM only: new_step_starts + take_new_block_ids
    step_update_ns: list[int] = []
    log = array.array("q")
    step_ends = array.array("q")

    gc.collect()
    gc.freeze()
    load_before = os.getloadavg()
    waiting = deque(requests)
    running: list = []
    num_preemptions = 0
    num_finished = 0
    num_steps = 0
    wall_start = time.perf_counter()

    while waiting or running:
        num_steps += 1
        step_ns = 0
        if is_vllm:
            # What vLLM's scheduler does with its manager every step besides the
            # three calls (the list of new block ids grows unless drained).
            t0 = clock()
            kv.new_step_starts()
            kv.take_new_block_ids()
            step_housekeeping_ns.append(clock() - t0)
        budget = args.max_num_batched_tokens
        scheduled = []
        preempted = 0

        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while True:
                t0 = clock()
                new_blocks = allocate(req, num_new)
                dt = clock() - t0
                t_alloc.append(dt)
                step_ns += dt
                if new_blocks is not None:
                    ids = _ids(new_blocks)
                    log.extend((ALLOC, index[req.request_id], num_new, len(ids)))
                    log.extend(ids)
                    break
                log.extend((ALLOC, index[req.request_id], num_new, -1))
                victim = running.pop()  # FCFS: the latest admitted
                t0 = clock()
                free(victim)
                dt = clock() - t0
                t_free.append(dt)
                step_ns += dt
                log.extend((FREE, index[victim.request_id], FREE_PREEMPTED))
                victim.status = PREEMPTED
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                num_preemptions += 1
                preempted += 1
                waiting.appendleft(victim)
                if victim is req:
                    break
            if new_blocks is None:
                break
            scheduled.append((req, num_new))
            budget -= num_new
            i += 1

        while not preempted and waiting and budget > 0 and len(running) < args.max_num_seqs:
            req = waiting[0]
            if is_vllm:
                t0 = clock()
                hits, num_hit, _ = get_computed(req)
                record_stats(req, num_hit)
                dt = clock() - t0
            else:
                t0 = clock()
                hits, num_hit = get_computed(req)
                dt = clock() - t0
            t_get.append(dt)
            step_ns += dt
            hit_ids = _ids(hits)
            log.extend((GET, index[req.request_id], num_hit, len(hit_ids)))
            log.extend(hit_ids)
            num_new = min(req.num_tokens - num_hit, budget)
            t0 = clock()
            new_blocks = allocate(req, num_new, num_hit, hits)
            dt = clock() - t0
            t_alloc.append(dt)
            step_ns += dt
            if new_blocks is None:
                log.extend((ALLOC, index[req.request_id], num_new, -1))
                break  # head-of-line blocking: waiting requests never preempt
            ids = _ids(new_blocks)
            log.extend((ALLOC, index[req.request_id], num_new, len(ids)))
            log.extend(ids)
            waiting.popleft()
            req.status = RUNNING
            req.num_computed_tokens = num_hit
            running.append(req)
            scheduled.append((req, num_new))
            budget -= num_new

        t_update = clock()
        finished = []
        for req, num_new in scheduled:
            req.num_computed_tokens += num_new
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token_ids(rng.randrange(args.vocab_size))
                if req.num_output_tokens >= max_output[index[req.request_id]]:
                    finished.append(req)
        step_update_ns.append(clock() - t_update)
        if finished:
            done = set()
            for req in finished:
                t0 = clock()
                free(req)
                dt = clock() - t0
                t_free.append(dt)
                step_ns += dt
                log.extend((FREE, index[req.request_id], FREE_FINISHED))
                req.status = FINISHED
                done.add(req.request_id)
            running = [r for r in running if r.request_id not in done]
            num_finished += len(finished)
        step_manager_ns.append(step_ns)
        log.extend((STEP, s.num_free(), len(scheduled), preempted))
        step_ends.append(len(log))

    wall_s = time.perf_counter() - wall_start
    load_after = os.getloadavg()
    gc.unfreeze()
    if not is_vllm:
        kv.check_invariants()
    all_back = (
        num_finished == len(requests)
        and s.num_free() == usable
        and all(b.ref_cnt == 0 for b in s.blocks()[1:])
    )
    stats = kv.prefix_cache_stats
    return SimpleNamespace(
        side=side,
        steps=num_steps,
        step_manager_ns=step_manager_ns,
        step_housekeeping_ns=step_housekeeping_ns,
        step_update_ns=step_update_ns,
        calls=calls,
        create_ns_per_prompt_token=s.create_ns / num_prompt_tokens,
        preemptions=num_preemptions,
        prefix_stats={
            "queries": stats.queries,
            "hits": stats.hits,
            "preempted_queries": stats.preempted_queries,
            "preempted_hits": stats.preempted_hits,
        },
        all_blocks_returned=all_back,
        wall_s=wall_s,
        loadavg_before=load_before,
        loadavg_after=load_after,
        log=log,
        step_ends=step_ends,
    )


# -- comparison -----------------------------------------------------------------


def _decode(log: array.array, start: int, end: int) -> list[str]:
    out, i = [], start
    while i < end:
        tag = log[i]
        if tag == GET:
            n = log[i + 3]
            out.append(
                f"get_computed_blocks(req {log[i + 1]}) -> {log[i + 2]} tokens, "
                f"blocks {list(log[i + 4 : i + 4 + n])}"
            )
            i += 4 + n
        elif tag == ALLOC:
            n = log[i + 3]
            if n < 0:
                out.append(f"allocate_slots(req {log[i + 1]}, {log[i + 2]}) -> None")
                i += 4
            else:
                out.append(
                    f"allocate_slots(req {log[i + 1]}, {log[i + 2]}) -> "
                    f"{list(log[i + 4 : i + 4 + n])}"
                )
                i += 4 + n
        elif tag == FREE:
            why = "preempted" if log[i + 2] == FREE_PREEMPTED else "finished"
            out.append(f"free(req {log[i + 1]}) [{why}]")
            i += 3
        elif tag == STEP:
            out.append(
                f"end of step: {log[i + 1]} free blocks, {log[i + 2]} scheduled, "
                f"{log[i + 3]} preempted"
            )
            i += 4
        else:
            out.append(f"? tag {tag}")
            break
    return out


def first_divergence(ref: SimpleNamespace, run: SimpleNamespace) -> dict | None:
    """None if the two decision logs are equal; else the first differing step, decoded."""
    if ref.log == run.log and ref.step_ends == run.step_ends:
        return None
    for k in range(min(len(ref.step_ends), len(run.step_ends)) + 1):
        a0 = ref.step_ends[k - 1] if k else 0
        b0 = run.step_ends[k - 1] if k else 0
        a1 = ref.step_ends[k] if k < len(ref.step_ends) else len(ref.log)
        b1 = run.step_ends[k] if k < len(run.step_ends) else len(run.log)
        if ref.log[a0:a1] != run.log[b0:b1]:
            return {
                "step": k + 1,
                ref.side + " (reference run)": _decode(ref.log, a0, a1),
                run.side: _decode(run.log, b0, b1),
            }
    return {"step": None, "note": "logs differ but no differing step found"}


# -- summaries -------------------------------------------------------------------


def _q(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3


def _dist(values: list[int]) -> dict:
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "median_us": round(statistics.median(values) / 1e3, 3),
        "p90_us": round(_q(values, 0.90), 3),
        "p99_us": round(_q(values, 0.99), 3),
        "mean_us": round(sum(values) / len(values) / 1e3, 3),
        "total_ms": round(sum(values) / 1e6, 3),
    }


def summarize(run: SimpleNamespace) -> dict:
    out = {
        "steps": run.steps,
        "manager_us_per_step": _dist(run.step_manager_ns),
        "per_call": {name: _dist(v) for name, v in run.calls.items()},
        "request_update_us_per_step_median": round(statistics.median(run.step_update_ns) / 1e3, 3),
        "request_create_and_hash_us_per_prompt_token": round(
            run.create_ns_per_prompt_token / 1e3, 4
        ),
        "preemptions": run.preemptions,
        "prefix_cache": run.prefix_stats,
        "all_blocks_returned": run.all_blocks_returned,
        "wall_s": round(run.wall_s, 3),
        "loadavg_before": [round(x, 2) for x in run.loadavg_before],
        "loadavg_after": [round(x, 2) for x in run.loadavg_after],
    }
    if run.step_housekeeping_ns:
        out["housekeeping_us_per_step"] = _dist(run.step_housekeeping_ns)
        with_hk = [a + b for a, b in zip(run.step_manager_ns, run.step_housekeeping_ns)]
        out["manager_plus_housekeeping_us_per_step"] = _dist(with_hk)
    return out


def _spread(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "per_round": [round(v, 3) for v in values],
    }


def _machine() -> dict:
    model = ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cpu_count": os.cpu_count(), "platform": platform.platform()}


def _git_head() -> str | None:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


# -- main -------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trace_args(parser)
    parser.add_argument("--rounds", type=int, default=5, help="runs per manager (>= 1)")
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=200,
        help="untimed warm-up replay of a trace this long per manager (0: none)",
    )
    parser.add_argument(
        "--output", type=pathlib.Path, default=REPO / "docs" / "host_vllm_comparison.json"
    )
    parser.add_argument(
        "--require-vllm",
        action="store_true",
        help="exit 2 instead of 0 when vllm cannot be imported",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds} must be >= 1")
    return args


def _trace(args: argparse.Namespace, num_requests: int):
    return make_trace(
        num_requests,
        seed=args.seed,
        vocab_size=args.vocab_size,
        num_system_prompts=args.num_system_prompts,
        max_model_len=args.max_model_len,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        V = load_vllm(args.hash_algo)
    except Exception as exc:  # ImportError, or a broken install deep in vllm's imports
        print(
            f"vllm is not importable ({type(exc).__name__}: {exc}); skipping the comparison. "
            "Build a side venv with scripts/setup_vllm_venv.sh and run this script with its "
            "python.",
            file=sys.stderr,
        )
        return 2 if args.require_vllm else 0

    trace = _trace(args, args.num_requests)
    longest = max(len(prompt) + out for prompt, out in trace)
    if args.num_blocks < cdiv(longest, args.block_size) + 1:
        raise SystemExit(f"--num-blocks={args.num_blocks} is too small for the longest request")

    divergence = None
    if args.warmup_requests > 0:
        warm = _trace(args, min(args.warmup_requests, args.num_requests))
        ref = run_once("paged_jax", warm, args, V)
        other = run_once("vllm", warm, args, V)
        divergence = first_divergence(ref, other)
        if divergence:
            divergence["run"] = "warm-up"
        del ref, other

    rounds = []
    reference = None
    for r in range(args.rounds):
        if divergence:
            break
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        results = {}
        for side in order:
            gc.collect()
            run = run_once(side, trace, args, V)
            if reference is None:
                reference = run
            else:
                divergence = first_divergence(reference, run)
                if divergence:
                    divergence["run"] = f"round {r + 1}, {side}"
            results[side] = summarize(run)
            run = None  # only the reference run's decision log is kept
            print(
                f"round {r + 1} {side:9s}: {results[side]['steps']} steps, manager "
                f"{results[side]['manager_us_per_step']['median_us']} us/step (median), "
                f"{results[side]['wall_s']} s wall, load {results[side]['loadavg_after'][0]}",
                file=sys.stderr,
            )
            if divergence:
                break
        if len(results) == 2:
            ours = results["paged_jax"]["manager_us_per_step"]
            theirs = results["vllm"]["manager_us_per_step"]
            results["ratio_median"] = round(ours["median_us"] / theirs["median_us"], 3)
            results["ratio_mean"] = round(ours["mean_us"] / theirs["mean_us"], 3)
            results["order"] = list(order)
        rounds.append(results)

    complete = [r for r in rounds if "ratio_median" in r]
    summary = None
    if complete:
        summary = {
            side: {
                "manager_us_per_step_median": _spread(
                    [r[side]["manager_us_per_step"]["median_us"] for r in complete]
                ),
                "manager_us_per_step_mean": _spread(
                    [r[side]["manager_us_per_step"]["mean_us"] for r in complete]
                ),
            }
            for side in SIDES
        }
        summary["vllm"]["manager_plus_housekeeping_us_per_step_median"] = _spread(
            [r["vllm"]["manager_plus_housekeeping_us_per_step"]["median_us"] for r in complete]
        )
        summary["ratio_of_medians"] = _spread([r["ratio_median"] for r in complete])
        summary["ratio_of_means"] = _spread([r["ratio_mean"] for r in complete])
        summary["ratio_vs_vllm_plus_housekeeping"] = _spread(
            [
                r["paged_jax"]["manager_us_per_step"]["median_us"]
                / r["vllm"]["manager_plus_housekeeping_us_per_step"]["median_us"]
                for r in complete
            ]
        )

    result = {
        "command": shlex.join(["python", sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        "python_executable": sys.executable,
        "config": {
            k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
        },
        "versions": {
            "python": sys.version.split()[0],
            "vllm": V.version,
            "torch": V.torch_version,
            "paged_jax_commit": _git_head(),
        },
        "vllm_setup": (
            "vllm installed with --no-deps (its metadata pins torch 2.14.0 and CUDA "
            "packages); torch 2.13.0+cpu; only the packages its import chain needs. "
            "Nothing stubbed: KVCacheManager, coordinator, BlockPool, free queue, hashing "
            "and Request are vLLM's own, unmodified."
        ),
        "stubbed_modules": [],
        "machine": _machine(),
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "timed": (
            "manager_us_per_step = get_computed_blocks + allocate_slots + free per step "
            "(vLLM: record_prefix_cache_stats counted with get_computed_blocks, since ours "
            "records its counters inside get_computed_blocks). vLLM's per-step "
            "new_step_starts + take_new_block_ids are reported apart as housekeeping."
        ),
        "decisions_identical": divergence is None,
        "decisions_compared": (
            "per call: request, hit tokens, hit block ids, tokens asked, success, new block "
            "ids; per step: free blocks, scheduled requests, preemptions"
        ),
        "divergence": divergence,
        "summary": summary,
        "rounds": rounds,
    }
    text = json.dumps(result, indent=2)
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text + "\n")
    if divergence:
        print(f"DECISIONS DIVERGE: {json.dumps(divergence, indent=2)}", file=sys.stderr)
        return 1
    bad = [
        f"round {i + 1} {side}"
        for i, r in enumerate(rounds)
        for side in SIDES
        if side in r and not r[side]["all_blocks_returned"]
    ]
    if bad:
        print(f"self-check FAILED (blocks not all returned): {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
