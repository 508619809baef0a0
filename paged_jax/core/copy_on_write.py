"""Forks and copy-on-write of shared blocks: the PagedAttention paper's sharing (§4.4).

A fork gives a child request its parent's blocks by reference count (full and
partial). The first write into a block that another request still holds copies it:
the writer gets a fresh block in the same table slot and the host schedules a
device copy (src, dst) that runs before the step's KV writes. Pure Python; never
imports jax.

    parent table  [b1 b2 b3*]        * = partial, shared after the fork
    child table   [b1 b2 b3*]        ref_cnt(b3) = 2
    child writes  [b1 b2 b7 ]        pending copy (b3 -> b7), ref_cnt(b3) = 1

Until the step that runs a copy is packed (``PendingCopies.take``), both of its
blocks carry one extra reference (a *hold*): neither can be reallocated, swapped
in over, or handed out as another copy's destination in the same scheduling round,
so the device can run all of a step's copies in any order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from paged_jax.core.block_pool import BlockPool, KVCacheBlock

if TYPE_CHECKING:
    from paged_jax.core.request import Request
    from paged_jax.core.single_type_kv_cache_manager import SingleTypeKVCacheManager


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

    def num_holders(self, block: KVCacheBlock) -> int:
        """Requests holding the block: its ref_cnt minus this round's holds."""
        return block.ref_cnt - self.holds.get(block.block_id, 0)

    def is_shared(self, block: KVCacheBlock) -> bool:
        """True when a write into the block must copy it first (another request holds it)."""
        return not block.is_null and self.num_holders(block) > 1

    def copy_on_write(
        self, request_id: str, manager: SingleTypeKVCacheManager, index: int
    ) -> KVCacheBlock:
        """Replaces the request's (shared) block at ``index`` with a fresh one; schedules the copy.

        The caller has checked that the pool has a free block. The writer's
        reference to the old block becomes a hold, so its ref_cnt is unchanged until
        ``take``; the fresh block gets a hold too.

        Returns:
            The fresh block now at that table slot.
        """
        blocks = manager.req_to_blocks[request_id]
        old = blocks[index]
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
        blocks[index] = new
        if manager.num_cached_block[request_id] > index:
            manager.num_cached_block[request_id] = index  # the fresh copy is not hashed yet
        self._updates.setdefault(request_id, []).append(
            (manager.kv_cache_group_id, index, new.block_id)
        )
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


def fork_blocks(
    managers: Sequence[SingleTypeKVCacheManager],
    block_pool: BlockPool,
    parent: Request,
    child: Request,
    num_tokens: int | None,
    pending_copies: PendingCopies,
) -> int:
    """KVCacheManager.fork: the child's tables become prefixes of the parent's, shared.

    Returns:
        The child's computed tokens (num_tokens, or fewer when the parent's block
        holding token num_tokens is already hashed and so cannot be shared).
    """
    if num_tokens is None:
        num_tokens = parent.num_computed_tokens
    if pending_copies:
        raise ValueError(
            f"fork of {parent.request_id!r} must wait until this step's "
            f"{len(pending_copies)} pending copies are taken (fork between steps)"
        )
    if not 0 < num_tokens <= parent.num_computed_tokens:
        raise ValueError(
            f"num_tokens={num_tokens!r} must be in [1, parent.num_computed_tokens="
            f"{parent.num_computed_tokens}]"
        )
    if any(m.req_to_blocks.get(child.request_id) for m in managers):
        raise ValueError(f"child={child.request_id!r} must hold no blocks to be forked into")
    if (child.cache_salt, child.adapter_id) != (parent.cache_salt, parent.adapter_id):
        raise ValueError(
            f"child (cache_salt, adapter_id)={(child.cache_salt, child.adapter_id)!r} must "
            f"equal the parent's {(parent.cache_salt, parent.adapter_id)!r}: shared blocks "
            "carry the parent's hashes"
        )
    if child.all_token_ids[:num_tokens] != parent.all_token_ids[:num_tokens]:
        raise ValueError(
            f"child={child.request_id!r} must start with the parent's first {num_tokens} token ids"
        )
    num_shared = num_tokens
    for manager in managers:
        bs = manager.block_size
        blocks = manager.req_to_blocks.get(parent.request_id, [])
        num_blocks = -(-num_tokens // bs)
        assert len(blocks) >= num_blocks, (
            f"request {parent.request_id!r} has computed tokens without blocks"
        )
        if num_tokens % bs and blocks[num_blocks - 1].block_hash is not None:
            # Full (and cached) in the parent but only partly the child's: not shared.
            num_shared = min(num_shared, (num_blocks - 1) * bs)
    for manager in managers:
        num_blocks = -(-num_shared // manager.block_size)
        if num_blocks:
            shared = manager.req_to_blocks[parent.request_id][:num_blocks]
            block_pool.touch(shared)
            manager.req_to_blocks[child.request_id] = shared
        manager.num_cached_block[child.request_id] = min(
            manager.num_cached_block.get(parent.request_id, 0), num_blocks
        )
    return num_shared


def written_shared_blocks(
    blocks: Sequence[KVCacheBlock],
    first_token: int,
    end_token: int,
    block_size: int,
    pending: PendingCopies,
) -> list[int]:
    """Indices of held blocks that tokens [first_token, end_token) write into while shared."""
    first = first_token // block_size
    last = min(len(blocks), -(-end_token // block_size))
    return [i for i in range(first, last) if pending.is_shared(blocks[i])]
