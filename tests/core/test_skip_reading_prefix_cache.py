"""A request that skips reading the prefix cache still fills it for others."""

from __future__ import annotations

from paged_jax import KVCacheManager, Request

BS = 4


def _prefill(m: KVCacheManager, req: Request) -> int:
    hits, num_hit = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return num_hit


def test_skipping_reads_nothing_but_its_blocks_serve_others():
    m = KVCacheManager(16, BS, enable_prefix_caching=True, max_model_len=64)
    prompt = list(range(10, 22))  # three full blocks
    first = Request("a", prompt)
    assert _prefill(m, first) == 0
    skipping = Request("b", prompt, skip_reading_prefix_cache=True)
    queries = m.prefix_cache_stats.queries
    assert _prefill(m, skipping) == 0  # the cached prefix is there, but not read
    assert m.prefix_cache_stats.queries == queries  # and not counted as a query
    m.free(first)
    third = Request("c", prompt + [1])
    assert _prefill(m, third) == 12  # hits the blocks the skipping request cached too
    m.check_invariants()


def test_max_cache_hit_tokens_caps_the_hit_at_a_block_boundary():
    """Request.max_cache_hit_tokens (prompt logprobs of a tail): the hit stops at the last
    block boundary at or below the cap; None keeps the engine's num_tokens - 1."""
    m = KVCacheManager(32, BS, enable_prefix_caching=True, max_model_len=64)
    prompt = list(range(10, 26))  # four full blocks
    first = Request("a", prompt)
    assert _prefill(m, first) == 0
    m.free(first)
    for cap, want in [(None, 12), (13, 12), (11, 8), (8, 8), (3, 0)]:
        req = Request(f"cap{cap}", prompt, max_cache_hit_tokens=cap)
        hits, num_hit = m.get_computed_blocks(req)
        assert num_hit == want, (cap, num_hit)
        assert len(hits.blocks[0]) == want // BS
    m.check_invariants()
