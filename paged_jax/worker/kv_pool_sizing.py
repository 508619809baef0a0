"""KV pool sizing: how many KV blocks the runner allocates, from the config and device memory.

The pool is sized from EngineConfig (num_kv_blocks, kv_cache_memory, gpu_memory_utilization)
and what the device reports: its memory, the weights already on it and an estimate of one
step's activations; a pool is capped where a KV array's 32-bit kernel offsets would wrap.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax.config import EngineConfig
from paged_jax.worker.sharding import per_device_bytes
from pallas_kernels.layout import max_offset_safe_blocks

logger = logging.getLogger(__name__)

# Rows of hidden states one prompt-logprobs program call reads (at most the largest step):
# a step shape of the runner's, here because the activation estimate counts it too.
PROMPT_LOGPROBS_CHUNK = 256


def prompt_chunk_size(config: EngineConfig) -> int:
    """Rows per prompt-logprobs chunk: PROMPT_LOGPROBS_CHUNK, or the largest step if smaller."""
    return min(PROMPT_LOGPROBS_CHUNK, config.token_buckets[-1])


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """One device's memory as jax's allocator reports it.

    Attributes:
        total_bytes: what the allocator may use (memory_stats' bytes_limit; on GPU
            XLA_PYTHON_CLIENT_MEM_FRACTION of the device, 75% by default).
        in_use_bytes: what arrays hold now (this process's weights included).
    """

    total_bytes: int
    in_use_bytes: int

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.in_use_bytes


def device_memory() -> DeviceMemory | None:
    """The first device's memory, or None when the backend reports none (CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return DeviceMemory(int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0)))


def activation_bytes_estimate(config: EngineConfig, model_config: Any) -> int:
    """A generous estimate of one step's transient device memory (bytes).

    vLLM measures this with a profiling forward pass; here it is counted from the step's
    shapes in f32: per batched token a few hidden-size and MLP-width buffers (the
    widest layer's inputs, outputs and MLP intermediates alive at once), and per
    sampled row (or prompt-logprobs row) a few vocabulary-wide buffers (logits,
    probabilities, the sorted copy top-k/top-p sampling makes). Fields a model config
    lacks count as 0.
    """
    hidden = int(getattr(model_config, "hidden_size", 0) or 0)
    mlp = int(getattr(model_config, "intermediate_size", 0) or 0)
    vocab = int(getattr(model_config, "vocab_size", 0) or 0)
    tokens = config.max_num_batched_tokens
    rows = config.max_num_seqs * (1 + config.num_speculative_tokens)
    rows = max(rows, prompt_chunk_size(config))
    f32 = 4
    return f32 * (tokens * (8 * hidden + 4 * mlp) + 4 * rows * vocab)


def model_weight_bytes(*trees: Any) -> int:
    """The most bytes of live arrays in `trees` that one device holds (each array once)."""
    arrays = {}
    for tree in trees:
        leaves = jax.tree.leaves(nnx.state(tree) if isinstance(tree, nnx.Module) else tree)
        for leaf in leaves:
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                arrays[id(leaf)] = leaf
    return max(per_device_bytes(list(arrays.values())).values(), default=0)


def _utilization_budget(
    config: EngineConfig,
    bytes_per_block: int,
    memory: DeviceMemory,
    weight_bytes: int,
    activation_bytes: int,
) -> int:
    """KV bytes of gpu_memory_utilization: its share of the device less weights and
    activations; a ValueError when that share is too small or not free."""
    utilization = config.gpu_memory_utilization
    share = int(utilization * memory.total_bytes)
    kv = share - weight_bytes - activation_bytes
    what = (
        f"gpu_memory_utilization={utilization!r} gives this engine {_gib(share)} of the "
        f"device's {_gib(memory.total_bytes)}"
    )
    if kv < 2 * bytes_per_block:
        raise ValueError(
            f"{what}: not enough for its weights ({_gib(weight_bytes)}), activations "
            f"(~{_gib(activation_bytes)}) and 2 KV blocks of {bytes_per_block} bytes; "
            "raise it (or set kv_cache_memory / num_kv_blocks)"
        )
    # The weights are on the device already: the rest must still be free.
    if kv + activation_bytes > memory.free_bytes:
        raise ValueError(
            f"{what}, but only {_gib(memory.free_bytes)} is free after its weights (other "
            f"arrays or processes hold {_gib(memory.in_use_bytes - weight_bytes)}), short "
            f"of the {_gib(kv + activation_bytes)} its KV cache and activations need; "
            "lower it or free device memory"
        )
    return kv


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def kv_block_arrays(
    model: Any, block_size: int, dtype: Any = None, *, tensor_parallel_size: int = 1
) -> list[tuple[int, int]]:
    """(elements of one block on one device, itemsize) of each distinct KV cache array.

    Read from the model's own cache shapes (abstractly: nothing is allocated), so models
    whose layer groups differ in heads or head_dim are right. Under tensor parallelism
    each device holds its share of the heads.
    """
    caches = jax.eval_shape(lambda: model.init_kv_caches(1, block_size, dtype))
    arrays = {
        (math.prod(x.shape[1:]) // tensor_parallel_size, jnp.dtype(x.dtype).itemsize)
        for x in jax.tree.leaves(caches)
    }
    return sorted(arrays)


def resolve_num_kv_blocks(
    config: EngineConfig,
    bytes_per_block: int,
    kv_arrays: Sequence[tuple[int, int]] = (),
    *,
    free_bytes: int | None = None,
    memory: DeviceMemory | None = None,
    weight_bytes: int = 0,
    activation_bytes: int = 0,
) -> int:
    """Pool size from num_kv_blocks, a byte budget, a fraction of free device memory, or
    gpu_memory_utilization.

    With none set: 90% of free memory on an accelerator; on CPU, enough blocks for
    max_num_seqs full-length sequences, at most 1 GiB. gpu_memory_utilization (vLLM's)
    budgets ``utilization * total - weight_bytes - activation_bytes`` for KV (raising
    when that is under 2 blocks or more than is free); a backend without memory stats
    (CPU) ignores it with a warning. A pool sized from memory is capped so no KV array
    (``kv_arrays``: see kv_block_arrays) lands where a Triton kernel's 32-bit offsets
    wrap (pallas_kernels.layout), on every backend, so CPU and GPU pools schedule
    alike. An explicit num_kv_blocks is kept as given (a wrapping cache then fails
    clearly in the kernels).

    Args:
        free_bytes: Free memory for a fractional kv_cache_memory; None queries the
            device (or, on CPU, the host).
        memory: the device's memory for gpu_memory_utilization; None queries it.
        weight_bytes: the engine's weights on one device (model_weight_bytes).
        activation_bytes: one step's transient memory (activation_bytes_estimate).
    """
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = config.kv_cache_memory
    if config.gpu_memory_utilization is not None:
        memory = memory if memory is not None else device_memory()
        if memory is not None:
            budget = _utilization_budget(
                config, bytes_per_block, memory, weight_bytes, activation_bytes
            )
        else:
            warnings.warn(
                f"gpu_memory_utilization={config.gpu_memory_utilization!r} is ignored on "
                f"{jax.default_backend()}: the backend reports no device memory, so the KV "
                "pool is sized as without it (set kv_cache_memory or num_kv_blocks to size "
                "it; vLLM's CPU backend ignores it too)",
                UserWarning,
                stacklevel=2,
            )
    if budget is None and jax.default_backend() != "cpu":
        budget = 0.9
    if isinstance(budget, float):
        free = free_bytes if free_bytes is not None else _device_free_bytes()
        if free is None:  # CPU: the host's available memory
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = int(free * budget)
    if budget is None:
        full = config.max_num_seqs * config.max_blocks_per_seq + 1
        return cap_kv_blocks(max(2, min(full, (1 << 30) // bytes_per_block)), kv_arrays)
    num_blocks = budget // bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory={config.kv_cache_memory!r} must hold at least 2 KV blocks "
            f"of {bytes_per_block} bytes"
        )
    return cap_kv_blocks(int(num_blocks), kv_arrays)


def _device_free_bytes() -> int | None:
    memory = device_memory()
    return None if memory is None else memory.free_bytes


def cap_kv_blocks(num_blocks: int, kv_arrays: Sequence[tuple[int, int]]) -> int:
    """num_blocks, lowered to the most blocks every KV array is addressed right with."""
    capped = min(
        (max_offset_safe_blocks(elems, itemsize, num_blocks) for elems, itemsize in kv_arrays),
        default=num_blocks,
    )
    if capped < num_blocks:
        logger.info(
            "KV pool capped at %d blocks (memory allows %d): a KV cache array of more than "
            "2**31 elements in at most 4 GiB is addressed with 32-bit offsets that wrap in "
            "the Triton kernels",
            capped,
            num_blocks,
        )
    return capped
