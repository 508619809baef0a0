"""BlockPool and FreeKVCacheBlockQueue: pointer-level and exact-id behaviour."""

from __future__ import annotations

import pytest

from paged_jax.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from paged_jax.core.hashing import BlockHash, get_block_hash


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def make_queue(n: int):
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


# -- KVCacheBlock -------------------------------------------------------------


def test_kv_cache_block_uses_slots():
    block = KVCacheBlock(3)
    assert not hasattr(block, "__dict__")
    with pytest.raises(AttributeError):
        block.some_field = 1
    assert (block.block_id, block.ref_cnt, block.block_hash, block.is_null) == (3, 0, None, False)


# -- FreeKVCacheBlockQueue ----------------------------------------------------


def test_queue_links_blocks_in_order_between_sentinels():
    blocks, q = make_queue(4)
    assert q.num_free_blocks == 4
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3]
    assert blocks[0].prev_free_block.block_id == -1
    assert blocks[3].next_free_block.block_id == -1
    assert blocks[1].prev_free_block is blocks[0] and blocks[1].next_free_block is blocks[2]
    q.check_links()


def test_empty_queue_sentinels_point_at_each_other():
    _, q = make_queue(0)
    assert q.num_free_blocks == 0 and q.get_all_free_blocks() == []
    with pytest.raises(ValueError, match=r"num_free_blocks=0 must be > 0"):
        q.popleft()
    q.check_links()


def test_popleft_and_popleft_n_clear_links():
    blocks, q = make_queue(5)
    first = q.popleft()
    assert first is blocks[0]
    assert first.prev_free_block is None and first.next_free_block is None
    popped = q.popleft_n(3)
    assert ids(popped) == [1, 2, 3]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in popped)
    assert ids(q.get_all_free_blocks()) == [4] and q.num_free_blocks == 1
    assert q.popleft_n(0) == []
    with pytest.raises(ValueError, match=r"n=2 must be in \[0, num_free_blocks=1\]"):
        q.popleft_n(2)
    q.check_links()


def test_remove_from_the_middle_and_errors_on_a_block_not_queued():
    blocks, q = make_queue(5)
    q.remove(blocks[2])
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4]
    assert blocks[1].next_free_block is blocks[3] and blocks[3].prev_free_block is blocks[1]
    with pytest.raises(ValueError, match=r"must be in the free queue"):
        q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert ids(q.get_all_free_blocks()) == [1, 3] and q.num_free_blocks == 2
    q.check_links()


def test_append_append_n_prepend_n_keep_given_order():
    blocks, q = make_queue(6)
    taken = q.popleft_n(6)
    q.append(taken[3])
    q.append_n([taken[5], taken[0]])
    q.prepend_n([taken[1], taken[4]])
    assert ids(q.get_all_free_blocks()) == [1, 4, 3, 5, 0]
    q.prepend_n([taken[2]])
    assert ids(q.get_all_free_blocks()) == [2, 1, 4, 3, 5, 0]
    assert q.num_free_blocks == 6
    q.append_n([])
    q.prepend_n([])
    assert q.num_free_blocks == 6
    q.check_links()


# -- BlockPool ------------------------------------------------------------------


def test_pool_rejects_too_few_blocks():
    with pytest.raises(ValueError, match=r"num_blocks=1 must be an int >= 2"):
        BlockPool(1)
    with pytest.raises(ValueError, match=r"num_blocks='8' must be an int >= 2"):
        BlockPool("8")


def test_null_block_is_block_zero_and_never_free():
    pool = BlockPool(10)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 9
    assert ids(pool.free_block_queue.get_all_free_blocks()) == list(range(1, 10))
    assert pool.get_usage() == 0.0
    got = pool.get_new_blocks(9)
    assert ids(got) == list(range(1, 10))
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError, match=r"num_blocks=1 must be <= num_free_blocks=0"):
        pool.get_new_blocks(1)
    # Freeing or touching the null block is a no-op.
    pool.free_blocks([pool.null_block])
    pool.touch([pool.null_block])
    pool.free_blocks(reversed(got))
    pool.check_invariants()


def test_free_blocks_unhashed_to_head_hashed_to_tail():
    pool = BlockPool(8)
    a = pool.get_new_blocks(4)  # [1, 2, 3, 4]
    pool.cache_full_blocks([h(1), h(2)], a, 0, 2)
    pool.free_blocks(reversed(a))  # order 4, 3, 2, 1
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 3, 5, 6, 7, 2, 1]
    pool.check_invariants()


def test_touch_revives_a_cached_free_block_and_lazy_eviction_on_reuse():
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks([h(1), h(2)], a, 0, 2)
    pool.free_blocks(reversed(a))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 5, 2, 1]
    # Still cached while free.
    assert ids(pool.get_cached_block(h(1))) == [1]
    pool.touch(pool.get_cached_block(h(1)))
    assert pool.blocks[1].ref_cnt == 1
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 5, 2]
    # Popping 4 blocks reuses 2: only now its hash is dropped.
    got = pool.get_new_blocks(4)
    assert ids(got) == [3, 4, 5, 2]
    assert pool.blocks[2].block_hash is None and pool.get_cached_block(h(2)) is None
    assert ids(pool.get_cached_block(h(1))) == [1]
    pool.check_invariants()


def test_duplicates_share_a_key_and_survive_each_others_eviction():
    pool = BlockPool(6)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks([h(7)], a, 0, 1)
    pool.cache_full_blocks([h(7)], b, 0, 1)
    assert get_block_hash(pool.blocks[1].block_hash) == h(7)
    assert ids(pool.get_cached_block(h(7))) == [1]  # the first inserted
    pool.free_blocks(a)
    pool.get_new_blocks(4)  # pops 3, 4, 5, 1: evicts block 1 only
    assert ids(pool.get_cached_block(h(7))) == [2]
    pool.check_invariants()


def test_cache_keys_are_per_group():
    pool = BlockPool(6)
    a = pool.get_new_blocks(1)
    pool.cache_full_blocks([h(9)], a, 0, 1, kv_cache_group_id=1)
    assert pool.get_cached_block(h(9), [0]) is None
    assert ids(pool.get_cached_block(h(9), [1])) == [1]
    assert pool.get_cached_block(h(9), [0, 1]) is None


def test_reset_prefix_cache_refuses_while_blocks_are_held():
    pool = BlockPool(4)
    a = pool.get_new_blocks(1)
    pool.cache_full_blocks([h(1)], a, 0, 1)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h(1)) is not None
    pool.free_blocks(a)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h(1)) is None and pool.blocks[1].block_hash is None
    pool.check_invariants()


def test_check_invariants_catches_a_corrupted_ref_count():
    pool = BlockPool(4)
    pool.get_new_blocks(1)[0].ref_cnt = 0  # held by nobody but not in the free queue
    with pytest.raises(AssertionError, match=r"free queue .* != blocks with ref_cnt 0"):
        pool.check_invariants()


def test_newly_cached_records_hashed_blocks_and_uncache_moves_them_to_the_head():
    pool = BlockPool(8)
    assert pool.newly_cached is None  # recording is off until someone takes the list
    a = pool.get_new_blocks(3)  # [1, 2, 3]
    pool.cache_full_blocks([h(1), h(2)], a, 0, 1)
    pool.newly_cached = []
    pool.cache_full_blocks([h(1), h(2)], a, 1, 2)
    assert ids(pool.newly_cached) == [2]
    pool.free_blocks(reversed(a))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 5, 6, 7, 2, 1]
    # Block 2's KV was never written (its step failed): it leaves the cache and the tail.
    assert pool.uncache_blocks(pool.newly_cached + [pool.blocks[3]]) == 1
    assert pool.blocks[2].block_hash is None and pool.get_cached_block(h(2)) is None
    assert ids(pool.get_cached_block(h(1))) == [1]
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [2, 3, 4, 5, 6, 7, 1]
    pool.check_invariants()


def test_uncache_refuses_a_block_still_held():
    pool = BlockPool(4)
    a = pool.get_new_blocks(1)
    pool.cache_full_blocks([h(1)], a, 0, 1)
    with pytest.raises(AssertionError, match=r"block 1 is uncached while 1 tables hold it"):
        pool.uncache_blocks(a)
