"""Model-free runner: drives the real Scheduler and KVCacheManager through a trace.

Each step is schedule() -> a dummy token for every sequence that reached the end of
its known tokens -> update_from_output(); a request stops at its trace output length
(max_tokens with ignore_eos). The block stack therefore sees exactly the calls it
sees in serving, only without a model.
"""

from __future__ import annotations

import zlib

import numpy as np

from paged_jax.config import EngineConfig
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request
from paged_jax.core.scheduler import Scheduler
from paged_jax.memory_study.records import RunResult, StepLog
from paged_jax.memory_study.workloads import VOCAB_SIZE, Workload
from paged_jax.sampling_params import SamplingParams

# Block states drawn by the occupancy map (values of RunResult.occupancy).
FREE, CACHED_FREE, OWNED, SHARED = 0, 1, 2, 3
BLOCK_STATES = ("free", "cached-free", "owned", "shared")


def dummy_token(request: Request) -> int:
    """A deterministic next token: a function of the request id and its output position.

    Distinct requests (parallel-sampling children included) diverge at their first
    output token, so only their common prompt can share blocks.
    """
    seed = zlib.crc32(request.request_id.encode())
    return 3 + (seed + 7919 * request.num_output_tokens) % (VOCAB_SIZE - 3)


def block_states(kv: KVCacheManager) -> np.ndarray:
    """i8[num_blocks - 1]: FREE / CACHED_FREE / OWNED / SHARED per usable block (1..)."""
    return np.fromiter(
        (
            (CACHED_FREE if b.block_hash is not None else FREE)
            if b.ref_cnt == 0
            else (OWNED if b.ref_cnt == 1 else SHARED)
            for b in kv.block_pool.blocks[1:]
        ),
        dtype=np.int8,
        count=kv.num_usable_blocks,
    )


def run_paged(
    workload: Workload,
    *,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    max_num_seqs: int = 512,
    max_num_batched_tokens: int = 4096,
    record_occupancy: bool = False,
    snapshot_request: str | None = None,
    check_invariants: bool = False,
    allocator: str | None = None,
) -> RunResult:
    """Serves the trace with paged KV blocks at the workload's KV budget.

    Args:
        workload: the trace and the budget (kv_budget_tokens // block_size usable blocks).
        block_size: tokens per block.
        enable_prefix_caching: share full blocks of equal prefixes.
        max_num_seqs: scheduler's batch cap (set high so memory is the limit).
        max_num_batched_tokens: scheduler's token budget per step.
        record_occupancy: keep every step's block states (RunResult.occupancy).
        snapshot_request: keep this request's block table at its last running step.
        check_invariants: run KVCacheManager.check_invariants() after every step.
        allocator: label; default "paged-{block_size}".

    Returns:
        The run's per-step accounting (see records.py).
    """
    num_usable = workload.kv_budget_tokens // block_size
    config = EngineConfig(
        block_size=block_size,
        num_kv_blocks=num_usable + 1,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=workload.max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        preemption_mode="recompute",
        scheduling_policy="fcfs",
    )
    kv = KVCacheManager(
        config.num_kv_blocks,
        block_size,
        enable_prefix_caching=enable_prefix_caching,
        hash_algo=config.hash_algo,
        max_model_len=workload.max_model_len,
    )
    sched = Scheduler(config, kv)
    kv_len: dict[str, int] = {}
    for i, tr in enumerate(workload.requests):
        params = SamplingParams(max_tokens=tr.output_len, temperature=0.0, ignore_eos=True)
        sched.add_request(Request(tr.req_id, tr.prompt_token_ids, params, arrival_time=float(i)))
        kv_len[tr.req_id] = tr.kv_len

    budget = num_usable * block_size
    log = StepLog()
    occupancy: list[np.ndarray] = []
    snapshot: dict | None = None
    num_hit_tokens = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert not out.errored, f"the trace holds requests that can never fit: {out.errored}"
        for row in out.new_rows:
            num_hit_tokens += row.num_computed_tokens
        logical_tokens = logical_blocks = reserved = internal = max_tail = 0
        for req in sched.running:
            computed = req.num_computed_tokens
            slots = kv.get_num_blocks(req) * block_size
            tail = slots - computed  # allocated but not yet holding KV: all in the last block
            eventual = min(slots, kv_len[req.request_id])
            logical_tokens += computed
            logical_blocks += slots // block_size
            reserved += eventual - computed
            internal += slots - eventual
            max_tail = max(max_tail, tail)
        used_blocks = num_usable - kv.num_free_blocks
        # Shared blocks are full prompt blocks (only full blocks are hashed and hit), so
        # each extra holder of a block counts block_size tokens that are stored once.
        token_states = logical_tokens - (logical_blocks - used_blocks) * block_size
        free = kv.num_free_blocks * block_size
        assert token_states + reserved + internal + free == budget, (
            "paged accounting does not add up to the pool: a block is counted twice or lost"
        )
        log.add(
            token_states=token_states,
            reserved=reserved,
            internal_frag=internal,
            external_frag=0,
            free=free,
            batch_size=len(sched.running),
            waiting=len(sched.waiting),
            logical_tokens=logical_tokens,
            logical_blocks=logical_blocks,
            used_blocks=used_blocks,
            max_tail_waste=max_tail,
        )
        if record_occupancy:
            occupancy.append(block_states(kv))
        if snapshot_request is not None and snapshot_request in sched.requests:
            req = sched.requests[snapshot_request]
            if req in sched.running:
                snapshot = _snapshot(kv, req, len(log.cols["batch_size"]) - 1)
        if check_invariants:
            kv.check_invariants()

        sampled = {}
        for seq in out.scheduled:
            req = sched.requests[seq.req_id]
            if req.num_computed_tokens >= req.num_tokens:
                sampled[seq.req_id] = dummy_token(req)
        sched.update_from_output(out, sampled)

    kv.check_invariants()
    assert kv.num_free_blocks == num_usable, "blocks leaked: not every block is back in the pool"
    return log.finish(
        workload=workload.name,
        allocator=allocator or f"paged-{block_size}",
        kv_budget_tokens=budget,
        block_size=block_size,
        num_preemptions=sched.num_preemptions,
        num_requests=len(workload.requests),
        occupancy=np.stack(occupancy) if occupancy else None,
        block_table=snapshot,
        extra={
            "prefix_caching": enable_prefix_caching,
            "prefix_hit_tokens": num_hit_tokens,
            "free_blocks_at_end": kv.num_free_blocks,
            "usable_blocks": num_usable,
        },
    )


def _snapshot(kv: KVCacheManager, req: Request, step: int) -> dict:
    """One request's block table with each block's fill, ref count and cached flag."""
    bs = kv.block_size
    blocks = kv.get_blocks(req).blocks[0]
    return {
        "request_id": req.request_id,
        "step": step,
        "block_size": bs,
        "num_computed_tokens": req.num_computed_tokens,
        "num_prompt_tokens": req.num_prompt_tokens,
        "block_ids": [b.block_id for b in blocks],
        "filled": [max(0, min(bs, req.num_computed_tokens - i * bs)) for i in range(len(blocks))],
        "ref_cnts": [b.ref_cnt for b in blocks],
        "hashed": [b.block_hash is not None for b in blocks],
        "num_blocks": kv.num_blocks,
    }
