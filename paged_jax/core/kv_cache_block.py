"""KVCacheBlock and the intrusive doubly linked free queue that orders eviction.

Pure Python; never imports jax. Re-exported by paged_jax.core.block_pool.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NewType

from paged_jax.core.hashing import BlockHashWithGroupId

BlockId = NewType("BlockId", int)
"""Index of a physical KV block; 0 is the null block."""


class KVCacheBlock:
    """Metadata of one physical KV block.

    Attributes:
        block_id: 0 .. num_blocks - 1; block 0 is the null block.
        ref_cnt: number of requests whose block table holds this block.
        block_hash: the group-tagged hash key while the block is cached, else None.
        prev_free_block: free-queue link (None when not in the queue).
        next_free_block: free-queue link (None when not in the queue).
        is_null: True only for block 0.
    """

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "prev_free_block",
        "next_free_block",
        "is_null",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = BlockId(block_id)
        self.ref_cnt = 0
        self.block_hash: BlockHashWithGroupId | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        hashed = "hashed" if self.block_hash is not None else "unhashed"
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, {hashed})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the head is reused first, the tail last.

    An intrusive doubly linked list threaded through the blocks' own
    prev/next_free_block fields, between two sentinel blocks (id -1), so every
    operation is O(1) per block and never allocates list nodes::

        sentinel_head <-> b_a <-> b_b <-> ... <-> b_z <-> sentinel_tail
                          ^ popleft (reuse)          ^ append (evict last)

    Args:
        blocks: the initial free blocks, linked in the given order.
    """

    __slots__ = ("num_free_blocks", "_head", "_tail")

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(list(blocks))

    def popleft(self) -> KVCacheBlock:
        """Removes and returns the head block.

        Raises:
            ValueError: if the queue is empty.
        """
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError(f"num_free_blocks={self.num_free_blocks} must be > 0 to popleft")
        nxt = block.next_free_block
        self._head.next_free_block = nxt
        nxt.prev_free_block = self._head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Removes and returns the first n blocks, head first.

        Raises:
            ValueError: if n is negative or larger than the number of free blocks.
        """
        if n < 0 or n > self.num_free_blocks:
            raise ValueError(f"n={n!r} must be in [0, num_free_blocks={self.num_free_blocks}]")
        out = []
        block = self._head.next_free_block
        for _ in range(n):
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlinks a block from anywhere in the queue (a prefix hit revives it).

        Raises:
            ValueError: if the block is not in the queue.
        """
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block={block!r} must be in the free queue to be removed")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Adds a block at the tail (evicted last)."""
        self.append_n((block,))

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds blocks at the tail, keeping their order (the last one ends at the tail)."""
        tail = self._tail
        prev = tail.prev_free_block
        count = 0
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
            count += 1
        prev.next_free_block = tail
        tail.prev_free_block = prev
        self.num_free_blocks += count

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds blocks at the head, keeping their order (the first one becomes the head)."""
        head = self._head
        after = head.next_free_block
        prev = head
        count = 0
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
            count += 1
        prev.next_free_block = after
        after.prev_free_block = prev
        self.num_free_blocks += count

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head (next to be reused) first. O(n); for tests and checks."""
        out = []
        block = self._head.next_free_block
        while block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out

    def check_links(self) -> None:
        """Raises AssertionError if the links or the count are inconsistent."""
        seen = 0
        prev = self._head
        block = self._head.next_free_block
        while block is not self._tail:
            if block is None or block.prev_free_block is not prev:
                raise AssertionError("free queue back-link broken: a link update was missed")
            seen += 1
            if seen > self.num_free_blocks:
                raise AssertionError("free queue longer than num_free_blocks: a count is off")
            prev, block = block, block.next_free_block
        if self._tail.prev_free_block is not prev or seen != self.num_free_blocks:
            raise AssertionError(
                f"free queue holds {seen} blocks but num_free_blocks={self.num_free_blocks}"
            )
