"""KVCacheManager: the scheduler's interface to blocks, prefix hits and frees.

Pure Python; never imports jax.
"""

from __future__ import annotations

from paged_jax.core.block_pool import BlockPool, KVCacheBlock
from paged_jax.core.hashing import HASH_ALGOS, BlockHasher
from paged_jax.core.kv_cache_blocks import KVCacheBlocks, PrefixCacheStats
from paged_jax.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
from paged_jax.core.request import Request
from paged_jax.core.single_type_kv_cache_manager import FullAttentionManager

__all__ = ["KVCacheBlocks", "KVCacheManager", "PrefixCacheStats"]


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return value


def _request_id(request: Request | str) -> str:
    return request if isinstance(request, str) else request.request_id


class KVCacheManager:
    """Allocates KV blocks to requests, with chained-hash prefix caching (vLLM V1).

    Holds one BlockPool and, through a coordinator, one FullAttentionManager for
    the model's single KV-cache group. Requests are tracked by request_id from
    their first allocate_slots until free.

    The manager attaches a ``BlockHasher(block_size, hash_algo)`` to any request
    that has none on first contact (get_computed_blocks or allocate_slots), which
    hashes its full blocks at once and then as tokens are appended. A request that
    brings its own BlockHasher must use the manager's block_size and hash_algo.

    Args:
        num_blocks: physical blocks including the null block 0 (>= 2).
        block_size: tokens per block.
        enable_prefix_caching: hash full blocks and serve prefix hits.
        hash_algo: "sha256" (default) or "xxhash".
        max_model_len: longest sequence (prompt + outputs) a request may reach.

    Raises:
        ValueError: on a non-positive size or an unknown hash_algo.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
        max_model_len: int,
    ) -> None:
        if hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo={hash_algo!r} must be one of {HASH_ALGOS}")
        self.block_size = _positive_int("block_size", block_size)
        self.max_model_len = _positive_int("max_model_len", max_model_len)
        self.enable_caching = bool(enable_prefix_caching)
        self.hash_algo = hash_algo
        self.block_pool = BlockPool(num_blocks, enable_caching=self.enable_caching)
        self.num_blocks = num_blocks
        manager = FullAttentionManager(
            self.block_pool, block_size, 0, enable_caching=self.enable_caching
        )
        self.coordinator = UnitaryKVCacheCoordinator(self.block_pool, [manager])
        self.num_kv_cache_groups = 1
        self.block_hasher = BlockHasher(block_size, hash_algo)
        self._empty_groups: tuple[tuple[KVCacheBlock, ...], ...] = ((),)
        self.empty_kv_cache_blocks = KVCacheBlocks(self._empty_groups)
        self._stats = PrefixCacheStats()

    # -- hashing ------------------------------------------------------------

    def _ensure_hasher(self, request: Request) -> None:
        hasher = request.block_hasher
        if hasher is None:
            request.block_hasher = self.block_hasher
        elif isinstance(hasher, BlockHasher) and (
            hasher.block_size != self.block_size or hasher.hash_algo != self.hash_algo
        ):
            raise ValueError(
                f"request.block_hasher={hasher!r} must hash {self.block_size}-token blocks "
                f"with {self.hash_algo!r} (has {hasher.block_size}, {hasher.hash_algo!r})"
            )

    # -- the scheduler's calls ------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Finds the request's longest cached prefix; changes no ref counts.

        The hit is block-aligned and covers at most num_tokens - 1 tokens, so at
        least the last token is computed (its logits are needed): a fully cached,
        block-aligned prompt of n blocks hits n - 1 of them.

        Returns:
            (hit blocks per group, number of hit tokens). (empty, 0) when caching
            is disabled.
        """
        if not self.enable_caching:
            return self.empty_kv_cache_blocks, 0
        self._ensure_hasher(request)
        num_tokens = request.num_tokens
        groups, num_hit_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, num_tokens - 1
        )
        self._stats.record(num_tokens, num_hit_tokens, request.num_preemptions > 0)
        if not num_hit_tokens:
            return self.empty_kv_cache_blocks, 0
        return KVCacheBlocks(groups), num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Gives the request slots for num_new_tokens more tokens, all or nothing.

        Token regions of the request after this call::

            | computed | new_computed (hit) | new            | lookahead |
            0          ^ num_computed_tokens                 ^ slots end here
            |<-- already held -->|<- hit blocks adopted ->|<- fresh blocks ->|
            hashed+cached: full blocks within computed + new_computed + new,
                           capped at request.num_tokens (drafts are never hashed)

        Args:
            request: the request (request.num_computed_tokens excludes the hit).
            num_new_tokens: tokens to compute in this step (may include drafts).
            num_new_computed_tokens: prefix-hit tokens from get_computed_blocks.
            new_computed_blocks: the hit blocks from get_computed_blocks.
            num_lookahead_tokens: extra slots for speculative tokens.

        Returns:
            The newly allocated blocks (not the hit), or None if the pool cannot
            serve the request now, in which case nothing changed. Free-queue hit
            blocks count as capacity needed, since adopting them unlinks them.

        Raises:
            ValueError: on negative counts, nothing to do, a hit that does not
                match its blocks or is given to a request already holding blocks,
                or computed + new tokens beyond max_model_len.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"(num_new_tokens, num_new_computed_tokens, num_lookahead_tokens)="
                f"{(num_new_tokens, num_new_computed_tokens, num_lookahead_tokens)!r} "
                "must all be >= 0"
            )
        request_id = request.request_id
        coordinator = self.coordinator
        if new_computed_blocks is None or not new_computed_blocks.blocks[0]:
            hit_groups = self._empty_groups
            num_hit_blocks = 0
        else:
            hit_groups = new_computed_blocks.blocks
            num_hit_blocks = len(hit_groups[0])
            self._check_hit(request, new_computed_blocks)
        if num_new_computed_tokens != num_hit_blocks * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens!r} must equal "
                f"{num_hit_blocks} hit blocks x block_size {self.block_size}"
            )
        if num_new_tokens == 0 and num_hit_blocks == 0:
            raise ValueError(f"num_new_tokens={num_new_tokens!r} must be > 0 with no prefix hit")
        total_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_to_compute = total_computed + num_new_tokens
        if num_tokens_to_compute > self.max_model_len:
            raise ValueError(
                f"num_new_tokens={num_new_tokens!r} must keep the request within "
                f"max_model_len={self.max_model_len} (it already has {total_computed} "
                "computed tokens)"
            )
        num_tokens_need_slot = num_tokens_to_compute + num_lookahead_tokens
        if num_tokens_need_slot > self.max_model_len:
            num_tokens_need_slot = self.max_model_len

        num_needed = coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, hit_groups
        )
        if num_needed > self.block_pool.free_block_queue.num_free_blocks:
            return None
        if num_hit_blocks:
            # Touch the hits before allocating so the allocation cannot evict them.
            coordinator.save_new_computed_blocks(request_id, hit_groups)
        new_groups = coordinator.allocate_new_blocks(request_id, num_tokens_need_slot)
        if self.enable_caching:
            if request.block_hasher is None:
                self._ensure_hasher(request)
            num_tokens = len(request.all_token_ids)
            coordinator.cache_blocks(
                request, num_tokens_to_compute if num_tokens_to_compute < num_tokens else num_tokens
            )
        if not new_groups[0]:
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(new_groups)

    def _check_hit(self, request: Request, new_computed_blocks: KVCacheBlocks) -> None:
        if not self.enable_caching:
            raise ValueError(
                f"new_computed_blocks={new_computed_blocks!r} must be empty with prefix "
                "caching disabled"
            )
        if request.num_computed_tokens or self.coordinator.manager.req_to_blocks.get(
            request.request_id
        ):
            raise ValueError(
                f"new_computed_blocks={new_computed_blocks!r} must only be given to a "
                f"request that holds no blocks (request {request.request_id!r} holds some)"
            )

    def free(self, request: Request | str) -> None:
        """Returns all of the request's blocks to the pool, last block first.

        Hashed blocks stay cached (hittable) until their block is reused.
        """
        self.coordinator.free(_request_id(request))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Caches the request's blocks that are full within num_computed_tokens."""
        if self.enable_caching:
            self._ensure_hasher(request)
            self.coordinator.cache_blocks(request, min(num_computed_tokens, request.num_tokens))

    # -- queries --------------------------------------------------------------

    def get_blocks(self, request: Request | str) -> KVCacheBlocks:
        """A snapshot of the request's blocks per group (hits plus allocated)."""
        groups = self.coordinator.get_blocks(_request_id(request))
        return KVCacheBlocks(tuple(tuple(g) for g in groups))

    def get_block_ids(self, request: Request | str) -> list[int]:
        """The request's block table (block ids in token order), e.g. ``[1, 2, 3]``.

        Unlike vLLM (one list per group) this is the single group's flat list,
        which is what the scheduler and the input batch consume; use
        get_block_ids_per_group for the per-group form.
        """
        return [b.block_id for b in self.coordinator.manager.get_blocks(_request_id(request))]

    def get_block_ids_per_group(self, request: Request | str) -> tuple[list[int], ...]:
        """The request's block table per KV-cache group, e.g. ``([1, 2, 3],)``."""
        groups = self.coordinator.get_blocks(_request_id(request))
        return tuple([b.block_id for b in g] for g in groups)

    def get_num_blocks(self, request: Request | str) -> int:
        """Number of blocks in the request's table (0 if it holds none)."""
        return len(self.coordinator.manager.get_blocks(_request_id(request)))

    def get_num_common_prefix_blocks(
        self, request: Request | str, num_running_requests: int
    ) -> list[int]:
        """Per group, the leading blocks of this running request that all
        num_running_requests running requests share (ref_cnt == that number)."""
        return self.coordinator.get_num_common_prefix_blocks(
            _request_id(request), num_running_requests
        )

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free-queue blocks, cached ones included)."""
        return self.block_pool.free_block_queue.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks excluding the null block."""
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1]."""
        return self.block_pool.get_usage()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The live counters since the last make_prefix_cache_stats() call."""
        return self._stats

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Returns the counters and starts a fresh set."""
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block, only if no request holds blocks.

        Returns:
            True on success; False (nothing changed) while blocks are in use.
        """
        if not self.block_pool.reset_prefix_cache():
            return False
        self._stats.reset = True
        return True

    def check_invariants(self) -> None:
        """Checks pool and table consistency; raises AssertionError on a bug.

        Beyond BlockPool.check_invariants: every block's ref_cnt equals the number
        of request tables holding it, no table holds the null block or a block
        twice, and exactly the first num_cached blocks of each table are hashed.
        """
        self.block_pool.check_invariants()
        holders = [0] * self.num_blocks
        for manager in self.coordinator.managers:
            for request_id, blocks in manager.req_to_blocks.items():
                ids = [b.block_id for b in blocks]
                if len(set(ids)) != len(ids):
                    raise AssertionError(f"request {request_id!r} holds a block twice: {ids}")
                num_cached = manager.num_cached_block[request_id]
                if num_cached > len(blocks):
                    raise AssertionError(f"request {request_id!r} caches more blocks than held")
                for i, block in enumerate(blocks):
                    if block.is_null:
                        raise AssertionError(f"request {request_id!r} holds the null block")
                    if (block.block_hash is not None) != (i < num_cached):
                        raise AssertionError(
                            f"request {request_id!r} block {i} (id {block.block_id}) hashed "
                            f"state disagrees with num_cached_block={num_cached}"
                        )
                    holders[block.block_id] += 1
        for block in self.block_pool.blocks[1:]:
            if block.ref_cnt != holders[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id} ref_cnt={block.ref_cnt} but "
                    f"{holders[block.block_id]} requests hold it"
                )
