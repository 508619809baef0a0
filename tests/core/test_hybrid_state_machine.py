"""Random scheduler-like sequences on sliding-window and hybrid KV groups keep every invariant.

A hypothesis RuleBasedStateMachine drives a KVCacheManager whose groups are drawn from
{window only, full + window, full + two windows} on a 25-block pool, and after every step
checks it against its own model of the tables: free + used == usable blocks; each block's
ref_cnt equals the number of (request, group) tables holding it; the null block only
fills the leading out-of-window run of a window table, exactly the blocks wholly below
n - W + 1 for the last computed count n; hashes only on full blocks (the request's own);
every hit has one length for all groups and its window groups hold the blocks the first
new token reads; refused allocations change nothing. The test asserts >= 1,500 steps ran.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from paged_jax import KVCacheManager, Request, RequestStatus
from paged_jax.core.hashing import get_block_hash
from paged_jax.core.kv_cache_spec import KVCacheGroupSpec

BS = 4
NUM_BLOCKS = 25
MAX_MODEL_LEN = 48
GROUP_SETS = {
    "window": (KVCacheGroupSpec(6, (0,)),),
    "full+window": (KVCacheGroupSpec(None, (0,)), KVCacheGroupSpec(8, (1,))),
    "full+2windows": (
        KVCacheGroupSpec(None, (0,)),
        KVCacheGroupSpec(5, (1,)),
        KVCacheGroupSpec(12, (2,)),
    ),
}
PREFIXES = [list(range(100, 124)), list(range(200, 212)), [7] * 12]
STEPS = {"count": 0, "hits": 0, "revived": 0, "refused": 0, "recycled": 0, "preempted": 0}


def num_dead_blocks(window: int | None, num_computed: int) -> int:
    """Blocks wholly below num_computed - W + 1 (what a step from num_computed frees)."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // BS


class HybridMachine(RuleBasedStateMachine):
    @initialize(caching=st.booleans(), name=st.sampled_from(sorted(GROUP_SETS)))
    def setup(self, caching, name):
        self.groups = GROUP_SETS[name]
        self.m = KVCacheManager(
            NUM_BLOCKS,
            BS,
            enable_prefix_caching=caching,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_groups=self.groups,
        )
        self.ids = itertools.count()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.tables: dict[str, list[list[int]]] = {}  # per request, per group
        self.last_n: dict[str, int] = {}  # computed count passed to the last allocate

    def _refs(self):
        return [b.ref_cnt for b in self.m.block_pool.blocks]

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES) + 1)),
        cut=st.integers(0, 24),
        suffix=st.lists(st.integers(0, 3), max_size=16),
    )
    def add_request(self, prefix, cut, suffix):
        tokens = (PREFIXES[prefix][:cut] if prefix < len(PREFIXES) else []) + suffix
        self.waiting.append(Request(f"r{next(self.ids)}", tokens or [1]))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 24))
    def admit(self, data, chunk):
        req = data.draw(st.sampled_from(self.waiting))
        if req.num_tokens >= MAX_MODEL_LEN:
            self.waiting.remove(req)
            return
        free_before, refs_before = self.m.num_free_blocks, self._refs()
        hits, num_hit = self.m.get_computed_blocks(req)
        assert self._refs() == refs_before, "a lookup changed ref counts"
        assert num_hit % BS == 0 and num_hit <= req.num_tokens - 1
        hit_ids = hits.get_block_ids()
        assert len(hit_ids) == len(self.groups)
        for group, ids in zip(self.groups, hit_ids):
            assert len(ids) == num_hit // BS, "every group's hit has the hit's length"
            # The first new token (position num_hit) reads keys from num_hit - W + 1 on:
            # those blocks are real and hold this request's own chained hash.
            first_read = num_dead_blocks(group.sliding_window, num_hit)
            for i in range(first_read, len(ids)):
                block = self.m.block_pool.blocks[ids[i]]
                assert ids[i] != 0 and get_block_hash(block.block_hash) == req.block_hashes[i]
        num_new = min(req.num_tokens - num_hit, chunk)
        num_free_hits = sum(1 for g in hits.blocks for b in g if b.ref_cnt == 0 and not b.is_null)
        new = self.m.allocate_slots(req, num_new, num_hit, hits)
        if new is None:
            STEPS["refused"] += 1
            assert self.m.num_free_blocks == free_before
            assert self._refs() == refs_before
            assert self.m.get_block_ids_per_group(req) == tuple([] for _ in self.groups)
            return
        STEPS["hits"] += num_hit > 0
        STEPS["revived"] += num_free_hits
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_hit + num_new
        self.last_n[req.request_id] = num_hit
        self.tables[req.request_id] = [h + n for h, n in zip(hit_ids, new.get_block_ids())]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 24), num_out=st.integers(1, 3))
    def step(self, data, chunk, num_out):
        req = data.draw(st.sampled_from(self.running))
        if req.num_computed_tokens == req.num_tokens:
            if req.num_tokens + num_out > MAX_MODEL_LEN:
                self._finish(req)
                return
            req.append_output_token_ids(
                data.draw(st.lists(st.integers(0, 3), min_size=num_out, max_size=num_out))
            )
        num_new = min(req.num_tokens - req.num_computed_tokens, chunk)
        n = req.num_computed_tokens
        # The model: out-of-window entries become null before the allocation (even if
        # it then fails).
        table = self.tables[req.request_id]
        for group, ids in zip(self.groups, table):
            dead = num_dead_blocks(group.sliding_window, n)
            STEPS["recycled"] += sum(1 for i in range(min(dead, len(ids))) if ids[i])
            ids[:dead] = [0] * min(dead, len(ids))
        self.last_n[req.request_id] = n
        new = self.m.allocate_slots(req, num_new)
        if new is None:
            self._preempt(req)
            return
        for ids, added in zip(table, new.get_block_ids()):
            ids += added
        req.num_computed_tokens += num_new

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        self._finish(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.running)
    @rule()
    def preempt_latest(self):
        self._preempt(self.running[-1])

    def _finish(self, req):
        self.m.free(req)
        self.running.remove(req)
        del self.tables[req.request_id]
        req.status = RequestStatus.FINISHED_STOPPED

    def _preempt(self, req):
        self.m.free(req)
        self.running.remove(req)
        del self.tables[req.request_id]
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        STEPS["preempted"] += 1
        self.waiting.insert(0, req)

    @invariant()
    def check(self):
        if not hasattr(self, "m"):
            return
        STEPS["count"] += 1
        m = self.m
        m.check_invariants()
        pool = m.block_pool
        holders = [0] * NUM_BLOCKS
        for table in self.tables.values():
            for ids in table:
                for block_id in ids:
                    holders[block_id] += block_id != 0
        assert [b.ref_cnt for b in pool.blocks[1:]] == holders[1:]
        assert m.num_free_blocks + sum(1 for h in holders[1:] if h) == NUM_BLOCKS - 1
        for req in self.running:
            table = self.tables[req.request_id]
            assert m.get_block_ids_per_group(req) == tuple(table)
            n = self.last_n[req.request_id]
            for group, ids in zip(self.groups, table):
                dead = num_dead_blocks(group.sliding_window, n)
                # Nulls exactly below the window (a hit pads exactly as many too).
                assert all(b == 0 for b in ids[:dead]) and all(b != 0 for b in ids[dead:])
                assert len(ids) == -(-req.num_computed_tokens // BS)
                for i, block_id in enumerate(ids):
                    block = pool.blocks[block_id]
                    if block_id and block.block_hash is not None:
                        assert (i + 1) * BS <= req.num_tokens
                        assert get_block_hash(block.block_hash) == req.block_hashes[i]
        for req in self.waiting:
            assert m.get_block_ids_per_group(req) == tuple([] for _ in self.groups)


def test_random_hybrid_sequences_keep_invariants():
    STEPS.update(dict.fromkeys(STEPS, 0))
    run_state_machine_as_test(
        HybridMachine,
        settings=settings(
            max_examples=90,
            stateful_step_count=50,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    assert STEPS["count"] >= 1500, f"only {STEPS['count']} state-machine steps ran"
    assert min(STEPS.values()) > 0, STEPS
