"""SlidingWindowManager: a KV-cache group whose layers only look back W tokens (vLLM V1).

Blocks that fall wholly out of the window are freed every step and replaced by the null
block in the request's table, so a request holds at most cdiv(W - 1, block_size) + 1
blocks once its prefill is done; its prefix-hit search needs only the last window's
blocks. Pure Python; never imports jax.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_jax.constants import cdiv
from paged_jax.core.block_pool import BlockPool, KVCacheBlock
from paged_jax.core.hashing import BlockHash, make_block_hash_with_group_id
from paged_jax.core.single_type_kv_cache_manager import SingleTypeKVCacheManager


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Block bookkeeping of one sliding-window group (window W, the current token included).

    A query at position q reads keys q - W + 1 .. q. Before a step that computes tokens
    from position n on, every block wholly below n - W + 1 is dead::

        positions   0 ...                 n-W+1        n      (new tokens ->)
        table       [null][null][null][ b3 ][ b4 ][ b5 ][ b6 ]
                    |<- freed, nulls ->|<- read by this step's queries ->|

    The table keeps its length (positions still index it by block); the kernels start
    their key loop at the window, so the null entries are never read. Freed blocks keep
    their hashes (LRU tail of the free queue) and can still serve prefix hits.

    Args:
        block_pool: the pool shared by all groups.
        block_size: tokens per block.
        kv_cache_group_id: index of this group.
        sliding_window: W in tokens (>= 1).
        enable_caching: hash newly full blocks into the pool's cache.
    """

    holds_null_prefix = True

    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        kv_cache_group_id: int = 0,
        *,
        sliding_window: int,
        enable_caching: bool = True,
    ) -> None:
        if not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window!r} must be an int >= 1")
        super().__init__(block_pool, block_size, kv_cache_group_id, enable_caching=enable_caching)
        self.sliding_window = sliding_window

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no query from position num_computed_tokens on can see."""
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replaces the wholly out-of-window blocks by the null block and frees them.

        Walks right to left from the last dead block and stops at the first null (all
        blocks before it were removed in an earlier step), so a decode step costs O(1).
        Blocks are freed tail first, as a finished request's are.
        """
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_skipped = self.get_num_skipped_tokens(num_computed_tokens)
        num_dead = min(num_skipped // self.block_size, len(blocks))
        null = self.block_pool.null_block
        removed = []
        for i in range(num_dead - 1, -1, -1):
            block = blocks[i]
            if block.is_null:
                break
            removed.append(block)
            blocks[i] = null
        if removed:
            self.block_pool.free_blocks(removed)

    def longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        return self.find_longest_cache_hit(
            block_hashes,
            max_length,
            self.block_pool,
            self.kv_cache_group_id,
            self.block_size,
            sliding_window=self.sliding_window,
        )

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        block_size: int,
        *,
        sliding_window: int | None = None,
    ) -> list[KVCacheBlock]:
        """The longest hit whose last window is cached, null-padded below the window.

        A hit of h blocks is usable if blocks h - cdiv(W - 1, block_size) .. h - 1 are all
        cached (the first token computed after the hit, at position h * block_size, reads
        keys from h * block_size - W + 1 on), or if every block 0 .. h - 1 is cached.
        Scans right to left from min(max_length // block_size, len(block_hashes)) and
        returns the first long-enough run found, i.e. the longest hit.

        Returns:
            ``[null] * k + run``: the hit's blocks in token order, no ref counts changed.
        """
        assert sliding_window is not None, "the sliding-window hit search needs the window"
        max_blocks = min(max_length // block_size, len(block_hashes))
        null = block_pool.null_block
        num_needed = cdiv(sliding_window - 1, block_size)
        hits = [null] * max_blocks
        if num_needed == 0:  # W == 1: a token sees only itself, no cached KV is read
            return hits
        lookup = block_pool.cached_block_hash_to_block.get_one_block
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            block = lookup(make_block_hash_with_group_id(block_hashes[i], kv_cache_group_id))
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run == num_needed:
                del hits[i + run :]
                return hits
        # No run of num_needed blocks: a run that starts at block 0 is a hit on its own.
        del hits[run:]
        return hits

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """0: leading blocks leave the table, so there is no shared prefix to exploit."""
        return 0
