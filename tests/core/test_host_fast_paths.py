"""The host's decode fast paths decide exactly what the general paths decide.

KVCacheManager.allocate_slots has a fast path for one full-attention group (no new
block, or exactly one, nothing to hash, no copy on write). Two schedulers run the same
random workload, one with that fast path switched off; every step's SchedulerOutput,
every block table, hash, ref count and the free queue's order must agree. The
workload forks requests (copy on write), finishes and adds requests, and uses a small
pool so preemption happens, in both scheduling modes, with block size 1 (a token that
fills its block) too.
"""

from __future__ import annotations

import random

import pytest

from paged_jax.config import EngineConfig
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request, RequestStatus
from paged_jax.core.scheduler import Scheduler
from paged_jax.sampling_params import SamplingParams


def make_scheduler(fast: bool, *, block_size: int, num_blocks: int, async_scheduling: bool):
    config = EngineConfig(
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_seqs=8,
        max_num_batched_tokens=24,
        max_model_len=64,
        async_scheduling=async_scheduling,
    )
    # decode_fast_path=False: every call takes the general path.
    kv = KVCacheManager(num_blocks, block_size, max_model_len=64, decode_fast_path=fast)
    return Scheduler(config, kv)


def kv_state(sched: Scheduler) -> tuple:
    kv = sched.kv
    pool = kv.block_pool
    manager = kv.coordinator.managers[0]
    tables = {rid: [b.block_id for b in blocks] for rid, blocks in manager.req_to_blocks.items()}
    return (
        tables,
        dict(manager.num_cached_block),
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {rid: list(r.block_hashes) for rid, r in sched.requests.items()},
        {
            rid: (r.num_computed_tokens, r.num_output_placeholders, r.status)
            for rid, r in sched.requests.items()
        },
    )


def output_view(out) -> tuple:
    return (
        list(out.scheduled),
        dict(out.new_block_ids),
        [(r.req_id, r.token_ids, r.block_ids, r.num_computed_tokens) for r in out.new_rows],
        list(out.removed_req_ids),
        list(out.preempted_req_ids),
        list(out.block_copies),
        dict(out.replaced_block_ids),
    )


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("block_size", [1, 4])
def test_allocate_slots_fast_path_matches_general_path(async_scheduling, block_size):
    rng = random.Random(1000 * block_size + async_scheduling)
    num_blocks = 96 // block_size + 1
    pair = [
        make_scheduler(
            fast, block_size=block_size, num_blocks=num_blocks, async_scheduling=async_scheduling
        )
        for fast in (True, False)
    ]
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    in_flight = [None, None]
    counter = 0
    fast_hits = 0
    for step in range(400):
        # New requests (some share a prefix, so prefix hits happen), and forks.
        if rng.random() < 0.3 and len(pair[0].requests) < 12:
            prompt = rng.choice(prefixes)[: rng.randint(1, 12)] + [
                rng.randrange(50) for _ in range(rng.randint(0, 10))
            ]
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=True)
            for sched in pair:
                sched.add_request(Request(f"q{counter}", prompt, params))
            counter += 1
        running = [r for r in pair[0].running if r.num_computed_tokens > 0]
        if (
            running
            and rng.random() < 0.1
            and len(pair[0].running) < 8
            and in_flight[0] is None
            and not len(pair[0].kv.pending_copies)
        ):
            parent = rng.choice(running)
            child_id = f"f{counter}"
            counter += 1
            for sched in pair:
                p = sched.requests[parent.request_id]
                if p.num_output_placeholders:
                    break
                sched.fork_request(p.request_id, p.fork(child_id))
        outs = [sched.schedule() for sched in pair]
        assert output_view(outs[0]) == output_view(outs[1]), f"step {step}"
        assert kv_state(pair[0]) == kv_state(pair[1]), f"step {step}"
        fast_hits += sum(s.num_new_tokens == 1 for s in outs[0].scheduled)
        # Read outputs (one step late with async scheduling) with the same tokens.
        ready = outs
        if async_scheduling:
            ready, in_flight = in_flight, outs
        if ready[0] is not None:
            tokens = {s.req_id: rng.randrange(50) for s in ready[0].scheduled if s.samples}
            finished = [sched.update_from_output(o, tokens) for sched, o in zip(pair, ready)]
            assert [r.request_id for r in finished[0]] == [r.request_id for r in finished[1]]
        # Random aborts.
        live = sorted(pair[0].requests)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            for sched in pair:
                sched.finish_request(victim, RequestStatus.FINISHED_ABORTED)
        assert kv_state(pair[0]) == kv_state(pair[1]), f"step {step}"
        for sched in pair:
            sched.kv.check_invariants()
    assert fast_hits > 300
    assert pair[0].num_preemptions > 0
