"""A generation request as the host side sees it: tokens, progress, status, block hashes.

Pure Python; never imports jax.
"""

from __future__ import annotations

import enum
import operator
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from paged_jax.core.hashing import BlockHash, BlockHasher

BlockHasherFn = Callable[["Request"], list[BlockHash]]
"""Returns the hashes of the request's full blocks not yet in request.block_hashes."""


class RequestStatus(enum.Enum):
    """Lifecycle of a request in the scheduler."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    def is_finished(self) -> bool:
        """True for the four FINISHED_* states (also callable as RequestStatus.is_finished(s))."""
        return self in _FINISHED


_FINISHED = frozenset(s for s in RequestStatus if s.name.startswith("FINISHED_"))


def _to_token_id(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be a non-negative int token id, not a bool")
    try:
        token_id = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} must be a non-negative int token id") from None
    if token_id < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative int token id")
    return token_id


class Request:
    """One generation request.

    Tokens are the prompt followed by the generated outputs; ``all_token_ids`` is
    the list the scheduler and the hasher read. ``block_hashes`` holds one chained
    hash per *full* block and is extended as outputs are appended, so a preempted
    request keeps hashes over its prompt and outputs (and resumes via prefix hits).

    Hashing needs a block size and an algorithm, which the request does not know
    by itself: pass ``block_hasher`` (for example a ``paged_jax.core.hashing.BlockHasher``)
    or let ``KVCacheManager`` attach its own on first contact
    (``get_computed_blocks`` / ``allocate_slots``). Until then ``block_hashes`` is empty.

    Args:
        request_id: unique id (a str).
        prompt_token_ids: non-empty sequence of non-negative int token ids.
        sampling_params: opaque to the host block stack; kept for the engine.
        cache_salt: optional non-empty str mixed into the first block's hash, so
            requests with different salts never share cached blocks.
        priority: smaller is served first under a priority policy.
        arrival_time: seconds (time.time() when None).
        adapter_id: optional adapter (LoRA) id mixed into every block's hash.
        block_extra_keys: bytes mixed into block i's hash, for i < len: what a block
            holds that its token ids do not show (a digest of the prompt embeddings'
            rows of that block), so two requests share a block only when it matches.
        block_hasher: optional callable that computes new full-block hashes.
        skip_reading_prefix_cache: never start from cached blocks (every prompt
            position runs through the model, as prompt logprobs need); the request's
            own full blocks are still cached for others.
        max_cache_hit_tokens: read at most this many tokens from the prefix cache
            (prompt logprobs of the prompt's tail only need the tokens after it
            computed); None: no limit beyond the engine's own.

    Raises:
        ValueError: on an empty prompt, a negative or non-int token id, or a bad
            request_id / cache_salt / adapter_id.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling_params: Any = None,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        adapter_id: int | str | None = None,
        block_extra_keys: Iterable[bytes] = (),
        block_hasher: BlockHasherFn | None = None,
        skip_reading_prefix_cache: bool = False,
        max_cache_hit_tokens: int | None = None,
    ) -> None:
        if not isinstance(request_id, str):
            raise ValueError(f"request_id={request_id!r} must be a str")
        if isinstance(prompt_token_ids, (str, bytes)):
            raise ValueError(
                f"prompt_token_ids={prompt_token_ids!r} must be a sequence of int token ids"
            )
        try:
            ids = list(prompt_token_ids)
        except TypeError:
            raise ValueError(
                f"prompt_token_ids={prompt_token_ids!r} must be a sequence of int token ids"
            ) from None
        # Fast check for the common all-int prompt; the slow path converts numpy
        # ints and names the first bad id.
        if not all(type(t) is int for t in ids) or (ids and min(ids) < 0):
            ids = [_to_token_id(t, "prompt_token_ids[i]") for t in ids]
        if not ids:
            raise ValueError(f"prompt_token_ids={ids!r} must not be empty")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt={cache_salt!r} must be a non-empty str or None")
        if adapter_id is not None and (
            isinstance(adapter_id, bool) or not isinstance(adapter_id, (int, str))
        ):
            raise ValueError(f"adapter_id={adapter_id!r} must be an int, a str or None")
        block_extra_keys = tuple(block_extra_keys)
        if not all(isinstance(k, bytes) for k in block_extra_keys):
            raise ValueError(
                f"block_extra_keys={block_extra_keys!r} must be a sequence of bytes (one per block)"
            )

        self.request_id = request_id
        self.prompt_token_ids = ids
        self.sampling_params = sampling_params
        self.cache_salt = cache_salt
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.max_cache_hit_tokens = max_cache_hit_tokens
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.adapter_id = adapter_id
        self.block_extra_keys = block_extra_keys
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # Tokens sampled by a device step still in flight (async scheduling): counted
        # by the scheduler, not yet in output_token_ids, never hashed.
        self.num_output_placeholders = 0
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(ids)
        self.block_hashes: list[BlockHash] = []
        self._block_hasher: BlockHasherFn | None = None
        # A BlockHasher's block size: appends call it only when a block fills up.
        self._hash_block_size: int | None = None
        if block_hasher is not None:
            self.block_hasher = block_hasher

    @property
    def block_hasher(self) -> BlockHasherFn | None:
        """The callable that extends block_hashes; settable once (computes hashes now)."""
        return self._block_hasher

    @block_hasher.setter
    def block_hasher(self, hasher: BlockHasherFn) -> None:
        if self._block_hasher is not None:
            raise ValueError(
                f"block_hasher={hasher!r} must not replace the request's existing hasher"
            )
        if not callable(hasher):
            raise ValueError(f"block_hasher={hasher!r} must be callable")
        self._block_hasher = hasher
        if type(hasher) is BlockHasher:
            self._hash_block_size = hasher.block_size
        self.block_hashes.extend(hasher(self))

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        """True once the request reached a FINISHED_* status."""
        return self.status in _FINISHED

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Appends generated token(s) and hashes any block they complete.

        Args:
            token_ids: one token id or an iterable of them (non-negative ints).

        Raises:
            ValueError: on a negative or non-int token id (nothing is appended).
        """
        if type(token_ids) is int and token_ids >= 0:  # the one-token decode fast path
            self.output_token_ids.append(token_ids)
            all_token_ids = self.all_token_ids
            all_token_ids.append(token_ids)
            hasher = self._block_hasher
            if hasher is None:
                return
            bs = self._hash_block_size
            # A BlockHasher has nothing to do until the token fills a block.
            if bs is not None and len(all_token_ids) < (len(self.block_hashes) + 1) * bs:
                return
            new_hashes = hasher(self)
            if new_hashes:
                self.block_hashes.extend(new_hashes)
            return
        if isinstance(token_ids, Iterable) and not isinstance(token_ids, (str, bytes)):
            new = [_to_token_id(t, "token_ids[i]") for t in token_ids]
        else:
            new = [_to_token_id(token_ids, "token_ids")]
        self.output_token_ids.extend(new)
        self.all_token_ids.extend(new)
        hasher = self._block_hasher
        if hasher is not None:
            new_hashes = hasher(self)
            if new_hashes:
                self.block_hashes.extend(new_hashes)

    def fork(
        self,
        request_id: str,
        output_token_ids: Iterable[int] | None = None,
        *,
        sampling_params: Any = None,
    ) -> Request:
        """A new request with this one's prompt and settings (the child of a fork).

        The child's block hashes are copied for the full blocks whose tokens it
        shares with this request (and extended by the same hasher), so forking a long
        sequence does not rehash it. Its blocks come from ``KVCacheManager.fork``.

        Args:
            request_id: the child's id.
            output_token_ids: the child's outputs; default a copy of this request's.
            sampling_params: the child's; default this request's.
        """
        child = Request(
            request_id,
            self.prompt_token_ids,
            self.sampling_params if sampling_params is None else sampling_params,
            cache_salt=self.cache_salt,
            priority=self.priority,
            arrival_time=self.arrival_time,
            adapter_id=self.adapter_id,
            block_extra_keys=self.block_extra_keys,
        )
        outputs = list(self.output_token_ids if output_token_ids is None else output_token_ids)
        if outputs:
            if not all(type(t) is int and t >= 0 for t in outputs):
                outputs = [_to_token_id(t, "output_token_ids[i]") for t in outputs]
            child.output_token_ids = outputs
            child.all_token_ids = child.all_token_ids + outputs
        hasher = self._block_hasher
        if hasher is not None:
            size = getattr(hasher, "block_size", None)
            if size is not None:
                # Same prompt; count the common outputs.
                mine, theirs = self.output_token_ids, child.output_token_ids
                same = 0
                limit = min(len(mine), len(theirs))
                while same < limit and mine[same] == theirs[same]:
                    same += 1
                same += len(self.prompt_token_ids)
                child.block_hashes = self.block_hashes[: same // size]
            child.block_hasher = hasher
        return child

    def __repr__(self) -> str:
        return (
            f"Request(request_id={self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, status={self.status.name})"
        )


def _check_vocab(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    bad = [t for t in token_ids if t >= vocab_size]
    if bad:
        raise ValueError(f"{what} contains {bad[0]!r}: token ids must be < vocab_size={vocab_size}")


def new_request(
    request_id: str,
    prompt_token_ids: Iterable[int],
    params: Any,
    *,
    vocab_size: int,
    max_model_len: int,
    cache_salt: str | None = None,
    priority: int = 0,
    arrival_time: float | None = None,
    adapter_id: int | str | None = None,
    block_extra_keys: Iterable[bytes] = (),
) -> Request:
    """A new request checked against the model (what fork_child checks for a fork): its
    token ids < vocab_size and its prompt < max_model_len, leaving room for at least one
    generated token.

    Raises:
        ValueError: those, or a bad field of Request.
    """
    req = Request(
        request_id,
        prompt_token_ids,
        params,
        cache_salt=cache_salt,
        priority=priority,
        arrival_time=arrival_time,
        adapter_id=adapter_id,
        block_extra_keys=block_extra_keys,
    )
    _check_vocab(req.prompt_token_ids, vocab_size, "prompt_token_ids")
    if req.num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"len(prompt_token_ids)={req.num_prompt_tokens} must be < max_model_len="
            f"{max_model_len} (room for at least one generated token)"
        )
    return req


def fork_child(
    parent: Request,
    child_id: str,
    prompt_token_ids: Sequence[int] | None,
    output_token_ids: Sequence[int] | None,
    params: Any,
    *,
    vocab_size: int,
    max_model_len: int,
) -> tuple[Request, int]:
    """The child Request of a fork and how many of its tokens it shares, computed, with
    ``parent`` (what the scheduler's fork gives it without recomputing).

    The child's tokens are the parent's prompt and outputs unless given; the shared
    tokens are at most the parent's computed ones, and only a common prefix (never the
    child's last token, which its first step computes).

    Raises:
        ValueError: a token id outside the vocabulary, more than max_model_len tokens,
            or no computed token shared with the parent.
    """
    if prompt_token_ids is None:
        child = parent.fork(child_id, output_token_ids, sampling_params=params)
    else:
        child = Request(
            child_id,
            prompt_token_ids,
            params,
            cache_salt=parent.cache_salt,
            priority=parent.priority,
            arrival_time=parent.arrival_time,
            block_extra_keys=parent.block_extra_keys,
        )
        if output_token_ids:
            child.append_output_token_ids(list(output_token_ids))
    _check_vocab(child.all_token_ids, vocab_size, f"child {child_id!r}'s token ids")
    if child.num_tokens > max_model_len:
        raise ValueError(
            f"child {child_id!r} has {child.num_tokens} tokens; must be <= max_model_len="
            f"{max_model_len}"
        )
    common = 0
    limit = min(parent.num_computed_tokens, child.num_tokens - 1)
    mine, theirs = parent.all_token_ids, child.all_token_ids
    if prompt_token_ids is None:
        common = parent.num_prompt_tokens  # same prompt: compare the outputs only
    while common < limit and mine[common] == theirs[common]:
        common += 1
    common = min(common, limit)
    if common <= 0:
        raise ValueError(
            f"child {child_id!r} must share at least one computed token with {parent.request_id!r}"
        )
    return child, common
