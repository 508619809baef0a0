"""Coordinator: one BlockPool shared by the KV-cache groups, one manager per group.

Only the single-group (unitary) coordinator exists today; a hybrid coordinator
(full attention + sliding window, iterative hit-length fixed point) would subclass
KVCacheCoordinator and override find_longest_cache_hit. Pure Python; never imports jax.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_jax.core.block_pool import BlockPool, KVCacheBlock
from paged_jax.core.hashing import BlockHash
from paged_jax.core.request import Request
from paged_jax.core.single_type_kv_cache_manager import SingleTypeKVCacheManager


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
        m = self.manager
        hits = m.find_longest_cache_hit(
            block_hashes, max_length, self.block_pool, m.kv_cache_group_id, m.block_size
        )
        return (hits,), len(hits) * m.block_size

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

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        self.manager.cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        self.manager.free(request_id)
