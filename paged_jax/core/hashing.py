"""Chained block hashes for the prefix cache: H(parent, block token ids, extra keys).

Pure Python (hashlib / xxhash); never imports jax.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from array import array
from collections.abc import Callable
from typing import NewType, Protocol

from paged_jax.constants import HASH_ALGOS  # re-exported: paged_jax.core.hashing.HASH_ALGOS

BlockHash = NewType("BlockHash", bytes)
"""Digest of one full block, chained over every earlier block of the request."""

BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)
"""A BlockHash followed by the 4-byte big-endian KV-cache group id: the pool's map key."""

# sha256's fixed, process-independent seed: two processes (or two runs) with the same
# tokens produce the same hashes, whatever PYTHONHASHSEED says. xxhash is seeded per
# process instead (xxhash_none_seed). See docs/host_block_stack.md.
_NONE_HASH_SEED = b"paged-jax/none-hash/v1"

# Token ids are packed as little-endian int64 so the bytes do not depend on the host.
_BIG_ENDIAN = sys.byteorder == "big"

# Tags of the optional extra-key sections (after the token bytes).
_TAG_ADAPTER = b"A"
_TAG_SALT = b"S"
_TAG_BLOCK = b"B"


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def get_hash_fn(hash_algo: str) -> Callable[[bytes], bytes]:
    """Returns the bytes -> digest function for a hash algorithm name.

    Args:
        hash_algo: "sha256" (32-byte digests, the default) or "xxhash" (xxh3_128,
            16-byte digests, faster but not collision resistant against adversaries).

    Raises:
        ValueError: if the name is unknown.
    """
    if hash_algo == "sha256":
        return _sha256_digest
    if hash_algo == "xxhash":
        import xxhash  # imported lazily: only needed for this option

        return xxhash.xxh3_128_digest
    raise ValueError(f"hash_algo={hash_algo!r} must be one of {HASH_ALGOS}")


@functools.cache
def xxhash_none_seed() -> bytes:
    """The bytes xxhash's first-block parent is hashed from in this process (vLLM's rule).

    xxhash is not collision resistant: with a public seed, colliding prompts could be
    built offline to be served another prompt's cached KV. So the seed is random per
    process unless PYTHONHASHSEED is set (not "random"), which makes runs reproducible.
    """
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None or seed == "random":
        return os.urandom(32)
    return _NONE_HASH_SEED + b"/" + seed.encode()


def none_hash(hash_algo: str = "sha256") -> BlockHash:
    """The parent hash of a request's first block for the given algorithm.

    sha256: the same in every process. xxhash: per process (see xxhash_none_seed).
    """
    seed = xxhash_none_seed() if hash_algo == "xxhash" else _NONE_HASH_SEED
    return BlockHash(get_hash_fn(hash_algo)(seed))


NONE_HASH: BlockHash = BlockHash(_sha256_digest(_NONE_HASH_SEED))
"""The sha256 seed used as the parent of every request's first block."""


def pack_token_ids(token_ids: list[int]) -> bytes:
    """Canonical bytes of a run of token ids: little-endian int64 each."""
    packed = array("q", token_ids)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _section(tag: bytes, payload: bytes) -> bytes:
    return tag + len(payload).to_bytes(4, "little") + payload


def encode_extra_keys(*, adapter_id: int | str | None, cache_salt: str | None) -> bytes:
    """Canonical bytes of a block's extra keys (empty when there are none).

    Args:
        adapter_id: present in every block of a request served by an adapter.
        cache_salt: present in the first block only (callers pass None for the rest).
    """
    out = b""
    if adapter_id is not None:
        kind = b"i" if isinstance(adapter_id, int) else b"s"
        out += _section(_TAG_ADAPTER, kind + str(adapter_id).encode())
    if cache_salt is not None:
        out += _section(_TAG_SALT, cache_salt.encode())
    return out


def encode_block_key(key: bytes) -> bytes:
    """Canonical bytes of one block's own extra key (Request.block_extra_keys[i]),
    appended after encode_extra_keys' sections."""
    return _section(_TAG_BLOCK, key)


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: list[int],
    extra_keys: bytes = b"",
    *,
    hash_algo: str = "sha256",
) -> BlockHash:
    """Hashes one block: H(parent or NONE_HASH, token ids, extra keys).

    The byte layout is parent digest | token count (u32 LE) | token ids (i64 LE) |
    extra-key sections, so it is the same in every process and on every host.

    Args:
        parent_hash: hash of the previous block, or None for the first block.
        token_ids: the block's token ids.
        extra_keys: output of encode_extra_keys for this block.
        hash_algo: "sha256" or "xxhash".
    """
    fn = get_hash_fn(hash_algo)
    parent = parent_hash if parent_hash is not None else none_hash(hash_algo)
    data = parent + len(token_ids).to_bytes(4, "little") + pack_token_ids(token_ids) + extra_keys
    return BlockHash(fn(data))


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """Packs a block hash and a KV-cache group id into one bytes key (no tuple)."""
    # Not wrapped in BlockHashWithGroupId(...): NewType's call is an identity that
    # would cost a third of this function, which runs for every block a hit search tries.
    return block_hash + group_id.to_bytes(4, "big")


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    """The BlockHash part of a BlockHashWithGroupId."""
    return BlockHash(key[:-4])


def get_group_id(key: BlockHashWithGroupId) -> int:
    """The KV-cache group id part of a BlockHashWithGroupId."""
    return int.from_bytes(key[-4:], "big")


class HashedTokens(Protocol):
    """What a BlockHasher reads of a request (paged_jax.core.request.Request has it)."""

    block_hashes: list[BlockHash]
    all_token_ids: list[int]
    adapter_id: int | str | None
    cache_salt: str | None
    block_extra_keys: tuple[bytes, ...]


class BlockHasher:
    """Extends a request's block hashes as its blocks become full.

    A request calls its hasher at construction and after every append; the hasher
    returns the hashes of the full blocks not yet in ``request.block_hashes``
    (usually none, so the common path is one length comparison).

    Args:
        block_size: tokens per hashed block.
        hash_algo: "sha256" or "xxhash".
    """

    __slots__ = ("block_size", "hash_algo", "_fn", "_none_hash")

    def __init__(self, block_size: int, hash_algo: str = "sha256") -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be a positive int")
        self.block_size = block_size
        self.hash_algo = hash_algo
        self._fn = get_hash_fn(hash_algo)
        self._none_hash = none_hash(hash_algo)

    def __call__(self, request: HashedTokens) -> list[BlockHash]:
        bs = self.block_size
        hashes = request.block_hashes
        token_ids = request.all_token_ids
        start_block = len(hashes)
        end_block = len(token_ids) // bs
        if end_block <= start_block:
            return []
        fn = self._fn
        parent = hashes[-1] if hashes else self._none_hash
        header = bs.to_bytes(4, "little")
        adapter = encode_extra_keys(adapter_id=request.adapter_id, cache_salt=None)
        salt = request.cache_salt
        block_keys = request.block_extra_keys
        # One pack for the whole run of new blocks, then slice per block.
        packed = pack_token_ids(token_ids[start_block * bs : end_block * bs])
        step = 8 * bs
        new_hashes: list[BlockHash] = []
        for i in range(end_block - start_block):
            extra = adapter
            if salt is not None and start_block + i == 0:
                extra = encode_extra_keys(adapter_id=request.adapter_id, cache_salt=salt)
            if start_block + i < len(block_keys):
                extra = extra + encode_block_key(block_keys[start_block + i])
            parent = fn(parent + header + packed[i * step : (i + 1) * step] + extra)
            new_hashes.append(parent)
        return new_hashes
