"""Paged-attention kernels (Pallas, Triton lowering) and their pure-JAX references.

Imports jax only. The top-level ``paged_attention``, ``ragged_paged_attention``,
``write_kv`` and ``copy_blocks`` are the Pallas kernels (GPU, or ``interpret=True`` on
CPU); ``reference`` holds pure-JAX versions with the same signatures. Callers that
should run anywhere pick through the seam: ``get_attention_ops("auto")``;
``step_attention`` routes an engine step to the decode or the ragged kernel.
"""

from __future__ import annotations

from pallas_kernels import reference
from pallas_kernels.backend import BACKEND_NAMES, AttentionOps, get_attention_ops
from pallas_kernels.block_copy import copy_blocks
from pallas_kernels.decode_attention import paged_attention
from pallas_kernels.kv_write import write_kv
from pallas_kernels.layout import KV_CACHE_LAYOUT, NULL_BLOCK_ID, init_kv_cache, kv_cache_shape
from pallas_kernels.ragged_attention import ragged_paged_attention
from pallas_kernels.step_attention import step_attention
from pallas_kernels.validation import checked

__all__ = [
    "BACKEND_NAMES",
    "KV_CACHE_LAYOUT",
    "NULL_BLOCK_ID",
    "AttentionOps",
    "checked",
    "copy_blocks",
    "get_attention_ops",
    "init_kv_cache",
    "kv_cache_shape",
    "paged_attention",
    "ragged_paged_attention",
    "reference",
    "step_attention",
    "write_kv",
]
