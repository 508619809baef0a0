"""Random allocate / append / prefix-hit / fork / free / preempt sequences keep every invariant.

A hypothesis RuleBasedStateMachine drives a KVCacheManager on a 13-block pool the
way a scheduler would and, after every step, checks the pool against an
independent model: free + used == usable blocks, each block's ref_cnt equals the
number of live requests whose table holds it (plus the holds of pending
copy-on-write copies), the null block is never handed out, only full blocks are
hashed (with the request's own chained hash), and the hash map agrees with the
blocks.

Forks share blocks; the model predicts every copy-on-write (a write into a block
that another table holds) and checks that no block is written while shared. A
simulated device applies each round's copies, then its KV writes, to per-block
token contents, and every running request must read its own tokens back through
its table, so a missed or misdirected copy shows up as a wrong token. The test
asserts that >= 2,000 steps ran.

A round may also fail, as an engine step that raises: none of its copies or writes
run, every running request goes back to waiting holding nothing, and the blocks the
round hashed (take_newly_cached_blocks) lose their hashes (uncache_blocks). Between
rounds, every hashed block must hold the tokens its hash was computed from: no prefix
hit can serve KV that was never written.
"""

from __future__ import annotations

import collections
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
from paged_jax.core.copy_on_write import max_copies_per_step
from paged_jax.core.hashing import get_block_hash

BS = 4
NUM_BLOCKS = 13
MAX_MODEL_LEN = 48
# A few shared prefixes make prefix hits (and their revival from the free queue) common.
PREFIXES = [list(range(100, 112)), list(range(200, 208)), [7] * 8]

# Counters over the whole run, so the test can check the interesting paths ran.
STEPS = {
    "count": 0,
    "hits": 0,
    "revived": 0,
    "refused": 0,
    "preempted": 0,
    "reset": 0,
    "forks": 0,
    "copies": 0,
    "rounds_with_holds": 0,
    "failed_rounds": 0,
    "spec_rollbacks": 0,
}


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
        # The simulated device: token per (block, offset); this round's copies and writes.
        self.content: dict[int, list[int | None]] = collections.defaultdict(lambda: [None] * BS)
        self.expected_copies: list[tuple[int, int]] = []
        self.pending_writes: list[tuple[int, int, int]] = []
        self.in_round: set[str] = set()
        self.m.take_newly_cached_blocks()  # from now on, each round's hashed blocks
        self.tokens_of: dict[bytes, list[int]] = {}  # block hash -> the block's tokens

    # -- the simulated device and the model's predictions ---------------------

    def _holders(self) -> collections.Counter:
        return collections.Counter(b for t in self.tables.values() for b in t)

    def _allocate(self, req, num_new, num_hit=0, hits=None, drafts=()):
        """allocate_slots plus the model's check of its copy-on-writes; queues the writes
        (of the request's tokens, then of speculative drafts past them)."""
        if req.request_id in self.in_round:
            self.device_step()  # one allocation per request per round, as a scheduler does
        before = list(self.tables.get(req.request_id, []))
        holders = self._holders()
        if hits is None:
            new = self.m.allocate_slots(req, num_new)
        else:
            new = self.m.allocate_slots(req, num_new, num_hit, hits)
        if new is None:
            return None
        start = req.num_computed_tokens + num_hit
        end = start + num_new
        after = self.m.get_block_ids(req)
        written = range(start // BS, -(-end // BS))
        for i, (old, now) in enumerate(zip(before, after)):
            shared = i in written and holders[old] > 1
            if not shared:
                assert now == old, f"block {old} at slot {i} was replaced without a write"
                continue
            assert holders[now] == 0 and now not in before, f"copy target {now} is in use"
            self.expected_copies.append((old, now))
        assert (
            after[len(before) :]
            == (hits.get_block_ids()[0] if hits else []) + (new.get_block_ids()[0])
        )
        self.tables[req.request_id] = after
        self.in_round.add(req.request_id)
        pool = self.m.block_pool
        for pos in range(start, end):
            block_id = after[pos // BS]
            # No block is written while another request holds it.
            assert self.m.pending_copies.num_holders(pool.blocks[block_id]) == 1
            known = req.all_token_ids
            token = known[pos] if pos < len(known) else drafts[pos - len(known)]
            self.pending_writes.append((block_id, pos % BS, token))
        return new

    def device_step(self):
        """Packs the round: takes the copies, runs them, then the round's KV writes."""
        holders = self._holders()
        copies = self.m.take_pending_copies()
        expected = [(s, d) for s, d in self.expected_copies if holders[d] > 0]
        assert copies.pairs == expected
        # One copy at most per request that allocated this round (one KV-cache group).
        assert len(copies.pairs) <= max_copies_per_step(len(self.in_round), 1)
        dsts = [d for _, d in copies.pairs]
        assert len(set(dsts)) == len(dsts) and not set(dsts) & {s for s, _ in copies.pairs}
        STEPS["copies"] += len(copies.pairs)
        STEPS["rounds_with_holds"] += len(self.in_round) > 1 and bool(copies.pairs)
        sources = {s: list(self.content[s]) for s, _ in copies.pairs}
        for s, d in copies.pairs:
            self.content[d] = list(sources[s])
        for block_id, offset, token in self.pending_writes:
            self.content[block_id][offset] = token
        self.expected_copies = []
        self.pending_writes = []
        self.in_round = set()
        self.m.take_newly_cached_blocks()  # their KV is written now

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
        assert self._allocate(req, req.num_tokens) is not None
        req.num_computed_tokens = req.num_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)

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
        new = self._allocate(req, num_new, num_hit, hits)
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
        assert self.m.get_block_ids(req) == hits.get_block_ids()[0] + new.get_block_ids()[0]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 24), num_out=st.integers(1, 3))
    def step(self, data, chunk, num_out):
        """Continue a chunked prefill, or append outputs and decode them."""
        self._advance(data.draw(st.sampled_from(self.running)), data, chunk, num_out)

    def _advance(self, req, data, chunk, num_out):
        if req.num_computed_tokens == req.num_tokens:
            if req.num_tokens + num_out > MAX_MODEL_LEN:
                self._finish(req)
                return
            req.append_output_token_ids(
                data.draw(st.lists(st.integers(0, 3), min_size=num_out, max_size=num_out))
            )
        num_new = min(req.num_tokens - req.num_computed_tokens, chunk)
        new = self._allocate(req, num_new)
        if new is None:
            self._preempt(req)
            return
        req.num_computed_tokens += num_new

    @precondition(lambda self: any(r.num_computed_tokens == r.num_tokens for r in self.running))
    @rule(
        data=st.data(),
        drafts=st.lists(st.integers(0, 3), min_size=1, max_size=6),
        accept=st.integers(0, 6),
    )
    def speculate(self, data, drafts, accept):
        """A decode step that verifies drafts, then keeps `accept` of them plus one token:
        the rejected drafts' KV stays unread, their tail blocks go back to the pool
        (free_tail_blocks), and only known tokens are ever hashed."""
        req = data.draw(
            st.sampled_from([r for r in self.running if r.num_computed_tokens == r.num_tokens])
        )
        if req.num_tokens + len(drafts) + 2 > MAX_MODEL_LEN:
            self._finish(req)
            return
        req.append_output_token_ids(data.draw(st.integers(0, 3)))  # the next known token
        if self._allocate(req, 1 + len(drafts), drafts=drafts) is None:
            self._preempt(req)
            return
        req.num_computed_tokens += 1 + len(drafts)
        self.device_step()
        kept = drafts[: min(accept, len(drafts))]
        req.append_output_token_ids([*kept, data.draw(st.integers(0, 3))])
        req.num_computed_tokens = req.num_tokens - 1
        freed = self.m.free_tail_blocks(req, req.num_tokens)
        self.tables[req.request_id] = self.m.get_block_ids(req)
        assert len(self.tables[req.request_id]) <= -(-req.num_tokens // BS)
        STEPS["spec_rollbacks"] += freed > 0

    @precondition(lambda self: self.running)
    @rule(
        data=st.data(),
        tail=st.lists(st.integers(0, 3), min_size=1, max_size=3),
        same_round=st.booleans(),
    )
    def fork(self, data, tail, same_round):
        """Fork a running request between steps; the child diverges after the shared part.

        With `same_round`, child and parent then both advance in the next round, the way a
        scheduler steps every running sequence: a write into their shared partial block is
        held as a copy while the other request allocates in the same round.
        """
        self.device_step()
        # Prefer parents with a partial last block: those forks copy on write.
        partial = [r for r in self.running if r.num_computed_tokens % BS]
        parent = data.draw(st.sampled_from(partial or self.running))
        k = parent.num_computed_tokens
        if k + len(tail) >= MAX_MODEL_LEN:
            return
        cid = f"f{next(self.ids)}"
        if k >= parent.num_prompt_tokens:
            child = parent.fork(cid, parent.output_token_ids[: k - parent.num_prompt_tokens] + tail)
        else:
            child = Request(cid, parent.all_token_ids[:k] + tail, cache_salt=parent.cache_salt)
        num_shared = self.m.fork(parent, child)
        assert num_shared <= k and (num_shared == k or num_shared % BS == 0)
        child.num_computed_tokens = num_shared
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        table = self.m.get_block_ids(child)
        assert table == self.tables[parent.request_id][: -(-num_shared // BS)]
        self.tables[cid] = table
        STEPS["forks"] += 1
        if same_round:
            for req in (child, parent):
                if req in self.running:  # advancing the child may preempt the parent
                    self._advance(req, data, chunk=1, num_out=1)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        self._finish(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.running)
    @rule()
    def preempt_latest(self):
        self._preempt(self.running[-1])

    @rule()
    def run_device_step(self):
        self.device_step()

    @precondition(lambda self: self.in_round)
    @rule()
    def failed_round(self):
        """The round's device step fails before it writes anything (the engine's rollback)."""
        self.m.take_pending_copies()  # the step would have run them: never now
        hashed = self.m.take_newly_cached_blocks()
        for req in reversed(self.running):
            self.m.free(req)
            del self.tables[req.request_id]
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            self.waiting.insert(0, req)
        self.running = []
        self.expected_copies = []
        self.pending_writes = []
        self.in_round = set()
        self.m.uncache_blocks(hashed)
        STEPS["failed_rounds"] += 1

    @rule(roll=st.integers(0, 4))
    def reset_prefix_cache(self, roll):
        if roll:  # keep resets rare so cached prefixes live long enough to be hit
            return
        self.device_step()
        in_use = any(self.tables.values())
        assert self.m.reset_prefix_cache() is (not in_use)
        STEPS["reset"] += not in_use

    def _finish(self, req):
        self.device_step()  # requests end between steps
        self.m.free(req)
        self.running.remove(req)
        del self.tables[req.request_id]
        req.status = RequestStatus.FINISHED_STOPPED

    def _preempt(self, req):
        self.device_step()
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
        holds = collections.Counter()
        for src, dst in self.expected_copies:
            holds[src] += 1
            holds[dst] += 1
        assert [b.ref_cnt for b in pool.blocks[1:]] == [
            holders[i] + holds[i] for i in range(1, NUM_BLOCKS)
        ]
        used = sum(1 for i in range(1, NUM_BLOCKS) if holders[i] + holds[i])
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
        for req in itertools.chain(self.running, self.waiting):
            for i, h in enumerate(req.block_hashes):
                self.tokens_of[h] = req.all_token_ids[i * BS : (i + 1) * BS]
        if not self.pending_writes:
            # No hashed block without written KV.
            for key, block in pool.cached_block_hash_to_block.items():
                want = self.tokens_of[get_block_hash(key)]
                assert self.content[block.block_id] == want, (
                    f"block {block.block_id} is cached for {want} but holds "
                    f"{self.content[block.block_id]}"
                )
        if not self.pending_writes and not self.expected_copies:
            # Every running request reads its own tokens back through its table.
            for req in self.running:
                table = self.tables[req.request_id]
                got = [self.content[table[p // BS]][p % BS] for p in range(req.num_computed_tokens)]
                assert got == req.all_token_ids[: req.num_computed_tokens], req.request_id


def test_random_sequences_keep_invariants():
    STEPS.update(dict.fromkeys(STEPS, 0))
    run_state_machine_as_test(
        KVCacheManagerMachine,
        settings=settings(
            max_examples=300,
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


def test_fork_after_accepted_drafts_hashes_each_block_once():
    """A speculative step fills a block with accepted tokens it allocated unhashed (its
    drafts were unknown then); a fork right after, then parent and child advancing in the
    same round, must hash that block once (found by the machine above: 'block cached
    twice: num_cached_blocks is stale')."""
    m = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=True, max_model_len=MAX_MODEL_LEN)
    parent = Request("p", list(range(36)))
    assert m.allocate_slots(parent, 36) is not None
    parent.num_computed_tokens = 36
    parent.append_output_token_ids(1)  # the next known token, then 3 drafts verified
    assert m.allocate_slots(parent, 4) is not None
    parent.num_computed_tokens = 40
    parent.append_output_token_ids([2, 3, 4, 5])  # 3 drafts accepted + 1 emitted
    parent.num_computed_tokens = parent.num_tokens - 1
    m.free_tail_blocks(parent, parent.num_tokens)
    child = Request("c", parent.all_token_ids[:40] + [9])
    child.num_computed_tokens = m.fork(parent, child)
    for req in (parent, child):  # one round: both write their next token
        assert m.allocate_slots(req, req.num_tokens - req.num_computed_tokens) is not None
    hashed = [b for b in m.get_blocks(parent).blocks[0] if b.block_hash is not None]
    assert len(hashed) == 10  # blocks 0-9: the 40 tokens both share, each hashed once
    m.free(parent)
    m.free(child)
    assert m.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
