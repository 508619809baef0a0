"""Exact-id scenarios for sliding-window recycling and hybrid (full + window) prefix hits.

Pools of 11 or 16 blocks (block 0 null), block_size 4, window 8. Every expected id
below is worked out by hand (comments show the arithmetic) from the rules: a step
that starts at position n frees the blocks wholly below n - W + 1, right to left,
hashed ones to the free-queue tail; a window hit needs the cdiv(W - 1, bs) = 2 blocks
before its end cached (or a run from block 0); hybrid hits are the longest length
every group accepts; groups allocate in group order (full first).
"""

from __future__ import annotations

from paged_jax import KVCacheManager, Request
from paged_jax.core.kv_cache_spec import (
    KVCacheGroupSpec,
    kv_cache_groups_for_layers,
)

BS = 4
W = 8
SLIDING = KVCacheGroupSpec(W, (0,))
FULL = KVCacheGroupSpec(None, (1,))


def make(groups, num_blocks: int) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, max_model_len=64, kv_cache_groups=groups)


def free_ids(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def admit(m: KVCacheManager, req: Request):
    hits, num_hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return hits, num_hit, new


def decode(m: KVCacheManager, req: Request, token: int):
    req.append_output_token_ids(token)
    new = m.allocate_slots(req, 1)
    assert new is not None
    req.num_computed_tokens += 1
    return new


def test_groups_for_layers_put_full_attention_first():
    groups = kv_cache_groups_for_layers([4096, None, 4096, None, 512])
    assert groups == (
        KVCacheGroupSpec(None, (1, 3)),
        KVCacheGroupSpec(512, (4,)),
        KVCacheGroupSpec(4096, (0, 2)),
    )


def test_decode_frees_blocks_once_wholly_out_of_window():
    m = make((SLIDING,), 11)
    a = Request("a", list(range(100, 110)))  # 10 tokens: blocks 1, 2, 3 (3 partial)
    assert admit(m, a)[2].get_block_ids() == ([1, 2, 3],)
    # Step from n=10: keys 3..10 are needed, block 1 (positions 0-3) still is.
    assert decode(m, a, 500).get_block_ids() == ([],)
    assert m.get_block_ids(a) == [1, 2, 3]
    # Step from n=11: keys 4..11, block 1 is dead -> null; hashed, so to the tail.
    decode(m, a, 501)
    assert m.get_block_ids(a) == [0, 2, 3]
    assert free_ids(m) == [4, 5, 6, 7, 8, 9, 10, 1]
    assert m.block_pool.blocks[1].ref_cnt == 0 and m.block_pool.blocks[1].block_hash is not None
    # Step from n=12 needs a 4th block (position 12): the head of the queue, 4.
    assert decode(m, a, 502).get_block_ids() == ([4],)
    # n=13..15 free nothing new (dead blocks: (n - 7) // 4 = 1 or 2 -> block 2 at n=15).
    decode(m, a, 503)
    decode(m, a, 504)
    assert m.get_block_ids(a) == [0, 2, 3, 4]
    decode(m, a, 505)  # n=15: (15 - 7) // 4 = 2 dead blocks
    assert m.get_block_ids(a) == [0, 0, 3, 4]
    assert free_ids(m) == [5, 6, 7, 8, 9, 10, 1, 2]
    assert m.get_num_blocks_held(a) == 2
    m.check_invariants()
    m.free(a)
    # 16 tokens: block 4 is full and hashed too; freed tail first -> 4, 3 at the tail.
    assert free_ids(m) == [5, 6, 7, 8, 9, 10, 1, 2, 4, 3]
    m.check_invariants()


def test_long_prompt_holds_at_most_window_blocks_plus_one_after_prefill():
    m = make((SLIDING,), 16)
    a = Request("a", list(range(100, 130)))  # 30 tokens
    # Chunked prefill of 12 tokens per step: the step from n frees (n - 7) // 4 blocks.
    done = 0
    while done < a.num_tokens:
        num_new = min(12, a.num_tokens - done)
        assert m.allocate_slots(a, num_new) is not None
        done += num_new
        a.num_computed_tokens = done
    # n=12 freed 1 block, n=24 freed 4: 8 table entries, 4 real (positions 16..29).
    assert m.get_block_ids(a)[:4] == [0, 0, 0, 0]
    assert m.get_num_blocks_held(a) == 4
    bound = -(-W // BS) + 1  # ceil(W / bs) + 1 = 3
    for t in range(20):
        decode(m, a, t)
        assert m.get_num_blocks_held(a) <= bound
        m.check_invariants()


def test_window_hits_need_only_the_last_window_and_revive_freed_blocks():
    m = make((SLIDING,), 11)
    prompt = list(range(100, 120))  # 20 tokens = 5 full blocks
    a = Request("a", prompt)
    assert admit(m, a)[2].get_block_ids() == ([1, 2, 3, 4, 5],)
    # Step from n=20: (20 - 7) // 4 = 3 dead -> 3, 2, 1 freed (tail); 6 for position 20.
    decode(m, a, 500)
    assert m.get_block_ids(a) == [0, 0, 0, 4, 5, 6]
    assert free_ids(m) == [7, 8, 9, 10, 3, 2, 1]

    # Same prompt + 1: max hit 20 tokens; blocks 4, 5 (2 = cdiv(7, 4)) suffice.
    b = Request("b", prompt + [600])
    hits, num_hit, new = admit(m, b)
    assert (hits.get_block_ids(), num_hit) == (([0, 0, 0, 4, 5],), 20)
    assert new.get_block_ids() == ([7],)
    assert [m.block_pool.blocks[i].ref_cnt for i in (4, 5)] == [2, 2]

    # 12 shared tokens + 1: hit ends at 12 and needs blocks 2 and 3, both free: revived.
    c = Request("c", prompt[:12] + [601])
    hits, num_hit, new = admit(m, c)
    assert (hits.get_block_ids(), num_hit) == (([0, 2, 3],), 12)
    assert new.get_block_ids() == ([8],)
    assert free_ids(m) == [9, 10, 1]

    # Only block 0 of the prefix matches: shorter than a window, but it starts at 0.
    d = Request("d", prompt[:4] + [9] * 5)
    hits, num_hit, new = admit(m, d)
    assert (hits.get_block_ids(), num_hit) == (([1],), 4)
    assert new.get_block_ids() == ([9, 10],)
    assert free_ids(m) == []
    m.check_invariants()


def test_hybrid_hit_is_the_longest_valid_for_both_groups():
    m = make((FULL, SLIDING), 16)
    prompt = list(range(100, 120))
    a = Request("a", prompt)
    # Full group first: 1..5; then the window group: 6..10.
    assert admit(m, a)[2].get_block_ids() == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    # Step from n=20: the window group frees 8, 7, 6 (tail); each group takes one block.
    decode(m, a, 500)
    assert m.get_block_ids_per_group(a) == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12])
    assert free_ids(m) == [13, 14, 15, 8, 7, 6]

    b = Request("b", prompt + [600])
    hits, num_hit, new = admit(m, b)
    assert (hits.get_block_ids(), num_hit) == (([1, 2, 3, 4, 5], [0, 0, 0, 9, 10]), 20)
    assert new.get_block_ids() == ([13], [14])
    assert free_ids(m) == [15, 8, 7, 6]

    # A hog takes the two head blocks (one per group): 15 and 8; 8 loses its hash.
    hog = Request("hog", [7000, 7001, 7002, 7003])
    assert m.allocate_slots(hog, 4).get_block_ids() == ([15], [8])
    assert free_ids(m) == [7, 6]

    # 12 shared tokens: the full group hits 12, the window group cannot (its block at
    # index 2, id 8, was evicted) and lowers the hit to 8 via blocks 6, 7 (a run from 0).
    c = Request("c", prompt[:12] + [601])
    hits, num_hit = m.get_computed_blocks(c)
    assert (hits.get_block_ids(), num_hit) == (([1, 2], [6, 7]), 8)
    # 13 tokens need 4 blocks per group: full 2 new; window 2 new + 2 revived = 6 > 2.
    refs = [blk.ref_cnt for blk in m.block_pool.blocks]
    assert m.allocate_slots(c, 5, 8, hits) is None
    assert [blk.ref_cnt for blk in m.block_pool.blocks] == refs
    assert free_ids(m) == [7, 6]
    assert m.get_block_ids_per_group(c) == ([], [])

    # Finishing a frees only its partial last blocks (11, then the window's 12, each to
    # the head); 1..5, 9, 10 are still held by b. Still 6 > 4 free: refused again.
    m.free(a)
    assert free_ids(m) == [12, 11, 7, 6]
    assert m.allocate_slots(c, 5, 8, hits) is None
    # Finishing b: full 13 to the head, 5..1 to the tail; window 14 to the head, 10, 9
    # to the tail. Now c fits: touching 1, 2, 6, 7 unlinks them, then full pops 14, 13
    # and the window pops 12, 11.
    m.free(b)
    assert free_ids(m) == [14, 13, 12, 11, 7, 6, 5, 4, 3, 2, 1, 10, 9]
    assert m.allocate_slots(c, 5, 8, hits).get_block_ids() == ([14, 13], [12, 11])
    assert m.get_block_ids_per_group(c) == ([1, 2, 14, 13], [6, 7, 12, 11])
    assert free_ids(m) == [5, 4, 3, 10, 9]
    m.check_invariants()


def test_two_windows_settle_on_a_length_both_accept():
    # Two windows: W=8 (2 blocks) and W=16 (4 blocks, cdiv(15, 4)). Prompt 24 tokens.
    groups = (KVCacheGroupSpec(8, (0,)), KVCacheGroupSpec(16, (1,)))
    m = make(groups, 16)
    prompt = list(range(100, 124))
    a = Request("a", prompt)
    assert admit(m, a)[2].get_block_ids() == ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12])
    m.free(a)  # all hashed: tail, in reverse per group: 6..1 then 12..7
    assert free_ids(m) == [13, 14, 15, 6, 5, 4, 3, 2, 1, 12, 11, 10, 9, 8, 7]
    # Evict 6 (W=8 index 5) with a 1-block-per-group hog: pops 13 and 14.
    hog = Request("hog", [7000] * 4)
    m.allocate_slots(hog, 4)
    hog2 = Request("hog2", [7001] * 8)  # 2 blocks per group: pops 15, 6 and 5, 4
    assert m.allocate_slots(hog2, 8).get_block_ids() == ([15, 6], [5, 4])
    # Now W=8 has indices 0..2 (blocks 1, 2, 3); W=16 has indices 0..5 (7..12).
    b = Request("b", prompt + [600])
    hits, num_hit = m.get_computed_blocks(b)
    # W=8 from 24 tokens: indices 5, 4, 3 miss; 2, 1 hit -> 12 tokens. W=16 from 12:
    # indices 2, 1, 0 cached, a run from 0 -> 12. W=8 again from 12: 12. Stable.
    assert (hits.get_block_ids(), num_hit) == (([0, 2, 3], [7, 8, 9]), 12)
    m.check_invariants()
