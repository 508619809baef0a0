"""Exact-id scenarios for KVCacheManager on an 11-block pool (ids 0..10, block 0 null).

Every expected id list below is worked out by hand from these rules: fresh pools
hand out ids in order from the free queue head; a freed request's blocks go back
last block first, unhashed ones to the head and hashed ones to the tail; a prefix
hit is capped at num_tokens - 1 and rounded down to whole blocks.
"""

from __future__ import annotations

import pytest

from paged_jax import KVCacheManager, Request
from paged_jax.core.hashing import get_block_hash

BS = 4


def make_manager(num_blocks: int = 11, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, max_model_len=64, **kwargs)


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def free_ids(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def admit(m: KVCacheManager, req: Request):
    """Scheduler-style admission of a whole prompt: hit lookup, then allocate."""
    hits, num_hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return hits, num_hit, new


def test_prefill_gets_sequential_ids_and_hashes_only_full_blocks():
    m = make_manager()
    a = Request("a", tokens(100, 10))
    hits, num_hit, new = admit(m, a)
    assert num_hit == 0 and hits.get_block_ids() == ([],)
    assert new.get_block_ids() == ([1, 2, 3],)
    assert m.get_block_ids(a) == [1, 2, 3]
    blocks = m.block_pool.blocks
    # 10 tokens = two full blocks + 2 tokens in block 3.
    assert len(a.block_hashes) == 2
    assert get_block_hash(blocks[1].block_hash) == a.block_hashes[0]
    assert get_block_hash(blocks[2].block_hash) == a.block_hashes[1]
    assert blocks[3].block_hash is None
    assert [blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 1]
    assert m.num_free_blocks == 7
    assert m.usage == pytest.approx(3 / 10)
    assert free_ids(m) == [4, 5, 6, 7, 8, 9, 10]
    m.check_invariants()


def test_free_queue_order_after_free():
    m = make_manager()
    a = Request("a", tokens(100, 10))
    admit(m, a)
    m.free(a)
    # Freed in reverse [3, 2, 1]: unhashed 3 to the head, hashed 2 then 1 to the tail.
    assert free_ids(m) == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    assert m.get_block_ids(a) == []
    assert m.usage == 0.0
    m.check_invariants()


def test_decode_needs_a_block_only_when_crossing_a_boundary():
    m = make_manager()
    a = Request("a", tokens(100, 7))
    assert admit(m, a)[2].get_block_ids() == ([1, 2],)
    a.append_output_token_ids(500)  # 8 tokens: fills block 2
    new = m.allocate_slots(a, 1)
    assert new.get_block_ids() == ([],)
    a.num_computed_tokens += 1
    assert m.block_pool.blocks[2].block_hash is not None
    a.append_output_token_ids([501])  # 9 tokens: block 3 needed
    assert m.allocate_slots(a, 1).get_block_ids() == ([3],)
    assert m.get_block_ids(a) == [1, 2, 3]
    m.check_invariants()


def test_eviction_is_lru_with_the_tail_of_a_chain_first():
    m = make_manager()
    a = Request("a", tokens(100, 8))
    b = Request("b", tokens(200, 8))
    assert admit(m, a)[2].get_block_ids() == ([1, 2],)
    assert admit(m, b)[2].get_block_ids() == ([3, 4],)
    m.free(a)
    m.free(b)
    assert free_ids(m) == [5, 6, 7, 8, 9, 10, 2, 1, 4, 3]
    # 8 fresh blocks: the 6 never-used ones, then a's chain tail-first (2, 1).
    c = Request("c", tokens(300, 32))
    assert admit(m, c)[2].get_block_ids() == ([5, 6, 7, 8, 9, 10, 2, 1],)
    assert free_ids(m) == [4, 3]
    # a's prefix is gone, b's is still cached (9 tokens -> up to 8 may hit).
    assert m.get_computed_blocks(Request("a2", tokens(100, 9)))[1] == 0
    hits, num_hit = m.get_computed_blocks(Request("b2", tokens(200, 9)))
    assert (hits.get_block_ids(), num_hit) == (([3, 4],), 8)
    # One more block evicts b's tail block 4; the hit shrinks to block 3.
    d = Request("d", tokens(400, 3))
    assert admit(m, d)[2].get_block_ids() == ([4],)
    hits, num_hit = m.get_computed_blocks(Request("b3", tokens(200, 9)))
    assert (hits.get_block_ids(), num_hit) == (([3],), 4)
    m.check_invariants()


def test_prefix_hit_revives_a_free_block_without_changing_ref_counts_until_allocate():
    m = make_manager()
    a = Request("a", tokens(100, 10))
    admit(m, a)
    m.free(a)
    assert free_ids(m) == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    b = Request("b", tokens(100, 8) + [900, 901, 902])
    hits, num_hit = m.get_computed_blocks(b)
    assert (hits.get_block_ids(), num_hit) == (([1, 2],), 8)
    # get_computed_blocks changes nothing.
    assert [m.block_pool.blocks[i].ref_cnt for i in (1, 2)] == [0, 0]
    assert free_ids(m) == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    new = m.allocate_slots(b, 3, num_hit, hits)
    assert new.get_block_ids() == ([3],)
    assert m.get_block_ids(b) == [1, 2, 3]
    assert [m.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 1]
    assert free_ids(m) == [4, 5, 6, 7, 8, 9, 10]
    m.check_invariants()


def test_allocation_is_all_or_nothing_and_counts_free_hit_blocks_as_capacity():
    m = make_manager()
    a = Request("a", tokens(100, 8))
    admit(m, a)
    m.free(a)
    x = Request("x", tokens(300, 28))
    assert admit(m, x)[2].get_block_ids() == ([3, 4, 5, 6, 7, 8, 9],)
    assert free_ids(m) == [10, 2, 1]
    # 13 tokens: hit blocks [1, 2] (both free) + 2 fresh = 4 blocks from a queue of 3.
    b = Request("b", tokens(100, 8) + tokens(900, 5))
    hits, num_hit = m.get_computed_blocks(b)
    assert (hits.get_block_ids(), num_hit) == (([1, 2],), 8)
    assert m.allocate_slots(b, 5, num_hit, hits) is None
    assert free_ids(m) == [10, 2, 1]
    assert [m.block_pool.blocks[i].ref_cnt for i in (1, 2)] == [0, 0]
    assert m.get_block_ids(b) == []
    assert b.num_computed_tokens == 0
    m.check_invariants()
    # 12 tokens: 2 hit blocks + 1 fresh = 3 blocks: fits exactly.
    c = Request("c", tokens(100, 8) + tokens(900, 4))
    hits, num_hit = m.get_computed_blocks(c)
    assert num_hit == 8
    assert m.allocate_slots(c, 4, num_hit, hits).get_block_ids() == ([10],)
    assert m.get_block_ids(c) == [1, 2, 10]
    assert free_ids(m) == []
    m.check_invariants()


def test_running_request_gets_none_when_the_pool_is_empty():
    m = make_manager()
    x = Request("x", tokens(0, 40))
    assert admit(m, x)[2].get_block_ids() == ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10],)
    x.append_output_token_ids(7)
    assert m.allocate_slots(x, 1) is None
    assert m.get_block_ids(x) == list(range(1, 11))
    m.check_invariants()


@pytest.mark.parametrize(
    ("num_tokens", "expected_hit_ids"),
    [
        (7, [1]),  # at most 6 tokens may hit -> 1 block
        (8, [1]),  # block-aligned full hit gives back a whole block: 7 -> 1 block
        (9, [1, 2]),  # 8 tokens may hit -> both blocks
    ],
)
def test_last_token_rule(num_tokens, expected_hit_ids):
    m = make_manager()
    a = Request("a", tokens(100, 8))
    admit(m, a)
    m.free(a)
    b = Request("b", tokens(100, min(num_tokens, 8)) + [999] * max(num_tokens - 8, 0))
    hits, num_hit = m.get_computed_blocks(b)
    assert hits.get_block_ids() == (expected_hit_ids,)
    assert num_hit == BS * len(expected_hit_ids)


def test_cache_salt_isolates_requests():
    m = make_manager()
    a = Request("a", tokens(100, 8), cache_salt="tenant-1")
    admit(m, a)
    m.free(a)
    prompt = tokens(100, 8) + [5]
    assert m.get_computed_blocks(Request("b", prompt, cache_salt="tenant-2"))[1] == 0
    assert m.get_computed_blocks(Request("c", prompt))[1] == 0
    hits, num_hit = m.get_computed_blocks(Request("d", prompt, cache_salt="tenant-1"))
    assert (hits.get_block_ids(), num_hit) == (([1, 2],), 8)


def test_adapter_id_isolates_requests():
    m = make_manager()
    a = Request("a", tokens(100, 8), adapter_id=3)
    admit(m, a)
    prompt = tokens(100, 8) + [5]
    assert m.get_computed_blocks(Request("b", prompt, adapter_id=4))[1] == 0
    assert m.get_computed_blocks(Request("c", prompt))[1] == 0
    assert m.get_computed_blocks(Request("d", prompt, adapter_id=3))[1] == 8


def test_no_deduplication_block_tables_stay_append_only():
    m = make_manager()
    a = Request("a", tokens(100, 8))
    assert admit(m, a)[2].get_block_ids() == ([1, 2],)
    b = Request("b", tokens(100, 8))
    hits, num_hit, new = admit(m, b)
    # Last-token rule: only block 1 hits; block 3 is filled with the same tokens as
    # block 2 and keeps its own id, cached under the same hash.
    assert (hits.get_block_ids(), num_hit) == (([1],), 4)
    assert new.get_block_ids() == ([3],)
    assert m.get_block_ids(b) == [1, 3]
    blocks = m.block_pool.blocks
    assert blocks[3].block_hash == blocks[2].block_hash is not None
    assert blocks[1].ref_cnt == 2
    m.check_invariants()
    m.free(a)  # block 1 still held by b; block 2 -> tail
    assert free_ids(m) == [4, 5, 6, 7, 8, 9, 10, 2]
    m.free(b)  # reverse [3, 1]: both hashed -> tail
    assert free_ids(m) == [4, 5, 6, 7, 8, 9, 10, 2, 3, 1]
    # Reusing 8 blocks evicts block 2; its duplicate 3 keeps the hash hittable.
    assert admit(m, Request("x", tokens(300, 32)))[2].get_block_ids() == (
        [4, 5, 6, 7, 8, 9, 10, 2],
    )
    hits, num_hit = m.get_computed_blocks(Request("c", tokens(100, 9)))
    assert (hits.get_block_ids(), num_hit) == (([1, 3],), 8)
    m.check_invariants()


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    m = make_manager()
    a = Request("a", tokens(100, 8))
    admit(m, a)
    assert m.reset_prefix_cache() is False
    assert m.block_pool.blocks[1].block_hash is not None
    assert m.prefix_cache_stats.reset is False
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert all(b.block_hash is None for b in m.block_pool.blocks)
    assert len(m.block_pool.cached_block_hash_to_block) == 0
    assert m.prefix_cache_stats.reset is True
    assert m.get_computed_blocks(Request("b", tokens(100, 9)))[1] == 0
    m.check_invariants()


def test_prefix_cache_stats_count_tokens_and_reset():
    m = make_manager()
    a = Request("a", tokens(100, 8))
    admit(m, a)  # 8 queried, 0 hit
    b = Request("b", tokens(100, 10))
    admit(m, b)  # 10 queried, 8 hit
    stats = m.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 18, 8)
    assert stats.hit_rate == pytest.approx(8 / 18)
    taken = m.make_prefix_cache_stats()
    assert taken is stats
    assert (m.prefix_cache_stats.queries, m.prefix_cache_stats.hits) == (0, 0)
    m.free(b)
    b.num_computed_tokens = 0
    b.num_preemptions = 1
    m.get_computed_blocks(b)  # a resume: counted apart
    s = m.prefix_cache_stats
    assert (s.requests, s.preempted_requests, s.preempted_queries, s.preempted_hits) == (
        0,
        1,
        10,
        8,
    )
    assert s.hit_rate == 0.0
    assert s.total_hit_rate == pytest.approx(0.8)


def test_lookahead_slots_are_allocated_but_never_hashed():
    m = make_manager()
    a = Request("a", tokens(100, 6))
    # 6 prompt tokens + 3 lookahead slots = 9 slots -> 3 blocks; only block 1 is full.
    new = m.allocate_slots(a, 6, num_lookahead_tokens=3)
    assert new.get_block_ids() == ([1, 2, 3],)
    assert [b.block_hash is not None for b in m.block_pool.blocks[1:4]] == [True, False, False]
    m.check_invariants()


def test_draft_tokens_beyond_num_tokens_are_not_hashed():
    m = make_manager()
    a = Request("a", tokens(100, 6))
    admit(m, a)
    # 2 scheduled tokens beyond the 6 known ones (drafts): block 2 gets slots 4..7
    # but only 6 real tokens exist, so it must stay unhashed.
    assert m.allocate_slots(a, 2).get_block_ids() == ([],)
    assert m.block_pool.blocks[2].block_hash is None
    m.check_invariants()


def test_common_prefix_blocks_count_blocks_held_by_every_running_request():
    m = make_manager()
    a = Request("a", tokens(100, 12))
    admit(m, a)  # [1, 2, 3], all full
    b = Request("b", tokens(100, 8) + [7, 7, 7])
    assert admit(m, b)[0].get_block_ids() == ([1, 2],)
    assert m.get_num_common_prefix_blocks(a, 2) == [2]
    assert m.get_num_common_prefix_blocks(b, 2) == [2]
    assert m.get_num_common_prefix_blocks(a, 3) == [0]


def test_prefix_caching_disabled_never_hits_or_hashes():
    m = make_manager(enable_prefix_caching=False)
    a = Request("a", tokens(100, 8))
    admit(m, a)
    m.free(a)
    b = Request("b", tokens(100, 9))
    hits, num_hit = m.get_computed_blocks(b)
    assert (hits.get_block_ids(), num_hit) == (([],), 0)
    assert m.allocate_slots(b, 9).get_block_ids() == ([2, 1, 3],)
    assert all(blk.block_hash is None for blk in m.block_pool.blocks)
    m.check_invariants()


def test_get_blocks_is_a_snapshot_of_hits_plus_new_blocks():
    m = make_manager()
    a = Request("a", tokens(100, 8))
    admit(m, a)
    b = Request("b", tokens(100, 8) + [1])
    admit(m, b)
    snapshot = m.get_blocks("b")
    assert snapshot.get_block_ids() == ([1, 2, 3],)
    assert m.get_num_blocks(b) == 3
    assert m.get_block_ids_per_group(b) == ([1, 2, 3],)
    m.free(b)
    assert snapshot.get_block_ids() == ([1, 2, 3],)
    assert m.get_blocks(b).get_block_ids() == ([],)
