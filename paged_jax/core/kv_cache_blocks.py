"""KVCacheBlocks (the scheduler-facing block lists) and PrefixCacheStats.

Pure Python; never imports jax. Re-exported by paged_jax.core.kv_cache_manager.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from paged_jax.core.kv_cache_block import KVCacheBlock


class KVCacheBlocks:
    """Blocks per KV-cache group: ``blocks[group][i]``.

    Returned by KVCacheManager.get_computed_blocks (the hit), allocate_slots (the
    newly allocated blocks only) and get_blocks (a snapshot of a request's table).

    Args:
        blocks: one sequence of blocks per KV-cache group.
    """

    __slots__ = ("blocks",)

    def __init__(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> None:
        self.blocks = blocks

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVCacheBlocks):
            return NotImplemented
        return tuple(map(list, self.blocks)) == tuple(map(list, other.blocks))

    __hash__ = None  # mutable contents

    def __repr__(self) -> str:
        return f"KVCacheBlocks(block_ids={self.get_block_ids()})"

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group, e.g. ``([1, 2, 3],)`` for one group."""
        return tuple([b.block_id for b in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the not-yet-cached blocks of the single group."""
        assert len(self.blocks) == 1, "get_unhashed_block_ids is defined for one group only"
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def num_blocks(self) -> int:
        """Total blocks over all groups."""
        return sum(len(group) for group in self.blocks)

    def new_empty(self) -> KVCacheBlocks:
        """An empty KVCacheBlocks with the same number of groups."""
        return KVCacheBlocks(tuple(() for _ in self.blocks))


@dataclasses.dataclass
class PrefixCacheStats:
    """Prefix-cache counters since the last make_prefix_cache_stats() call.

    Attributes:
        requests: get_computed_blocks lookups.
        queries: tokens looked up (request.num_tokens per lookup).
        hits: tokens served from the cache.
        preempted_requests / preempted_queries / preempted_hits: the same, for
            lookups by requests that were preempted before (resumes).
        reset: True if reset_prefix_cache succeeded in this period.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Adds one lookup of num_tokens tokens that hit num_hits of them."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """Hit tokens / queried tokens over first-time lookups (0.0 with no queries)."""
        return self.hits / self.queries if self.queries else 0.0

    @property
    def total_hit_rate(self) -> float:
        """Hit tokens / queried tokens including resumes after preemption."""
        queries = self.queries + self.preempted_queries
        return (self.hits + self.preempted_hits) / queries if queries else 0.0
