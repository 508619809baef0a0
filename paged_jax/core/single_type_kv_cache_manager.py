"""Per-attention-type block managers: the shared base and full attention.

One manager serves one KV-cache group (layers sharing a block table). The sliding-window
manager (paged_jax.core.sliding_window_manager) overrides the hit search and frees
out-of-window blocks. Pure Python; never imports jax.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

from paged_jax.constants import cdiv
from paged_jax.core.block_pool import BlockPool, KVCacheBlock
from paged_jax.core.hashing import BlockHash, make_block_hash_with_group_id
from paged_jax.core.request import Request


class SingleTypeKVCacheManager:
    """Block bookkeeping of one KV-cache group for every running request.

    Args:
        block_pool: the pool shared by all groups.
        block_size: tokens per block in this group.
        kv_cache_group_id: index of this group (part of the cache key).
        enable_caching: hash newly full blocks into the pool's cache.
    """

    # Whether a table may start with a run of null blocks (freed out-of-window blocks).
    holds_null_prefix = False

    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        kv_cache_group_id: int = 0,
        *,
        enable_caching: bool = True,
    ) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.kv_cache_group_id = kv_cache_group_id
        self.enable_caching = enable_caching
        # request id -> blocks in token order (the block table).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> number of leading blocks already cached (hashed).
        self.num_cached_block: dict[str, int] = {}

    def longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """This group's longest usable hit of at most max_length tokens (no ref changes)."""
        return self.find_longest_cache_hit(
            block_hashes, max_length, self.block_pool, self.kv_cache_group_id, self.block_size
        )

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Frees blocks no future token will read (none for full attention)."""

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
    ) -> int:
        """Blocks that serving num_tokens slots would take out of the free queue.

        Evictable hit blocks (ref_cnt 0, so sitting in the free queue) count too:
        touching them removes them from the free queue.
        """
        held = self.req_to_blocks.get(request_id)
        num_new = cdiv(num_tokens, self.block_size) - (len(held) if held else 0)
        if not new_computed_blocks:  # the decode fast path
            return num_new if num_new > 0 else 0
        # A hit's leading null blocks (out-of-window positions) need no fresh block either.
        num_new -= len(new_computed_blocks)
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return max(num_new, 0) + num_evictable

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Adopts prefix-hit blocks into a new request's table (adds a ref to each)."""
        if not new_computed_blocks:
            return
        assert request_id not in self.req_to_blocks, (
            f"request {request_id!r} already holds blocks: hits are only for new requests"
        )
        self.block_pool.touch(new_computed_blocks)
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        # Hit blocks are cached already; do not hash them again.
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Appends fresh blocks so the table covers num_tokens slots; returns them."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
            self.num_cached_block[request_id] = 0
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Caches the request's blocks that are full within its first num_tokens tokens."""
        request_id = request.request_id
        num_cached = self.num_cached_block[request_id]
        num_full = min(num_tokens, len(request.block_hashes) * self.block_size) // self.block_size
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            request.block_hashes,
            self.req_to_blocks[request_id],
            num_cached,
            num_full,
            self.kv_cache_group_id,
        )
        self.num_cached_block[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Returns the request's blocks to the pool, tail of the chain first (nulls skipped)."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's live block list (do not mutate); empty if it holds none."""
        return self.req_to_blocks.get(request_id, [])

    # -- forks and copy on write ----------------------------------------------

    def num_shareable_tokens(self, request_id: str, num_tokens: int) -> int:
        """How many of the request's first num_tokens tokens a fork can share here.

        All of them, except when token num_tokens - 1 sits in a block the request has
        already hashed (full in the request, only partly the child's): that block
        cannot be shared, so the share ends at the block boundary before it.
        """
        blocks = self.req_to_blocks.get(request_id, [])
        num_blocks = cdiv(num_tokens, self.block_size)
        assert len(blocks) >= num_blocks, (
            f"request {request_id!r} has computed tokens without blocks"
        )
        if num_tokens % self.block_size and blocks[num_blocks - 1].block_hash is not None:
            return (num_blocks - 1) * self.block_size
        return num_tokens

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Starts the child's table as the parent's blocks for its first num_tokens tokens.

        Each shared block gains a reference; the child's cached count is the parent's,
        capped at the shared blocks. The caller checked num_shareable_tokens.
        """
        num_blocks = cdiv(num_tokens, self.block_size)
        if num_blocks:
            shared = self.req_to_blocks[parent_id][:num_blocks]
            self.block_pool.touch(shared)
            self.req_to_blocks[child_id] = shared
        self.num_cached_block[child_id] = min(self.num_cached_block.get(parent_id, 0), num_blocks)

    def written_shared_blocks(
        self,
        request_id: str,
        first_token: int,
        end_token: int,
        is_shared: Callable[[KVCacheBlock], bool],
    ) -> list[int]:
        """Table indices of held blocks that tokens [first_token, end_token) write while shared."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return []
        first = first_token // self.block_size
        last = min(len(blocks), cdiv(end_token, self.block_size))
        return [i for i in range(first, last) if is_shared(blocks[i])]

    def replace_block(self, request_id: str, index: int, block: KVCacheBlock) -> KVCacheBlock:
        """Puts block in the request's table slot index (a copy on write); returns the old one.

        The table's reference to the old block is the caller's to release. The new
        block is not hashed yet, so the cached count drops to index if it was beyond.
        """
        blocks = self.req_to_blocks[request_id]
        old = blocks[index]
        blocks[index] = block
        if self.num_cached_block[request_id] > index:
            self.num_cached_block[request_id] = index
        return old

    # -- checks ---------------------------------------------------------------

    def check_tables(self) -> collections.Counter[int]:
        """Checks every table of this group; raises AssertionError on a bug.

        Checked: no table holds a block twice or caches more blocks than it holds;
        the null block appears only as a leading run, and only where
        holds_null_prefix; exactly the first num_cached real blocks are hashed.

        Returns:
            block id -> number of tables holding it (real blocks only).
        """
        holders: collections.Counter[int] = collections.Counter()
        for request_id, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks if not b.is_null]
            if len(set(ids)) != len(ids):
                raise AssertionError(f"request {request_id!r} holds a block twice: {ids}")
            num_cached = self.num_cached_block[request_id]
            if num_cached > len(blocks):
                raise AssertionError(f"request {request_id!r} caches more blocks than held")
            num_null = 0
            while num_null < len(blocks) and blocks[num_null].is_null:
                num_null += 1
            for i, block in enumerate(blocks):
                if block.is_null:
                    if not self.holds_null_prefix or i >= num_null:
                        raise AssertionError(
                            f"request {request_id!r} holds the null block at {i} in group "
                            f"{self.kv_cache_group_id} (only a window's leading run may)"
                        )
                    continue
                if (block.block_hash is not None) != (i < num_cached):
                    raise AssertionError(
                        f"request {request_id!r} block {i} (id {block.block_id}) hashed "
                        f"state disagrees with num_cached_block={num_cached}"
                    )
            holders.update(ids)
        return holders

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """Leading blocks shared by every running request (0 if unsupported)."""
        raise NotImplementedError

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        block_size: int,
    ) -> list[KVCacheBlock]:
        """The longest run of cached blocks usable as this request's prefix.

        Args:
            block_hashes: the request's chained block hashes.
            max_length: hit length cap in tokens (the caller applies num_tokens - 1).
            block_pool: where the cache lives.
            kv_cache_group_id: the group whose blocks may be hit.
            block_size: tokens per block.

        Returns:
            The hit blocks in token order (no ref counts change).
        """
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full (causal) attention: every token's KV is kept until the request ends."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        block_size: int,
    ) -> list[KVCacheBlock]:
        # Chained hashes: the first miss ends the hit, every later block misses too.
        max_blocks = min(max_length // block_size, len(block_hashes))
        lookup = block_pool.cached_block_hash_to_block.get_one_block
        hits = []
        for i in range(max_blocks):
            block = lookup(make_block_hash_with_group_id(block_hashes[i], kv_cache_group_id))
            if block is None:
                break
            hits.append(block)
        return hits

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """Leading blocks of this request held by all num_running_requests requests."""
        count = 0
        for block in self.req_to_blocks.get(request_id, ()):
            if block.ref_cnt != num_running_requests:
                break
            count += 1
        return count
