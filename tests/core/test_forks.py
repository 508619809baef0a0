"""Forks and copy-on-write in KVCacheManager and Scheduler: exact ids on an 11-block pool.

Expected ids follow the free-queue rules: a fresh pool hands out ids in
order; a copy-on-write destination is the next free-queue head; freed unhashed
blocks return to the head (last block first), hashed ones to the tail.
"""

from __future__ import annotations

import pytest

from paged_jax import KVCacheManager, Request
from paged_jax.config import EngineConfig
from paged_jax.core.hashing import get_block_hash
from paged_jax.core.request import RequestStatus
from paged_jax.core.scheduler import Scheduler
from paged_jax.sampling_params import SamplingParams

BS = 4


def make_manager(num_blocks: int = 11, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, max_model_len=64, **kwargs)


def free_ids(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def refs(m: KVCacheManager, ids) -> list[int]:
    return [m.block_pool.blocks[i].ref_cnt for i in ids]


def prefilled(m: KVCacheManager, rid: str, prompt: list[int], sampled: int) -> Request:
    """A request whose prompt is computed and whose first sampled token is appended."""
    req = Request(rid, prompt)
    assert m.allocate_slots(req, req.num_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    req.append_output_token_ids(sampled)
    return req


def decode(m: KVCacheManager, req: Request, token: int | None = None):
    """Schedules the request's one uncomputed token (then appends `token` if given)."""
    new = m.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    if token is not None:
        req.append_output_token_ids(token)
    return new


def test_fork_shares_full_and_partial_blocks_and_the_first_write_copies():
    m = make_manager()
    parent = prefilled(m, "p", list(range(100, 110)), 7)  # 10 tokens: blocks 1, 2, 3 (2 used)
    assert m.get_block_ids(parent) == [1, 2, 3]
    child = parent.fork("c", [8])  # same prompt, a different first output
    assert m.fork(parent, child) == 10
    child.num_computed_tokens = 10
    assert m.get_block_ids(child) == [1, 2, 3]
    assert refs(m, [1, 2, 3]) == [2, 2, 2]
    assert child.block_hashes == parent.block_hashes  # copied, same tokens in full blocks
    m.check_invariants()

    # The child writes position 10 into shared block 3: copy into the free head, block 4.
    decode(m, child)
    assert m.get_block_ids(child) == [1, 2, 4]
    # Until the step is packed the writer's old reference is a hold: no ref count moves.
    assert refs(m, [1, 2, 3, 4]) == [2, 2, 2, 2]
    m.check_invariants()
    copies = m.take_pending_copies()
    assert copies.pairs == [(3, 4)]
    assert copies.table_updates == {"c": [(0, 2, 4)]}
    assert refs(m, [1, 2, 3, 4]) == [2, 2, 1, 1]
    # The parent is now block 3's only holder: it writes in place, nothing to copy.
    decode(m, parent)
    assert m.get_block_ids(parent) == [1, 2, 3]
    assert m.take_pending_copies().pairs == []
    m.check_invariants()

    # Freeing is per request: the shared full blocks outlive the parent.
    m.free(parent)
    assert refs(m, [1, 2, 3, 4]) == [1, 1, 0, 1]
    m.free(child)
    assert m.num_free_blocks == 10
    m.check_invariants()


def test_block_aligned_fork_shares_only_full_blocks_and_copies_nothing():
    m = make_manager()
    parent = prefilled(m, "p", list(range(8)), 1)
    child = parent.fork("c", [2])
    child.num_computed_tokens = m.fork(parent, child)
    decode(m, child)
    decode(m, parent)
    assert m.take_pending_copies().pairs == []
    assert m.get_block_ids(parent) == [1, 2, 4] and m.get_block_ids(child) == [1, 2, 3]
    m.check_invariants()


def test_forked_blocks_are_hashed_when_full_and_hit_by_later_requests():
    m = make_manager()
    parent = prefilled(m, "p", list(range(100, 106)), 7)  # blocks 1 (full), 2 (2 + 1 tokens)
    child = parent.fork("c", [9])
    child.num_computed_tokens = m.fork(parent, child)
    decode(m, child, 10)  # position 6 -> copy of block 2 into 3
    decode(m, child, 11)  # position 7 fills block 3: hashed under the child's chain
    assert m.take_pending_copies().pairs == [(2, 3)]
    block3 = m.block_pool.blocks[3]
    assert get_block_hash(block3.block_hash) == child.block_hashes[1]
    assert m.block_pool.blocks[2].block_hash is None  # the parent's partial block
    m.check_invariants()
    # A new request with the child's tokens hits both of the child's full blocks.
    later = Request("later", child.all_token_ids[:8] + [0])
    hits, num_hit = m.get_computed_blocks(later)
    assert num_hit == 8 and hits.get_block_ids() == ([1, 3],)


def test_fork_at_a_hashed_block_recomputes_it_instead_of_sharing_it():
    m = make_manager()
    parent = prefilled(m, "p", list(range(8)), 5)  # blocks 1, 2 both full and hashed
    child = Request("c", list(range(7)) + [99])  # differs at position 7
    assert m.fork(parent, child, num_tokens=7) == 4  # block 2 is not the child's
    assert m.get_block_ids(child) == [1]
    m.check_invariants()


def test_a_copy_needs_a_free_block_or_nothing_changes():
    m = make_manager(num_blocks=5)  # 4 usable
    parent = prefilled(m, "p", list(range(10)), 7)  # blocks 1, 2, 3
    hog = Request("hog", [50] * 4)
    assert m.allocate_slots(hog, 4) is not None  # block 4: the pool is empty
    child = parent.fork("c", [8])
    child.num_computed_tokens = m.fork(parent, child)
    before = refs(m, range(1, 5))
    assert m.allocate_slots(child, 1) is None
    assert refs(m, range(1, 5)) == before and m.get_block_ids(child) == [1, 2, 3]
    assert len(m.pending_copies) == 0
    m.free(hog)
    assert m.allocate_slots(child, 1) is not None
    assert m.get_block_ids(child) == [1, 2, 4]


def test_writer_freed_in_the_same_round_drops_its_copy_and_blocks_stay_held():
    m = make_manager()
    parent = prefilled(m, "p", list(range(10)), 7)
    child = parent.fork("c", [8])
    child.num_computed_tokens = m.fork(parent, child)
    decode(m, child)  # copy 3 -> 4 pending
    m.free(child)  # preempted before the step ran
    m.free(parent)  # and the parent finished: block 3 now has only its hold
    # Neither block of the pending copy may be handed out again in this round.
    assert 3 not in free_ids(m) and 4 not in free_ids(m)
    m.check_invariants()
    assert m.take_pending_copies().pairs == []  # nobody reads block 4
    assert m.num_free_blocks == 10
    m.check_invariants()


def test_fork_waits_for_the_steps_copies():
    m = make_manager()
    parent = prefilled(m, "p", list(range(10)), 7)
    a = parent.fork("a", [8])
    a.num_computed_tokens = m.fork(parent, a)
    decode(m, a)  # a: block 3 -> 4, pending until the step is packed
    with pytest.raises(ValueError, match="must wait until this step's 1 pending copies"):
        m.fork(a, a.fork("b"), num_tokens=10)
    m.take_pending_copies()
    b = a.fork("b")
    assert m.fork(a, b) == 11 and m.get_block_ids(b) == [1, 2, 4]


def test_fork_rejects_bad_children():
    m = make_manager()
    parent = prefilled(m, "p", list(range(10)), 7)
    with pytest.raises(ValueError, match=r"num_tokens=11 must be in \[1, parent"):
        m.fork(parent, parent.fork("c"), num_tokens=11)
    with pytest.raises(ValueError, match="must start with the parent's first 10 token ids"):
        m.fork(parent, Request("c", [1] * 11))
    with pytest.raises(ValueError, match="child='p' must hold no blocks"):
        m.fork(parent, parent)


def make_scheduler(num_blocks=11, mode="recompute", max_num_seqs=4) -> Scheduler:
    config = EngineConfig(
        block_size=BS,
        num_kv_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=16,
        max_model_len=64,
        preemption_mode=mode,
    )
    return Scheduler(config, make_manager(num_blocks))


def run_prefill(s: Scheduler, prompt: list[int]) -> Request:
    req = Request("p", prompt, SamplingParams(max_tokens=8, temperature=0.0))
    s.add_request(req)
    out = s.schedule()
    s.update_from_output(out, {"p": 7})
    return req


def test_scheduler_fork_sends_the_child_row_and_the_copies_with_the_next_step():
    s = make_scheduler()
    parent = run_prefill(s, list(range(10)))
    child = parent.fork("c", [8])
    s.fork_request("p", child)
    assert child.status == RequestStatus.RUNNING and child.num_computed_tokens == 10
    out = s.schedule()
    assert [(q.req_id, q.num_new_tokens) for q in out.scheduled] == [("p", 1), ("c", 1)]
    # The parent writes first and copies; the child is then block 3's only holder.
    assert out.block_copies == [(3, 4)]
    assert out.replaced_block_ids == {"p": [(0, 2, 4)]}
    assert [(r.req_id, r.token_ids, r.block_ids) for r in out.new_rows] == [
        ("c", list(range(10)) + [8], ([1, 2, 3],))
    ]
    s.kv.check_invariants()
    with pytest.raises(ValueError, match="parent_id='x' must name a running request"):
        s.fork_request("x", parent.fork("d"))
    with pytest.raises(ValueError, match="child.request_id='c' must be unique"):
        s.fork_request("p", parent.fork("c"))


def test_fork_respects_max_num_seqs():
    s = make_scheduler(max_num_seqs=2)
    parent = run_prefill(s, list(range(10)))
    s.fork_request("p", parent.fork("c1"))
    with pytest.raises(ValueError, match="max_num_seqs=2 requests are running"):
        s.fork_request("p", parent.fork("c2"))


def test_swap_out_in_the_round_of_a_copy_reads_the_copy_source():
    config = EngineConfig(
        block_size=BS,
        num_kv_blocks=5,  # 4 usable
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
        preemption_mode="swap",
        scheduling_policy="priority",
    )
    s = Scheduler(config, make_manager(5))
    parent = run_prefill(s, list(range(10)))  # blocks 1, 2, 3
    child = parent.fork("c", [8])
    child.priority = 1  # the first victim
    s.fork_request("p", child)
    s.running.reverse()  # the child is scheduled first
    parent.append_output_token_ids([1, 2, 3, 4, 5])  # the parent needs 2 fresh blocks
    out = s.schedule()
    # The child copied block 3 into 4 (pending), then was preempted for the parent: its
    # swap-out must read block 3, since block 4 gets its KV only when the step runs.
    assert out.preempted_req_ids[0] == "c"
    assert out.swap_out[0] == ("c", [1, 2, 3])
    assert out.block_copies == []  # nobody holds block 4 any more
    s.kv.check_invariants()
