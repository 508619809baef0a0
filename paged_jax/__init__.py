"""paged-jax: a JAX/Pallas implementation of the vLLM paged KV-cache stack.

Importing this package never imports jax: the names below are the pure-Python
host side (requests, block pool, prefix-cache hashing, KV-cache manager, scheduler,
configs). `LLM` and `Engine` load jax on first access.
"""

from __future__ import annotations

from paged_jax.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from paged_jax.config import EngineConfig
from paged_jax.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from paged_jax.core.hashing import (
    NONE_HASH,
    BlockHash,
    BlockHasher,
    BlockHashWithGroupId,
    hash_block_tokens,
    none_hash,
)
from paged_jax.core.kv_cache_manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from paged_jax.core.request import Request, RequestStatus
from paged_jax.model_api import PagedModel, PagedModelConfig
from paged_jax.outputs import CompletionOutput, RequestOutput
from paged_jax.sampling_params import SamplingParams


def __getattr__(name: str):
    # The device side is imported lazily so `import paged_jax` stays jax-free.
    if name == "LLM":
        from paged_jax.llm import LLM

        return LLM
    if name == "Engine":
        from paged_jax.engine import Engine

        return Engine
    raise AttributeError(f"module 'paged_jax' has no attribute {name!r}")


__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "PagedModel",
    "PagedModelConfig",
    "RequestOutput",
    "SamplingParams",
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
