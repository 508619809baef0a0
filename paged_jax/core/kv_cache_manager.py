"""KVCacheManager: the scheduler's interface to blocks, prefix hits and frees.

Pure Python; never imports jax.
"""

from __future__ import annotations

from paged_jax.core.block_pool import BlockPool, KVCacheBlock
from paged_jax.core.copy_on_write import (
    BlockCopies,
    PendingCopies,
    fork_blocks,
    written_shared_blocks,
)
from paged_jax.core.decode_fast_path import allocate_decode_slots
from paged_jax.core.hashing import HASH_ALGOS, BlockHasher
from paged_jax.core.kv_cache_blocks import KVCacheBlocks, PrefixCacheStats
from paged_jax.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    UnitaryKVCacheCoordinator,
)
from paged_jax.core.kv_cache_invariants import check_kv_cache_manager
from paged_jax.core.kv_cache_spec import FULL_ATTENTION, KVCacheGroupSpec
from paged_jax.core.request import Request
from paged_jax.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
)
from paged_jax.core.sliding_window_manager import SlidingWindowManager

__all__ = ["KVCacheBlocks", "KVCacheManager", "PrefixCacheStats"]


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return value


def _request_id(request: Request | str) -> str:
    return request if isinstance(request, str) else request.request_id


class KVCacheManager:
    """Allocates KV blocks to requests, with chained-hash prefix caching (vLLM V1).

    Holds one BlockPool and, through a coordinator, one manager per KV-cache group
    (FullAttentionManager or SlidingWindowManager). A single group (the default: full
    attention) takes the unitary fast path; several groups share the pool through
    HybridKVCacheCoordinator and a request holds one block table per group.
    Requests are tracked by request_id from their first allocate_slots until free.

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
        kv_cache_groups: one KVCacheGroupSpec per group, indexed by group id; default
            one full-attention group.

    Raises:
        ValueError: on a non-positive size, an unknown hash_algo or no groups.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
        max_model_len: int,
        kv_cache_groups: tuple[KVCacheGroupSpec, ...] | list[KVCacheGroupSpec] = (FULL_ATTENTION,),
    ) -> None:
        if hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo={hash_algo!r} must be one of {HASH_ALGOS}")
        self.block_size = _positive_int("block_size", block_size)
        self.max_model_len = _positive_int("max_model_len", max_model_len)
        self.enable_caching = bool(enable_prefix_caching)
        self.hash_algo = hash_algo
        self.block_pool = BlockPool(num_blocks, enable_caching=self.enable_caching)
        self.num_blocks = num_blocks
        groups = tuple(kv_cache_groups)
        if not groups or not all(isinstance(g, KVCacheGroupSpec) for g in groups):
            raise ValueError(
                f"kv_cache_groups={kv_cache_groups!r} must be a non-empty sequence of "
                "KVCacheGroupSpec"
            )
        self.kv_cache_groups = groups
        managers = [self._make_manager(g, i) for i, g in enumerate(groups)]
        self.coordinator: KVCacheCoordinator = (
            UnitaryKVCacheCoordinator(self.block_pool, managers)
            if len(managers) == 1
            else HybridKVCacheCoordinator(self.block_pool, managers)
        )
        self.num_kv_cache_groups = len(groups)
        # Only window groups ever free blocks before a request ends.
        self._has_window = any(g.sliding_window is not None for g in groups)
        self.block_hasher = BlockHasher(block_size, hash_algo)
        self._empty_groups: tuple[tuple[KVCacheBlock, ...], ...] = tuple(() for _ in groups)
        self.empty_kv_cache_blocks = KVCacheBlocks(self._empty_groups)
        self._stats = PrefixCacheStats()
        self.pending_copies = PendingCopies(self.block_pool)
        # allocate_slots' fast path (one full-attention group): a step whose tokens fit
        # the request's last held block, unshared, completing no block to cache.
        self._fast_manager = managers[0] if len(managers) == 1 and not self._has_window else None

    def _make_manager(self, group: KVCacheGroupSpec, group_id: int) -> SingleTypeKVCacheManager:
        if group.sliding_window is None:
            return FullAttentionManager(
                self.block_pool, self.block_size, group_id, enable_caching=self.enable_caching
            )
        return SlidingWindowManager(
            self.block_pool,
            self.block_size,
            group_id,
            sliding_window=group.sliding_window,
            enable_caching=self.enable_caching,
        )

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

        Sliding-window groups first free the blocks wholly below
        computed + new_computed - W + 1 (replaced by the null block; done even if the
        allocation then fails, as in vLLM), then count what is still missing. The
        count sums every group, so the allocation is all-or-nothing across groups.

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
        fast = self._fast_manager
        if (
            fast is not None
            and new_computed_blocks is None
            and num_new_tokens > 0
            and not num_new_computed_tokens
            and not num_lookahead_tokens
        ):
            new_blocks = allocate_decode_slots(self, fast, request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks
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

        if self._has_window:
            coordinator.remove_skipped_blocks(request_id, total_computed)
        num_needed = coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, hit_groups
        )
        # Writes into blocks a fork still shares copy them first (one fresh block each).
        cow = self._shared_writes(request, num_tokens_need_slot) if not num_hit_blocks else ()
        if num_needed + len(cow) > self.block_pool.free_block_queue.num_free_blocks:
            return None
        if num_hit_blocks:
            # Touch the hits before allocating so the allocation cannot evict them.
            coordinator.save_new_computed_blocks(request_id, hit_groups)
        for manager, index in cow:
            self.pending_copies.copy_on_write(request_id, manager, index)
        new_groups = coordinator.allocate_new_blocks(request_id, num_tokens_need_slot)
        if self.enable_caching:
            if request.block_hasher is None:
                self._ensure_hasher(request)
            num_tokens = len(request.all_token_ids)
            coordinator.cache_blocks(
                request, num_tokens_to_compute if num_tokens_to_compute < num_tokens else num_tokens
            )
        if not any(new_groups):
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(new_groups)

    def _shared_writes(self, request: Request, end_token: int) -> list:
        """(manager, block index) of every shared block the request's next tokens write into."""
        out = []
        for manager in self.coordinator.managers:
            blocks = manager.req_to_blocks.get(request.request_id)
            if blocks:
                indices = written_shared_blocks(
                    blocks,
                    request.num_computed_tokens,
                    end_token,
                    manager.block_size,
                    self.pending_copies,
                )
                out.extend((manager, i) for i in indices)
        return out

    def _check_hit(self, request: Request, new_computed_blocks: KVCacheBlocks) -> None:
        if not self.enable_caching:
            raise ValueError(
                f"new_computed_blocks={new_computed_blocks!r} must be empty with prefix "
                "caching disabled"
            )
        if request.num_computed_tokens or any(
            m.req_to_blocks.get(request.request_id) for m in self.coordinator.managers
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

    def fork(
        self, parent_request: Request, child_request: Request, num_tokens: int | None = None
    ) -> int:
        """Gives ``child_request`` the blocks holding ``parent_request``'s first num_tokens
        tokens, shared.

        Every shared block gains one reference (full and partial blocks alike); no KV
        is copied now. The first write into a block that is still shared copies it:
        ``allocate_slots`` gives the writer a fresh block in that table slot and
        schedules a device copy (see ``take_pending_copies``). Freeing stays per
        request. A partially shared block that the parent has already hashed (full in
        the parent, so not the child's) is not shared; the child recomputes it.

        Args:
            parent_request: a request holding blocks for at least num_tokens computed tokens.
            child_request: a request holding no blocks whose first num_tokens token ids equal
                the parent's (for example ``parent.fork(...)``).
            num_tokens: tokens to share; default ``parent_request.num_computed_tokens``.

        Returns:
            How many of the child's tokens are now computed: set
            ``child_request.num_computed_tokens`` to it.

        Fork between steps: every computed token of the parent must have its KV
        written, and this step's copies must have been taken.

        Raises:
            ValueError: the child holds blocks, num_tokens is out of range, the two
                requests' tokens differ within num_tokens, or copies are pending.
        """
        if self.enable_caching:
            self._ensure_hasher(child_request)
        return fork_blocks(
            self.coordinator.managers,
            self.block_pool,
            parent_request,
            child_request,
            num_tokens,
            self.pending_copies,
        )

    def take_pending_copies(self) -> BlockCopies:
        """The copy-on-write block copies scheduled since the last call.

        Call once per step, after the last allocate_slots of the step: the copies
        (``.pairs``, (src, dst) block ids) must run on device before that step's KV
        writes, and ``.table_updates`` says which table slots now name the copies.
        Releases the holds that kept both blocks of every copy out of the free queue
        meanwhile.
        """
        return self.pending_copies.take()

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
        """Group 0's block table (block ids in token order), e.g. ``[1, 2, 3]``.

        Unlike vLLM (one list per group) this is the first group's flat list, the
        whole table of a single-group model; use get_block_ids_per_group for the
        per-group form. Out-of-window entries of a sliding group read 0 (null).
        """
        return [b.block_id for b in self.coordinator.managers[0].get_blocks(_request_id(request))]

    def get_block_ids_per_group(self, request: Request | str) -> tuple[list[int], ...]:
        """The request's block table per KV-cache group, e.g. ``([1, 2, 3],)``."""
        groups = self.coordinator.get_blocks(_request_id(request))
        return tuple([b.block_id for b in g] for g in groups)

    def get_num_blocks(self, request: Request | str) -> int:
        """Length of the request's group-0 table, null entries included (0 if none)."""
        return len(self.coordinator.managers[0].get_blocks(_request_id(request)))

    def max_blocks_per_request(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """Most blocks one request of num_tokens tokens holds at once, over all groups.

        Full attention holds every block; a window group at most the blocks of its
        window plus one step's chunk: cdiv(W - 1 + max_chunk_tokens, block_size) + 1
        (vLLM's SlidingWindowSpec bound).
        """
        bs = self.block_size
        num_blocks = -(-num_tokens // bs)
        total = 0
        for group in self.kv_cache_groups:
            if group.sliding_window is None:
                total += num_blocks
            else:
                bound = -(-(group.sliding_window - 1 + max_chunk_tokens) // bs) + 1
                total += min(num_blocks, bound)
        return total

    def get_num_blocks_held(self, request: Request | str) -> int:
        """Real (non-null) blocks the request holds over all groups: its KV footprint."""
        request_id = _request_id(request)
        total = 0
        for m in self.coordinator.managers:
            blocks = m.get_blocks(request_id)
            # Nulls only form a leading run: binary-search its end (O(log n) per group).
            lo, hi = 0, len(blocks)
            while lo < hi:
                mid = (lo + hi) // 2
                if blocks[mid].is_null:
                    lo = mid + 1
                else:
                    hi = mid
            total += len(blocks) - lo
        return total

    @property
    def has_sliding_window(self) -> bool:
        """True if some group frees out-of-window blocks before its requests end."""
        return self._has_window

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

        See paged_jax.core.kv_cache_invariants.check_kv_cache_manager for the rules.
        """
        check_kv_cache_manager(self)
