"""Coordinators: one BlockPool shared by the KV-cache groups, one manager per group.

UnitaryKVCacheCoordinator serves single-group models (the fast path);
HybridKVCacheCoordinator serves several groups (full attention + sliding windows) and
finds prefix hits valid for every group by an iterative fixed point. Pure Python;
never imports jax.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_jax.core.block_pool import BlockPool, KVCacheBlock
from paged_jax.core.hashing import BlockHash
from paged_jax.core.request import Request
from paged_jax.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
)


class KVCacheCoordinator:
    """Fans block operations out to every group's manager over one shared pool.

    Args:
        block_pool: the shared pool.
        managers: one manager per KV-cache group, indexed by group id.
    """

    def __init__(self, block_pool: BlockPool, managers: Sequence[SingleTypeKVCacheManager]):
        self.block_pool = block_pool
        self.managers = tuple(managers)
        assert all(m.kv_cache_group_id == i for i, m in enumerate(self.managers)), (
            "managers must be indexed by their kv_cache_group_id"
        )

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Hit blocks per group and the hit length in tokens (same for all groups)."""
        raise NotImplementedError

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
    ) -> int:
        return sum(
            m.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[i])
            for i, m in enumerate(self.managers)
        )

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: tuple[Sequence[KVCacheBlock], ...]
    ) -> None:
        # Touch every group's hits before any group allocates, so one group's new
        # blocks can never evict another group's hits.
        for i, m in enumerate(self.managers):
            m.save_new_computed_blocks(request_id, new_computed_blocks[i])

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.allocate_new_blocks(request_id, num_tokens) for m in self.managers)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        for m in self.managers:
            m.cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.get_blocks(request_id) for m in self.managers)

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> list[int]:
        return [
            m.get_num_common_prefix_blocks(request_id, num_running_requests) for m in self.managers
        ]


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Exactly one KV-cache group: hits come straight from its manager."""

    def __init__(self, block_pool: BlockPool, managers: Sequence[SingleTypeKVCacheManager]):
        super().__init__(block_pool, managers)
        assert len(self.managers) == 1, "the unitary coordinator serves exactly one group"
        self.manager = self.managers[0]

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        hits = self.manager.longest_cache_hit(block_hashes, max_length)
        return (hits,), len(hits) * self.manager.block_size

    # Direct single-manager versions of the fan-out methods: these run for every
    # request on every step, where generator and tuple overhead shows.

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
    ) -> int:
        return self.manager.get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks[0]
        )

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int
    ) -> tuple[list[KVCacheBlock], ...]:
        return (self.manager.allocate_new_blocks(request_id, num_tokens),)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        self.manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        self.manager.cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        self.manager.free(request_id)


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several KV-cache groups (e.g. full attention + a sliding window) over one pool.

    All groups use one block size, so a hit of h tokens is h / block_size blocks in
    every group's table (null-padded below a window). allocate_slots stays
    all-or-nothing across groups because the caller counts every group's blocks
    (get_num_blocks_to_allocate sums them) before any group takes one.
    """

    def __init__(self, block_pool: BlockPool, managers: Sequence[SingleTypeKVCacheManager]):
        super().__init__(block_pool, managers)
        assert len(self.managers) >= 2, "use the unitary coordinator for one group"
        sizes = {m.block_size for m in self.managers}
        assert len(sizes) == 1, f"groups must share one block size, got {sorted(sizes)}"
        self.block_size = sizes.pop()
        # Full attention first: its hit is downward closed (any prefix of a hit is a
        # hit), so it is looked up once and then only trimmed.
        self.full_managers = [m for m in self.managers if isinstance(m, FullAttentionManager)]
        self.other_managers = [m for m in self.managers if not isinstance(m, FullAttentionManager)]

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest hit valid for every group: a fixed point of per-group searches.

        Start from max_length; every group returns its longest hit no longer than the
        candidate. A sliding-window hit is not downward closed (a shorter length needs
        a different run of cached blocks), so whenever a group lowers the candidate
        every other window group searches again; the loop ends when one full pass
        lowers nothing, at which point every group's list has the final length.
        """
        bs = self.block_size
        hit_length = max_length // bs * bs
        hits: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        for m in self.full_managers:
            found = m.longest_cache_hit(block_hashes, hit_length)
            hits[m.kv_cache_group_id] = found
            hit_length = min(hit_length, len(found) * bs)
        changed = True
        while changed and hit_length > 0:
            changed = False
            for m in self.other_managers:
                found = m.longest_cache_hit(block_hashes, hit_length)
                hits[m.kv_cache_group_id] = found
                if len(found) * bs < hit_length:
                    hit_length = len(found) * bs
                    changed = True
        num_blocks = hit_length // bs
        return tuple(h[:num_blocks] for h in hits), hit_length
