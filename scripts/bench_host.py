"""Host block-stack benchmark: KVCacheManager time per scheduler step on a synthetic trace.

Drives KVCacheManager with a minimal FCFS scheduler (chunked prefill, token budget,
recompute preemption of the latest-admitted running request) over a seeded,
ShareGPT-like trace, and times every manager call. No model runs: each scheduled
step "samples" a random token. Example:

    python scripts/bench_host.py --num-requests 2000 --num-blocks 4096
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import math
import os
import pathlib
import random
import statistics
import sys
import time

from paged_jax import KVCacheManager, Request, RequestStatus
from paged_jax.constants import cdiv


def make_trace(
    num_requests: int,
    *,
    seed: int,
    vocab_size: int,
    num_system_prompts: int,
    max_model_len: int,
) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, in arrival order.

    Prompt lengths are log-normal around 160 tokens, output lengths log-normal
    around 300; half the prompts start with one of a few shared 256-512-token
    system prompts.
    """
    rng = random.Random(seed)
    systems = [
        [rng.randrange(vocab_size) for _ in range(rng.randint(256, 512))]
        for _ in range(num_system_prompts)
    ]
    trace = []
    for _ in range(num_requests):
        prompt_len = min(max(int(rng.lognormvariate(math.log(160), 0.8)), 4), 2048)
        prompt = [rng.randrange(vocab_size) for _ in range(prompt_len)]
        if systems and rng.random() < 0.5:
            prompt = rng.choice(systems) + prompt
        prompt = prompt[: max_model_len // 2]
        output_len = min(max(int(rng.lognormvariate(math.log(300), 0.6)), 1), 1024)
        output_len = min(output_len, max_model_len - len(prompt))
        trace.append((prompt, output_len))
    return trace


class Timer:
    """Accumulates per-call durations (ns) of the manager calls."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = collections.defaultdict(list)
        self.step_ns = 0

    def add(self, name: str, ns: int) -> None:
        self.calls[name].append(ns)
        self.step_ns += ns


def run(args: argparse.Namespace) -> dict:
    trace = make_trace(
        args.num_requests,
        seed=args.seed,
        vocab_size=args.vocab_size,
        num_system_prompts=args.num_system_prompts,
        max_model_len=args.max_model_len,
    )
    # A request that cannot fit the pool on its own would never finish (FCFS loops).
    longest = max(len(prompt) + out for prompt, out in trace)
    min_blocks = cdiv(longest, args.block_size) + 1  # + the null block
    if args.num_blocks < min_blocks:
        raise SystemExit(
            f"--num-blocks={args.num_blocks} must be >= {min_blocks}: the longest request "
            f"has {longest} tokens and could never run"
        )
    kv = KVCacheManager(
        args.num_blocks,
        args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        hash_algo=args.hash_algo,
        max_model_len=args.max_model_len,
    )
    rng = random.Random(args.seed + 1)
    # As in vLLM, a request's prompt is hashed when the request is created (outside
    # the scheduler step), so manager time excludes prompt hashing; timed apart.
    t0 = time.perf_counter_ns()
    requests = [
        Request(f"req-{i}", prompt, arrival_time=float(i), block_hasher=kv.block_hasher)
        for i, (prompt, _) in enumerate(trace)
    ]
    create_ns = time.perf_counter_ns() - t0
    num_prompt_tokens = sum(r.num_tokens for r in requests)
    # Long-lived setup objects need no scanning by the cyclic GC (vLLM freezes too).
    gc.collect()
    gc.freeze()
    max_output = {r.request_id: out for r, (_, out) in zip(requests, trace)}
    waiting = collections.deque(requests)
    running: list[Request] = []
    timer = Timer()
    clock = time.perf_counter_ns
    step_manager_ns: list[int] = []
    step_update_ns: list[int] = []
    num_preemptions = 0
    peak_used = 0
    num_finished = 0
    num_steps = 0
    usable = kv.num_usable_blocks
    wall_start = time.perf_counter()

    while waiting or running:
        num_steps += 1
        timer.step_ns = 0
        budget = args.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False

        # Running requests first, in admission order.
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while True:
                t0 = clock()
                new_blocks = kv.allocate_slots(req, num_new)
                timer.add("allocate_slots", clock() - t0)
                if new_blocks is not None:
                    break
                victim = running.pop()  # FCFS: the latest admitted
                t0 = clock()
                kv.free(victim)
                timer.add("free", clock() - t0)
                victim.status = RequestStatus.PREEMPTED
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                num_preemptions += 1
                preempted = True
                waiting.appendleft(victim)
                if victim is req:
                    break
            if new_blocks is None:
                break
            scheduled.append((req, num_new))
            budget -= num_new
            i += 1

        # Waiting requests, only if nothing was preempted in this step.
        while not preempted and waiting and budget > 0 and len(running) < args.max_num_seqs:
            req = waiting[0]
            t0 = clock()
            hits, num_hit = kv.get_computed_blocks(req)
            timer.add("get_computed_blocks", clock() - t0)
            num_new = min(req.num_tokens - num_hit, budget)
            t0 = clock()
            new_blocks = kv.allocate_slots(req, num_new, num_hit, hits)
            timer.add("allocate_slots", clock() - t0)
            if new_blocks is None:
                break  # head-of-line blocking: waiting requests never preempt
            waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            running.append(req)
            scheduled.append((req, num_new))
            budget -= num_new

        peak_used = max(peak_used, usable - kv.num_free_blocks)

        # "Execute": advance progress, sample a token where a sequence caught up.
        t_update = clock()
        finished = []
        for req, num_new in scheduled:
            req.num_computed_tokens += num_new
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token_ids(rng.randrange(args.vocab_size))
                if req.num_output_tokens >= max_output[req.request_id]:
                    finished.append(req)
        step_update_ns.append(clock() - t_update)
        if finished:
            done = set()
            for req in finished:
                t0 = clock()
                kv.free(req)
                timer.add("free", clock() - t0)
                req.status = RequestStatus.FINISHED_LENGTH
                done.add(req.request_id)
            running = [r for r in running if r.request_id not in done]
            num_finished += len(finished)
        step_manager_ns.append(timer.step_ns)

    wall_s = time.perf_counter() - wall_start
    gc.unfreeze()
    kv.check_invariants()
    all_back = (
        num_finished == len(requests)
        and kv.num_free_blocks == usable
        and all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    )
    stats = kv.prefix_cache_stats

    def us(values: list[int], q: float | None = None) -> float:
        if not values:
            return 0.0
        if q is None:
            return round(statistics.median(values) / 1e3, 3)
        ordered = sorted(values)
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3, 3)

    return {
        "config": {
            "num_requests": args.num_requests,
            "num_blocks": args.num_blocks,
            "block_size": args.block_size,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_num_seqs": args.max_num_seqs,
            "max_model_len": args.max_model_len,
            "hash_algo": args.hash_algo,
            "prefix_caching": not args.no_prefix_caching,
            "seed": args.seed,
            "python": sys.version.split()[0],
        },
        "steps": num_steps,
        "manager_us_per_step": {
            "median": us(step_manager_ns),
            "p90": us(step_manager_ns, 0.90),
            "p99": us(step_manager_ns, 0.99),
            "mean": round(sum(step_manager_ns) / len(step_manager_ns) / 1e3, 3),
        },
        "manager_us_per_call_median": {
            name: us(timer.calls[name])
            for name in ("allocate_slots", "get_computed_blocks", "free")
        },
        "num_calls": {name: len(v) for name, v in sorted(timer.calls.items())},
        "request_update_us_per_step_median": us(step_update_ns),
        "request_create_and_hash_us_per_prompt_token": round(
            create_ns / num_prompt_tokens / 1e3, 4
        ),
        "prefix_hit_rate": round(stats.hit_rate, 4),
        "prefix_hit_rate_incl_resumes": round(stats.total_hit_rate, 4),
        "prefix_cache_hit_tokens": stats.hits + stats.preempted_hits,
        "prefix_cache_query_tokens": stats.queries + stats.preempted_queries,
        "preemptions": num_preemptions,
        "peak_blocks_used": peak_used,
        "usable_blocks": usable,
        "wall_s": round(wall_s, 3),
        "loadavg_1min_at_end": round(os.getloadavg()[0], 2),
        "all_blocks_returned": all_back,
    }


def run_engine_host(num_seqs: int, num_steps: int, *, async_scheduling: bool = True) -> dict:
    """Engine host time per decode step at a full batch of num_seqs (SumModel, CPU).

    Every request decodes for the whole measured window, so each measured step
    schedules exactly num_seqs sequences. Host time is a step() call's wall time less
    its wait for device tokens; the parts (scheduler, input packing, the jitted call's
    dispatch, reading outputs) are the engine's own per-phase times, in thread CPU time.
    """
    from paged_jax.config import EngineConfig
    from paged_jax.engine import Engine
    from paged_jax.sampling_params import SamplingParams
    from paged_jax.testing.fake_model import SumModel, SumModelConfig

    prompt_len, warm = 4, 4
    max_len = prompt_len + warm + num_steps + 4
    model = SumModel(SumModelConfig(vocab_size=97, max_position_embeddings=max_len))
    engine = Engine(
        model,
        EngineConfig(
            block_size=16,
            num_kv_blocks=num_seqs * cdiv(max_len, 16) + 1,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max(num_seqs * prompt_len, 16),
            max_model_len=max_len,
            attention_backend="reference",
            async_scheduling=async_scheduling,
        ),
    )
    params = SamplingParams(temperature=0, max_tokens=warm + num_steps + 2, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", [1 + i % 90, 2, 3, 4], params)
    # CPU time of this (the host) thread: on a shared, oversubscribed machine wall time
    # also counts the time the process waits for a core; thread CPU time does not.
    cpu = time.thread_time
    engine.phase_clock = cpu
    for _ in range(warm):  # prefill + first decodes; compiles happen here
        engine.step()
    engine.reset_step_times()
    gc.collect()
    step_cpu = []
    for _ in range(num_steps):
        t = cpu()
        engine.step()
        step_cpu.append(cpu() - t)
    stats = engine.get_stats()

    def us(ms: float) -> float:
        return round(1e3 * ms, 1)

    return {
        "num_seqs": num_seqs,
        "num_steps": num_steps,
        "async_scheduling": async_scheduling,
        "host_cpu_us_per_step": {
            "median": round(1e6 * statistics.median(step_cpu), 1),
            "min": round(1e6 * min(step_cpu), 1),
        },
        "host_cpu_us_per_seq": round(1e6 * statistics.median(step_cpu) / num_seqs, 3),
        "host_wall_us_per_step": {
            "median": us(stats["host_time_ms"]),
            "min": us(stats["host_time_min_ms"]),
        },
        "parts_cpu_us_per_step_median": {
            name: us(ms) for name, ms in stats["host_phase_time_ms"].items()
        },
        "loadavg_1min_at_end": round(os.getloadavg()[0], 2),
    }


def add_trace_args(parser: argparse.ArgumentParser) -> None:
    """The trace, pool and scheduler flags (shared with scripts/bench_vllm_manager.py)."""
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--num-blocks", type=int, default=4096, help="including null block 0")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--hash-algo", choices=("sha256", "xxhash"), default="sha256")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--num-system-prompts", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trace_args(parser)
    parser.add_argument(
        "--engine-seqs",
        type=int,
        default=256,
        help="also time the engine's host step at this decode batch (0: skip; imports jax)",
    )
    parser.add_argument("--engine-steps", type=int, default=50)
    parser.add_argument("--output", type=pathlib.Path, default="bench_results/bench_host.json")
    args = parser.parse_args(argv)

    result = run(args)
    if args.engine_seqs:
        result["engine_host"] = [
            run_engine_host(args.engine_seqs, args.engine_steps, async_scheduling=mode)
            for mode in (True, False)
        ]
    text = json.dumps(result, indent=2)
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text + "\n")
    if not result["all_blocks_returned"]:
        print("self-check FAILED: not every block is back in the pool", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
