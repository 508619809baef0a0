"""KVCacheManager's consistency check (tests and debugging; pure Python, no jax)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_jax.core.sliding_window_manager import SlidingWindowManager

if TYPE_CHECKING:
    from paged_jax.core.kv_cache_manager import KVCacheManager


def check_kv_cache_manager(kv: KVCacheManager) -> None:
    """Checks pool and table consistency; raises AssertionError on a bug.

    Beyond BlockPool.check_invariants: every block's ref_cnt equals the number
    of request tables holding it (over all groups) plus its holds by pending
    copies, no table holds a block twice, the null block appears only as the
    leading run of a sliding-window table, and exactly the first num_cached real
    blocks of each table are hashed.
    """
    kv.block_pool.check_invariants()
    holders = [0] * kv.num_blocks
    for manager in kv.coordinator.managers:
        window = isinstance(manager, SlidingWindowManager)
        for request_id, blocks in manager.req_to_blocks.items():
            ids = [b.block_id for b in blocks if not b.is_null]
            if len(set(ids)) != len(ids):
                raise AssertionError(f"request {request_id!r} holds a block twice: {ids}")
            num_cached = manager.num_cached_block[request_id]
            if num_cached > len(blocks):
                raise AssertionError(f"request {request_id!r} caches more blocks than held")
            num_null = 0
            while num_null < len(blocks) and blocks[num_null].is_null:
                num_null += 1
            for i, block in enumerate(blocks):
                if block.is_null:
                    if not window or i >= num_null:
                        raise AssertionError(
                            f"request {request_id!r} holds the null block at {i} in group "
                            f"{manager.kv_cache_group_id} (only a window's leading run may)"
                        )
                    continue
                if (block.block_hash is not None) != (i < num_cached):
                    raise AssertionError(
                        f"request {request_id!r} block {i} (id {block.block_id}) hashed "
                        f"state disagrees with num_cached_block={num_cached}"
                    )
                holders[block.block_id] += 1
    holds = kv.pending_copies.holds
    for block in kv.block_pool.blocks[1:]:
        held = holds.get(block.block_id, 0)
        if block.ref_cnt != holders[block.block_id] + held:
            raise AssertionError(
                f"block {block.block_id} ref_cnt={block.ref_cnt} but "
                f"{holders[block.block_id]} requests and {held} pending copies hold it"
            )
