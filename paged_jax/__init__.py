"""paged-jax: a JAX/Pallas implementation of the vLLM paged KV-cache stack.

Importing this package never imports jax: the names below are the pure-Python
host side (requests, block pool, prefix-cache hashing, KV-cache manager).
"""

from __future__ import annotations

from paged_jax.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from paged_jax.hashing import (
    NONE_HASH,
    BlockHash,
    BlockHasher,
    BlockHashWithGroupId,
    hash_block_tokens,
    none_hash,
)
from paged_jax.kv_cache_manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from paged_jax.request import Request, RequestStatus

__all__ = [
    "NONE_HASH",
    "BlockHash",
    "BlockHashWithGroupId",
    "BlockHasher",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheManager",
    "PrefixCacheStats",
    "Request",
    "RequestStatus",
    "hash_block_tokens",
    "none_hash",
]
