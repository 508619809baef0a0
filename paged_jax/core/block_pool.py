"""BlockPool: every physical KV block, its ref count, the free queue and the hash cache.

Pure Python; never imports jax.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from paged_jax.constants import NULL_BLOCK_ID, is_int
from paged_jax.core.hashing import BlockHash, BlockHashWithGroupId, make_block_hash_with_group_id
from paged_jax.core.kv_cache_block import (
    BlockId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
)

__all__ = [
    "NULL_BLOCK_ID",
    "BlockHashToBlockMap",
    "BlockId",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
]


class BlockHashToBlockMap:
    """The prefix cache's index: group-tagged block hash -> cached block(s).

    Blocks are not de-duplicated: a block that becomes full keeps its own id even
    when an equal block is cached already, because swapping it for the cached one
    would rewrite a table slot the device has written; block tables stay
    append-only. So one key can name several blocks.

    Such duplicates are rare (two requests computing the same block at once), so a
    key maps to a bare KVCacheBlock and becomes a {block_id: block} dict only while
    it has two or more: one cached block costs no dict of its own (fewer allocations
    and less garbage-collector work on a large pool).
    """

    __slots__ = ("_map",)

    def __init__(self) -> None:
        self._map: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def __len__(self) -> int:
        """Number of distinct keys."""
        return len(self._map)

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        """Any one block cached under key (the oldest), or None."""
        entry = self._map.get(key)
        if entry is None or type(entry) is KVCacheBlock:
            return entry
        return next(iter(entry.values()))

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        """Adds block under key, beside any block already there."""
        entry = self._map.get(key)
        if entry is None:
            self._map[key] = block
        elif type(entry) is KVCacheBlock:
            self._map[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Removes and returns the block with block_id under key (None if absent).

        The other blocks under key stay; a last one left goes back to a bare block.
        """
        entry = self._map.get(key)
        if entry is None:
            return None
        if type(entry) is KVCacheBlock:
            if entry.block_id != block_id:
                return None
            del self._map[key]
            return entry
        block = entry.pop(block_id, None)
        if len(entry) == 1:
            self._map[key] = next(iter(entry.values()))
        elif not entry:
            del self._map[key]
        return block

    def clear(self) -> None:
        """Forgets every key."""
        self._map.clear()

    def items(self) -> Iterator[tuple[BlockHashWithGroupId, KVCacheBlock]]:
        """(key, block) for every cached block; a key with duplicates appears once per block."""
        for key, entry in self._map.items():
            if type(entry) is KVCacheBlock:
                yield key, entry
            else:
                for block in entry.values():
                    yield key, block

    def check_invariants(self) -> None:
        """Raises AssertionError if an entry is malformed or names a block under a stale key.

        Checked: a dict entry holds at least two blocks, keyed by their own ids; every
        block's block_hash equals the key it is found under.
        """
        for entry in self._map.values():
            if type(entry) is not KVCacheBlock:
                if len(entry) < 2:
                    raise AssertionError(
                        "an empty or single-block duplicate set was left in the hash map"
                    )
                if any(block_id != b.block_id for block_id, b in entry.items()):
                    raise AssertionError("a duplicate set is keyed by the wrong block ids")
        for key, block in self.items():
            if block.block_hash != key:
                raise AssertionError(f"block {block.block_id} is mapped under a stale hash")


class BlockPool:
    """Owns the blocks; hands them out, takes them back, and caches full ones by hash.

    Block 0 is the null block: popped at construction, never handed out, freed,
    hashed or cached; it pads block tables. Usable capacity is num_blocks - 1.

    Eviction is lazy: a freed hashed block stays in the hash map (and can be hit and
    revived by ``touch``) until ``get_new_blocks`` pops it for reuse. The map
    (``cached_block_hash_to_block``, a BlockHashToBlockMap) may hold equal blocks.

    A block is hashed when it is allocated for the step that writes it (vLLM's
    timing), so its KV exists only once that step completes. The engine therefore
    has the pool record every block it hashes (``newly_cached``, None = not
    recording) and, when a step fails, ``uncache_blocks`` drops the hashes of the
    blocks that the failed steps were to write.

    Args:
        num_blocks: total blocks including the null block (>= 2).
        enable_caching: keep a hash -> block map for prefix hits.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if not is_int(num_blocks) or num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks!r} must be an int >= 2 (block 0 is null)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Every block cache_full_blocks hashes, in order, while a list (the engine takes
        # it after each schedule); None records nothing.
        self.newly_cached: list[KVCacheBlock] | None = None

    # -- lookup and caching -------------------------------------------------

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int] = (0,)
    ) -> list[KVCacheBlock] | None:
        """One cached block per listed group for this hash, or None if any group misses."""
        out = []
        for group_id in kv_cache_group_ids:
            block = self.lookup(make_block_hash_with_group_id(block_hash, group_id))
            if block is None:
                return None
            out.append(block)
        return out

    def lookup(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        """A cached block under a group-tagged key, or None (the hit search's lookup)."""
        return self.cached_block_hash_to_block.get_one_block(key)

    def cache_full_blocks(
        self,
        block_hashes: Sequence[BlockHash],
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        kv_cache_group_id: int = 0,
    ) -> None:
        """Hashes blocks[num_cached_blocks:num_full_blocks] and adds them to the cache.

        Args:
            block_hashes: the request's chained hashes (at least num_full_blocks).
            blocks: the request's blocks in token order.
            num_cached_blocks: how many leading blocks are already cached.
            num_full_blocks: how many leading blocks are full.
            kv_cache_group_id: the group the blocks belong to.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        assert len(block_hashes) >= num_full_blocks, (
            "a block is being cached before its hash exists: the request's hasher lags"
        )
        insert = self.cached_block_hash_to_block.insert
        record = self.newly_cached
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            assert block.block_hash is None, (
                f"block {block.block_id} is cached twice: num_cached_blocks is stale"
            )
            key = make_block_hash_with_group_id(block_hashes[i], kv_cache_group_id)
            block.block_hash = key
            insert(key, block)
            if record is not None:
                record.append(block)

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> int:
        """Drops the hashes of free blocks whose KV was never written; returns how many.

        For a failed step: its blocks were hashed when allocated, but the step that
        was to write their KV never completed, so a prefix hit on them would serve
        garbage. Each block that still has a hash leaves the hash map and moves to the
        free queue's head (unhashed blocks are reused first). Blocks without a hash
        (evicted since) are skipped.

        Raises:
            AssertionError: a block with a hash is still held (its holders were meant
                to be freed first).
        """
        queue = self.free_block_queue
        moved = []
        for block in blocks:
            if block.block_hash is None or block.is_null:
                continue
            assert block.ref_cnt == 0, (
                f"block {block.block_id} is uncached while {block.ref_cnt} tables hold it"
            )
            self._evict_cached_block(block)
            queue.remove(block)
            moved.append(block)
        if moved:
            queue.prepend_n(moved)
        return len(moved)

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        """Drops a block's hash (it is being reused); keeps any duplicate under the key."""
        self.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
        block.block_hash = None

    # -- allocation ---------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pops num_blocks blocks from the head of the free queue, ref_cnt 0 -> 1.

        A popped block that is still cached loses its hash here (lazy eviction).

        Raises:
            ValueError: if num_blocks exceeds the free blocks (callers check first).
        """
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(
                f"num_blocks={num_blocks!r} must be <= num_free_blocks={queue.num_free_blocks}"
            )
        blocks = queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            if block.block_hash is not None:
                self._evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds one reference to each block (a prefix hit); revives free ones.

        A block with ref_cnt 0 sits in the free queue; it is unlinked there, so it
        can no longer be evicted. The null block is skipped.
        """
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                if block.is_null:
                    continue  # padding, not a reference: its ref_cnt stays 0
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block, in the given (eviction) order.

        Blocks reaching ref_cnt 0 return to the free queue: unhashed ones at the
        head (reused first), hashed ones at the tail (kept longest, LRU order).
        Callers pass a request's blocks in reverse so the tail of a chain is
        evicted before its head. The null block is skipped.
        """
        unhashed = []
        hashed = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than allocated"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    unhashed.append(block)
                else:
                    hashed.append(block)
        if unhashed:
            self.free_block_queue.prepend_n(unhashed)
        if hashed:
            self.free_block_queue.append_n(hashed)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash, only when no block is in use.

        Returns:
            True if the cache was reset; False (nothing changed) if any block is held.
        """
        if self.num_blocks - self.free_block_queue.num_free_blocks != 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True

    # -- accounting ---------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (cached-but-free blocks included)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (excluding the null block) held by requests."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    def check_invariants(self) -> None:
        """Checks the pool's internal consistency; raises AssertionError on a bug.

        Checked: queue links and count; free == blocks with ref_cnt 0 (null excluded)
        so free + used == num_blocks - 1; the null block is never free, referenced or
        hashed; the hash map and the blocks' hashes agree both ways.
        """
        queue = self.free_block_queue
        queue.check_links()
        free_ids = [b.block_id for b in queue.get_all_free_blocks()]
        if len(set(free_ids)) != len(free_ids):
            raise AssertionError(f"a block is in the free queue twice: {free_ids}")
        null = self.null_block
        if null.block_id != NULL_BLOCK_ID or not null.is_null:
            raise AssertionError("block 0 is not the null block")
        if NULL_BLOCK_ID in free_ids or null.block_hash is not None or null.ref_cnt != 0:
            raise AssertionError("the null block was freed, hashed or referenced")
        zero_ref = {b.block_id for b in self.blocks[1:] if b.ref_cnt == 0}
        if zero_ref != set(free_ids):
            raise AssertionError(
                f"free queue {sorted(free_ids)} != blocks with ref_cnt 0 {sorted(zero_ref)}"
            )
        if any(b.ref_cnt < 0 for b in self.blocks):
            raise AssertionError("a block has a negative ref_cnt")
        cache = self.cached_block_hash_to_block
        cache.check_invariants()
        in_map = {block.block_id: key for key, block in cache.items()}
        hashed = {b.block_id: b.block_hash for b in self.blocks if b.block_hash is not None}
        if hashed != in_map:
            raise AssertionError("hashed blocks and the hash map disagree")
        if not self.enable_caching and hashed:
            raise AssertionError("a block was hashed with caching disabled")
