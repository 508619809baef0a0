"""Copy-on-write of blocks shared by forks: the PagedAttention paper's sharing (§4.4).

A fork (``KVCacheManager.fork``) gives a child request its parent's blocks by
reference count (full and partial). The first write into a block that another
request still holds copies it: the writer gets a fresh block in the same table slot
and the host schedules a device copy (src, dst) that runs before the step's KV
writes. Pure Python; never imports jax.

    parent table  [b1 b2 b3*]        * = partial, shared after the fork
    child table   [b1 b2 b3*]        ref_cnt(b3) = 2
    child writes  [b1 b2 b7 ]        pending copy (b3 -> b7), ref_cnt(b3) = 1

Until the step that runs a copy is packed (``PendingCopies.take``), both of its
blocks carry one extra reference (a *hold*): neither can be reallocated, swapped
in over, or handed out as another copy's destination in the same scheduling round,
so the device can run all of a step's copies in any order.
"""

from __future__ import annotations

from typing import NamedTuple

from paged_jax.core.block_pool import BlockPool, KVCacheBlock


def max_copies_per_step(max_num_seqs: int, num_kv_cache_groups: int) -> int:
    """The most copies on write one step can have: one per scheduled sequence and group.

    A sequence only writes at and after its computed tokens, and the only block it can
    share there is the partial last block a fork left it (full shared blocks are never
    written again), so each scheduled sequence copies at most one block per KV-cache
    group. Hybrid models (sliding-window and full-attention groups) copy once per group.
    """
    return max_num_seqs * num_kv_cache_groups


class BlockCopies(NamedTuple):
    """One step's copy-on-write work, from ``KVCacheManager.take_pending_copies``.

    Attributes:
        pairs: (src, dst) block ids; the device copies src into dst before the
            step's KV writes. Destinations are distinct and never a source.
        table_updates: request id -> (group id, table index, new block id) for every
            table slot that now names a copy instead of the shared block.
    """

    pairs: list[tuple[int, int]]
    table_updates: dict[str, list[tuple[int, int, int]]]


class PendingCopies:
    """The copy-on-write copies of the current scheduling round and their holds.

    Args:
        block_pool: the pool whose blocks are copied.
    """

    def __init__(self, block_pool: BlockPool) -> None:
        self.block_pool = block_pool
        # dst block id -> (src block, dst block); insertion order is schedule order.
        self._by_dst: dict[int, tuple[KVCacheBlock, KVCacheBlock]] = {}
        # block id -> number of holds on it (a block can be the source of several copies).
        self.holds: dict[int, int] = {}
        self._updates: dict[str, list[tuple[int, int, int]]] = {}

    def __len__(self) -> int:
        return len(self._by_dst)

    def num_holds(self, block_id: int) -> int:
        """This round's holds on a block (0 for most blocks)."""
        return self.holds.get(block_id, 0)

    def num_holders(self, block: KVCacheBlock) -> int:
        """Requests holding the block: its ref_cnt minus this round's holds."""
        return block.ref_cnt - self.holds.get(block.block_id, 0)

    def is_shared(self, block: KVCacheBlock) -> bool:
        """True when a write into the block must copy it first (another request holds it)."""
        return not block.is_null and self.num_holders(block) > 1

    def copy_on_write(
        self, request_id: str, kv_cache_group_id: int, index: int, old: KVCacheBlock
    ) -> KVCacheBlock:
        """Takes a fresh block for the shared block ``old`` at a table slot; schedules the copy.

        The caller has checked that the pool has a free block, and puts the fresh
        block into the slot (group kv_cache_group_id, position index of the request's
        table). The writer's reference to the old block becomes a hold, so its
        ref_cnt is unchanged until ``take``; the fresh block gets a hold too.

        Returns:
            The fresh block (ref_cnt 2: the writer's table and the hold).
        """
        assert self.is_shared(old), (
            f"block {old.block_id} is copied on write but no other request holds it"
        )
        # Only forks share partial blocks, and forks wait for the round's copies to be
        # taken, so a block waiting for its own copy is never shared.
        assert old.block_id not in self._by_dst, (
            f"block {old.block_id} is shared before its copy ran: a fork happened mid-step"
        )
        (new,) = self.block_pool.get_new_blocks(1)
        self.holds[old.block_id] = self.holds.get(old.block_id, 0) + 1
        self._hold(new)
        self._by_dst[new.block_id] = (old, new)
        self._updates.setdefault(request_id, []).append((kv_cache_group_id, index, new.block_id))
        return new

    def _hold(self, block: KVCacheBlock) -> None:
        self.block_pool.touch((block,))
        self.holds[block.block_id] = self.holds.get(block.block_id, 0) + 1

    def source_of(self, block_id: int) -> int:
        """The block whose KV ``block_id`` holds right now (its copy source while pending)."""
        pending = self._by_dst.get(block_id)
        return block_id if pending is None else pending[0].block_id

    def take(self) -> BlockCopies:
        """This round's copies, in schedule order, and the table slots they fill; releases holds.

        A copy whose destination no request holds any more (its writer was freed or
        preempted in the same round) is dropped: nothing would read it.
        """
        pairs = [
            (src.block_id, dst.block_id)
            for src, dst in self._by_dst.values()
            if self.num_holders(dst) > 0
        ]
        held = [self.block_pool.blocks[b] for b, n in self.holds.items() for _ in range(n)]
        updates = self._updates
        self._by_dst.clear()
        self.holds.clear()
        self._updates = {}
        self.block_pool.free_blocks(held)
        return BlockCopies(pairs, updates)
