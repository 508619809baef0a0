"""KVCacheManager.allocate_slots' decode fast path (pure Python, no jax).

Exactly what the general path does when a single-group manager's new tokens fall in
one block, either the last held one (unshared: ref_cnt 1, no copy on write) or the
next one: nothing, or one fresh block from the free queue's head, then cache any
block now full. tests/core/test_host_fast_paths.py runs the same workload with and
without it and compares every table, hash, ref count and the free-queue order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_jax.core.kv_cache_blocks import KVCacheBlocks

if TYPE_CHECKING:
    from paged_jax.core.kv_cache_manager import KVCacheManager
    from paged_jax.core.request import Request
    from paged_jax.core.single_type_kv_cache_manager import SingleTypeKVCacheManager


def allocate_decode_slots(
    kv: KVCacheManager, fast: SingleTypeKVCacheManager, request: Request, num_new_tokens: int
) -> KVCacheBlocks | None:
    """The new blocks (possibly none) when the fast path applies, else None (not handled)."""
    request_id = request.request_id
    blocks = fast.req_to_blocks.get(request_id)
    if blocks:
        start = request.num_computed_tokens
        end = start + num_new_tokens
        bs = kv.block_size
        index = start // bs
        num_held = len(blocks)
        if (
            (end - 1) // bs == index
            and end <= kv.max_model_len
            and (
                (index == num_held - 1 and blocks[index].ref_cnt == 1)
                or (index == num_held and kv.block_pool.free_block_queue.num_free_blocks)
            )
        ):
            cache_end = 0  # tokens to cache blocks within (0: none)
            if kv.enable_caching:
                if request.block_hasher is None:
                    index = -1  # the general path attaches the hasher first
                else:
                    num_tokens = len(request.all_token_ids)
                    if end < num_tokens:
                        num_tokens = end
                    num_full = num_tokens
                    num_hashed = len(request.block_hashes) * bs
                    if num_hashed < num_full:
                        num_full = num_hashed
                    if num_full // bs > fast.num_cached_block[request_id]:
                        cache_end = num_tokens
            if index == num_held - 1:
                if cache_end:
                    fast.cache_blocks(request, cache_end)
                return kv.empty_kv_cache_blocks
            if index == num_held:
                # Allocate before caching, as the general path does (a reused block's eviction
                # from the hash map comes first).
                new_blocks = kv.block_pool.get_new_blocks(1)
                blocks.extend(new_blocks)
                if cache_end:
                    fast.cache_blocks(request, cache_end)
                return KVCacheBlocks((new_blocks,))
    return None
