"""Random allocate / append / prefix-hit / free / preempt sequences keep every invariant.

A hypothesis RuleBasedStateMachine drives a KVCacheManager on a 13-block pool the
way a scheduler would and, after every step, checks the pool against an
independent model: free + used == usable blocks, each block's ref_cnt equals the
number of live requests whose table holds it, the null block is never handed
out, only full blocks are hashed (with the request's own chained hash), and the
hash map agrees with the blocks. The test asserts that >= 2,000 steps ran.
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

BS = 4
NUM_BLOCKS = 13
MAX_MODEL_LEN = 48
# A few shared prefixes make prefix hits (and their revival from the free queue) common.
PREFIXES = [list(range(100, 112)), list(range(200, 208)), [7] * 8]

# Counters over the whole run, so the test can check the interesting paths ran.
STEPS = {"count": 0, "hits": 0, "revived": 0, "refused": 0, "preempted": 0, "reset": 0}


class KVCacheManagerMachine(RuleBasedStateMachine):
    @initialize(caching=st.booleans(), algo=st.sampled_from(["sha256", "xxhash"]))
    def setup(self, caching, algo):
        self.m = KVCacheManager(
            NUM_BLOCKS,
            BS,
            enable_prefix_caching=caching,
            hash_algo=algo,
            max_model_len=MAX_MODEL_LEN,
        )
        self.ids = itertools.count()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.tables: dict[str, list[int]] = {}  # the model's copy of each block table

    # -- rules ------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES) + 1)),
        cut=st.integers(0, 12),
        suffix=st.lists(st.integers(0, 3), max_size=24),
        salt=st.sampled_from([None, None, "s"]),
    )
    def add_request(self, prefix, cut, suffix, salt):
        tokens = (PREFIXES[prefix][:cut] if prefix < len(PREFIXES) else []) + suffix
        if not tokens:
            tokens = [1]
        self.waiting.append(Request(f"r{next(self.ids)}", tokens, cache_salt=salt))

    @rule(keep=st.integers(0, 3))
    def hog(self, keep):
        """Admit a request of unique tokens that leaves only `keep` free blocks."""
        num_blocks = min(self.m.num_free_blocks - keep, (MAX_MODEL_LEN - 1) // BS)
        if num_blocks <= 0:
            return
        n = next(self.ids)
        req = Request(f"hog{n}", [10_000 + n] * (num_blocks * BS))
        assert self.m.allocate_slots(req, req.num_tokens) is not None
        req.num_computed_tokens = req.num_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.tables[req.request_id] = self.m.get_block_ids(req)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 24))
    def admit(self, data, chunk):
        req = data.draw(st.sampled_from(self.waiting))
        if req.num_tokens >= MAX_MODEL_LEN:
            self.waiting.remove(req)
            return
        free_before = self.m.num_free_blocks
        refs_before = [b.ref_cnt for b in self.m.block_pool.blocks]
        hits, num_hit = self.m.get_computed_blocks(req)
        assert num_hit % BS == 0 and num_hit <= req.num_tokens - 1
        assert [b.ref_cnt for b in self.m.block_pool.blocks] == refs_before
        num_new = min(req.num_tokens - num_hit, chunk)
        num_free_hits = sum(1 for b in hits.blocks[0] if b.ref_cnt == 0)
        new = self.m.allocate_slots(req, num_new, num_hit, hits)
        if new is None:
            STEPS["refused"] += 1
            # All or nothing: nothing changed.
            assert self.m.num_free_blocks == free_before
            assert [b.ref_cnt for b in self.m.block_pool.blocks] == refs_before
            assert self.m.get_block_ids(req) == []
            return
        STEPS["hits"] += num_hit > 0
        STEPS["revived"] += num_free_hits
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_hit + num_new
        table = hits.get_block_ids()[0] + new.get_block_ids()[0]
        assert self.m.get_block_ids(req) == table
        self.tables[req.request_id] = table

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 24), num_out=st.integers(1, 3))
    def step(self, data, chunk, num_out):
        """Continue a chunked prefill, or append outputs and decode them."""
        req = data.draw(st.sampled_from(self.running))
        if req.num_computed_tokens == req.num_tokens:
            if req.num_tokens + num_out > MAX_MODEL_LEN:
                self._finish(req)
                return
            req.append_output_token_ids(
                data.draw(st.lists(st.integers(0, 3), min_size=num_out, max_size=num_out))
            )
        num_new = min(req.num_tokens - req.num_computed_tokens, chunk)
        new = self.m.allocate_slots(req, num_new)
        if new is None:
            self._preempt(req)
            return
        self.tables[req.request_id] += new.get_block_ids()[0]
        assert self.m.get_block_ids(req) == self.tables[req.request_id]
        req.num_computed_tokens += num_new

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        self._finish(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.running)
    @rule()
    def preempt_latest(self):
        self._preempt(self.running[-1])

    @rule(roll=st.integers(0, 4))
    def reset_prefix_cache(self, roll):
        if roll:  # keep resets rare so cached prefixes live long enough to be hit
            return
        in_use = any(self.tables.values())
        assert self.m.reset_prefix_cache() is (not in_use)
        STEPS["reset"] += not in_use

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

    # -- invariants ---------------------------------------------------------

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
            assert 0 not in table, "the null block was handed out"
            for block_id in table:
                holders[block_id] += 1
        assert [b.ref_cnt for b in pool.blocks[1:]] == holders[1:]
        used = sum(1 for h in holders[1:] if h)
        assert m.num_free_blocks + used == NUM_BLOCKS - 1
        for req in self.running:
            table = self.tables[req.request_id]
            assert m.get_block_ids(req) == table
            for i, block_id in enumerate(table):
                block = pool.blocks[block_id]
                if block.block_hash is not None:
                    # Only full blocks, under the request's own chained hash.
                    assert (i + 1) * BS <= req.num_tokens
                    assert get_block_hash(block.block_hash) == req.block_hashes[i]
        for req in self.waiting:
            assert m.get_block_ids(req) == []


def test_random_sequences_keep_invariants():
    STEPS.update(dict.fromkeys(STEPS, 0))
    run_state_machine_as_test(
        KVCacheManagerMachine,
        settings=settings(
            max_examples=150,
            stateful_step_count=60,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    assert STEPS["count"] >= 2000, f"only {STEPS['count']} state-machine steps ran"
    # The run must have exercised hits, revivals from the free queue, refusals,
    # preemptions and successful resets.
    assert min(STEPS.values()) > 0, STEPS
