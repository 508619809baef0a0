"""paged-jax: a JAX/Pallas implementation of the vLLM paged KV-cache stack.

The top level is the user's API, shaped like vLLM's: ``LLM`` and ``SamplingParams`` to
generate (``StructuredOutputsParams`` to constrain an output), ``BeamSearchParams`` for
beam search, the outputs they return,
``EngineConfig`` / ``Engine`` / ``PagedModel`` to serve a model of one's own
(``SpeculativeConfig`` for speculative decoding, ``LoRARequest`` to serve an
adapter), and the
host block manager (``KVCacheManager``, ``BlockPool``, ``KVCacheBlock``, ``Request``)
for research on its own. Everything else lives in ``paged_jax.core`` (host) and
``paged_jax.worker`` (device). Importing this package never imports jax: ``LLM`` and
``Engine`` load it on first access.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from paged_jax.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from paged_jax.config import EngineConfig
from paged_jax.core.block_pool import BlockPool
from paged_jax.core.kv_cache_block import KVCacheBlock
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request, RequestStatus
from paged_jax.lora import LoRARequest
from paged_jax.model_api import PagedModel, PagedModelConfig
from paged_jax.outputs import CompletionOutput, Logprob, RequestOutput
from paged_jax.sampling_params import SamplingParams
from paged_jax.spec_decode.proposer import SpeculativeConfig
from paged_jax.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    from paged_jax.engine import Engine
    from paged_jax.llm import LLM

# The device side, imported on first access so `import paged_jax` stays jax-free.
_LAZY = {"LLM": "paged_jax.llm", "Engine": "paged_jax.engine"}

# Internals once exported here: still importable from the top level for one release,
# with a DeprecationWarning that names their home.
_DEPRECATED = {
    "FreeKVCacheBlockQueue": "paged_jax.core.kv_cache_block",
    "NONE_HASH": "paged_jax.core.hashing",
    "BlockHash": "paged_jax.core.hashing",
    "BlockHashWithGroupId": "paged_jax.core.hashing",
    "BlockHasher": "paged_jax.core.hashing",
    "hash_block_tokens": "paged_jax.core.hashing",
    "none_hash": "paged_jax.core.hashing",
    "KVCacheBlocks": "paged_jax.core.kv_cache_manager",
    "PrefixCacheStats": "paged_jax.core.kv_cache_manager",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in _DEPRECATED:
        home = _DEPRECATED[name]
        warnings.warn(
            f"paged_jax.{name} is deprecated and will be removed in the next release; "
            f"use `from {home} import {name}`",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), name)
    raise AttributeError(f"module 'paged_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "BlockPool",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "KVCacheBlock",
    "KVCacheManager",
    "Logprob",
    "LoRARequest",
    "PagedModel",
    "PagedModelConfig",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "SpeculativeConfig",
    "StructuredOutputsParams",
]
