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
