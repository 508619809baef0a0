"""KVCacheManager: the scheduler's interface to blocks, prefix hits, forks and frees.

Also its return type KVCacheBlocks and its PrefixCacheStats counters. Pure Python;
never imports jax.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from paged_jax.constants import HASH_ALGOS, cdiv, is_int
from paged_jax.core.block_pool import BlockPool, KVCacheBlock
from paged_jax.core.copy_on_write import BlockCopies, PendingCopies
from paged_jax.core.hashing import BlockHasher
from paged_jax.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    UnitaryKVCacheCoordinator,
)
from paged_jax.core.kv_cache_spec import FULL_ATTENTION, KVCacheGroupSpec
from paged_jax.core.request import Request
from paged_jax.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
)
from paged_jax.core.sliding_window_manager import SlidingWindowManager

__all__ = ["KVCacheBlocks", "KVCacheManager", "PrefixCacheStats"]


def _positive_int(name: str, value: object) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return value


def _request_id(request: Request | str) -> str:
    return request if isinstance(request, str) else request.request_id


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
        decode_fast_path: serve the decode special case (see allocate_slots) without
            the general path where it applies (one full-attention group). False
            always takes the general path; the two decide the same.

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
        decode_fast_path: bool = True,
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
        # The one full-attention group whose decode steps skip the general path.
        self._decode_manager: SingleTypeKVCacheManager | None = (
            managers[0]
            if decode_fast_path and len(managers) == 1 and not self._has_window
            else None
        )

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
        ``Request.max_cache_hit_tokens`` lowers that cap (prompt logprobs of a tail).

        Returns:
            (hit blocks per group, number of hit tokens). (empty, 0) when caching
            is disabled or the request skips reading the cache
            (``Request.skip_reading_prefix_cache``; not counted as a query).
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        self._ensure_hasher(request)
        num_tokens = request.num_tokens
        limit = num_tokens - 1
        if request.max_cache_hit_tokens is not None:
            limit = min(limit, request.max_cache_hit_tokens)
        groups, num_hit_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, limit
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

        The decode special case (one full-attention group, new tokens within one
        block: the last held one, unshared, or the next one) skips the general
        bookkeeping; it decides exactly what the general path would.

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
        if (
            self._decode_manager is not None
            and new_computed_blocks is None
            and num_new_tokens > 0
            and not num_new_computed_tokens
            and not num_lookahead_tokens
        ):
            new_blocks = self._allocate_decode_slots(request, num_new_tokens)
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
            self._copy_on_write(request_id, manager, index)
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

    # -- the decode special case ----------------------------------------------
    # One full-attention group; the new tokens stay within one block and within
    # max_model_len. Either that block is the last one held and no fork shares it
    # (nothing to allocate or copy), or it is the next block and the free queue has
    # one. Both then cache what the general path caches. tests/core/
    # test_host_fast_paths.py runs workloads both ways and compares every table,
    # hash, ref count and the free-queue order.

    def _fits_in_last_block(self, blocks: list[KVCacheBlock], start: int, end: int) -> bool:
        """Tokens [start, end) all land in the last held block, which no other table holds."""
        index = start // self.block_size
        return (
            index == len(blocks) - 1
            and (end - 1) // self.block_size == index
            and blocks[index].ref_cnt == 1
        )

    def _needs_one_new_block(self, blocks: list[KVCacheBlock], start: int, end: int) -> bool:
        """Tokens [start, end) all land in the block after the last held one, and one is free."""
        index = start // self.block_size
        return (
            index == len(blocks)
            and (end - 1) // self.block_size == index
            and self.block_pool.free_block_queue.num_free_blocks > 0
        )

    def _allocate_decode_slots(self, request: Request, num_new_tokens: int) -> KVCacheBlocks | None:
        """allocate_slots for the decode special case; None when the case does not apply."""
        manager = self._decode_manager
        request_id = request.request_id
        blocks = manager.req_to_blocks.get(request_id)
        start = request.num_computed_tokens
        end = start + num_new_tokens
        if not blocks or end > self.max_model_len:
            return None
        if self.enable_caching and request.block_hasher is None:
            return None  # the general path attaches the hasher first
        if self._fits_in_last_block(blocks, start, end):
            new_blocks = self.empty_kv_cache_blocks
        elif self._needs_one_new_block(blocks, start, end):
            # Allocate before caching, as the general path does (a reused block leaves
            # the hash map first).
            new_blocks = KVCacheBlocks((manager.allocate_new_blocks(request_id, end),))
        else:
            return None
        # Only a block hashed since the table's last caching can be cached now.
        if self.enable_caching and len(request.block_hashes) > manager.num_cached_block[request_id]:
            num_tokens = len(request.all_token_ids)
            manager.cache_blocks(request, end if end < num_tokens else num_tokens)
        return new_blocks

    # -- copy on write ----------------------------------------------------------

    def _shared_writes(
        self, request: Request, end_token: int
    ) -> list[tuple[SingleTypeKVCacheManager, int]]:
        """(manager, block index) of every shared block the request's next tokens write into."""
        out = []
        for manager in self.coordinator.managers:
            indices = manager.written_shared_blocks(
                request.request_id,
                request.num_computed_tokens,
                end_token,
                self.pending_copies.is_shared,
            )
            out.extend((manager, i) for i in indices)
        return out

    def _copy_on_write(
        self, request_id: str, manager: SingleTypeKVCacheManager, index: int
    ) -> None:
        """Gives the request a fresh block at a shared table slot; the device fills it from
        the old block before this step's KV writes."""
        old = manager.get_blocks(request_id)[index]
        new = self.pending_copies.copy_on_write(request_id, manager.kv_cache_group_id, index, old)
        manager.replace_block(request_id, index, new)

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

    def free_tail_blocks(self, request: Request | str, num_tokens: int) -> int:
        """Returns the blocks past the first cdiv(num_tokens, block_size) of every group.

        Speculative decoding's rollback: blocks allocated only for rejected drafts hold
        no known token, so none is hashed; they go back to the free queue's head (reused
        first), tail first, as ``free`` returns unhashed blocks.

        Returns:
            How many blocks were freed (all groups).
        """
        request_id = _request_id(request)
        keep = cdiv(num_tokens, self.block_size)
        freed = 0
        for manager in self.coordinator.managers:
            blocks = manager.req_to_blocks.get(request_id)
            if not blocks or len(blocks) <= keep:
                continue
            tail = blocks[keep:]
            assert all(b.block_hash is None for b in tail), (
                "a block past the request's known tokens is hashed: drafts were cached"
            )
            del blocks[keep:]
            self.block_pool.free_blocks(reversed(tail))
            freed += len(tail)
        return freed

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
        parent, child = parent_request, child_request
        if self.enable_caching:
            self._ensure_hasher(child)
        if num_tokens is None:
            num_tokens = parent.num_computed_tokens
        if self.pending_copies:
            raise ValueError(
                f"fork of {parent.request_id!r} must wait until this step's "
                f"{len(self.pending_copies)} pending copies are taken (fork between steps)"
            )
        if not 0 < num_tokens <= parent.num_computed_tokens:
            raise ValueError(
                f"num_tokens={num_tokens!r} must be in [1, parent.num_computed_tokens="
                f"{parent.num_computed_tokens}]"
            )
        managers = self.coordinator.managers
        if any(m.get_blocks(child.request_id) for m in managers):
            raise ValueError(f"child={child.request_id!r} must hold no blocks to be forked into")
        if (child.cache_salt, child.adapter_id) != (parent.cache_salt, parent.adapter_id):
            raise ValueError(
                f"child (cache_salt, adapter_id)={(child.cache_salt, child.adapter_id)!r} must "
                f"equal the parent's {(parent.cache_salt, parent.adapter_id)!r}: shared blocks "
                "carry the parent's hashes"
            )
        if child.block_extra_keys != parent.block_extra_keys:
            raise ValueError(
                f"child={child.request_id!r} must have the parent's block_extra_keys: shared "
                "blocks carry the parent's hashes"
            )
        if child.all_token_ids[:num_tokens] != parent.all_token_ids[:num_tokens]:
            raise ValueError(
                f"child={child.request_id!r} must start with the parent's first {num_tokens} "
                "token ids"
            )
        if self.enable_caching:
            # Hash the parent's full computed blocks first. After a speculative step a block
            # can be full of accepted tokens and computed without being hashed yet (its
            # drafts were unknown when it was allocated); shared unhashed, parent and child
            # would each hash it at their next allocation, the second time over a hash.
            self.coordinator.cache_blocks(parent, parent.num_computed_tokens)
        num_shared = min(m.num_shareable_tokens(parent.request_id, num_tokens) for m in managers)
        for manager in managers:
            manager.fork(parent.request_id, child.request_id, num_shared)
        return num_shared

    def take_pending_copies(self) -> BlockCopies:
        """The copy-on-write block copies scheduled since the last call.

        Call once per step, after the last allocate_slots of the step: the copies
        (``.pairs``, (src, dst) block ids) must run on device before that step's KV
        writes, and ``.table_updates`` says which table slots now name the copies.
        Releases the holds that kept both blocks of every copy out of the free queue
        meanwhile.
        """
        return self.pending_copies.take()

    def take_newly_cached_blocks(self) -> list[KVCacheBlock]:
        """The blocks hashed since the last call, in order; the first call starts recording.

        allocate_slots hashes a block when it allocates it for the step that writes it,
        before that KV exists. The engine takes this list after each schedule, keeps
        it with the step, and when the step fails passes it to ``uncache_blocks``.
        """
        pool = self.block_pool
        taken = pool.newly_cached
        pool.newly_cached = []
        return taken if taken is not None else []

    def uncache_blocks(self, blocks: Sequence[KVCacheBlock]) -> int:
        """Drops the prefix-cache hashes of free blocks whose KV was never written.

        See BlockPool.uncache_blocks; call it after freeing every request that held
        them. Returns how many blocks lost their hash.
        """
        return self.block_pool.uncache_blocks(blocks)

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
        num_blocks = cdiv(num_tokens, bs)
        total = 0
        for group in self.kv_cache_groups:
            if group.sliding_window is None:
                total += num_blocks
            else:
                bound = cdiv(group.sliding_window - 1 + max_chunk_tokens, bs) + 1
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

        Beyond BlockPool.check_invariants and each group's check_tables (no table
        holds a block twice, nulls only as a window's leading run, exactly the first
        num_cached real blocks hashed): every block's ref_cnt equals the number of
        request tables holding it, over all groups, plus its holds by pending copies.
        """
        self.block_pool.check_invariants()
        holders: collections.Counter[int] = collections.Counter()
        for manager in self.coordinator.managers:
            holders.update(manager.check_tables())
        for block in self.block_pool.blocks[1:]:
            held = self.pending_copies.num_holds(block.block_id)
            if block.ref_cnt != holders[block.block_id] + held:
                raise AssertionError(
                    f"block {block.block_id} ref_cnt={block.ref_cnt} but "
                    f"{holders[block.block_id]} requests and {held} pending copies hold it"
                )
