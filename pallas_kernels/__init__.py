"""Paged-attention kernels (Pallas, Triton lowering) and their pure-JAX references.

Imports jax only. Pick an implementation with ``get_attention_ops(name)``; the
top-level ``write_kv``/``copy_blocks``/``paged_attention``/``ragged_paged_attention``
are the ``"auto"`` choice's functions' signatures, bound to the references here.
"""

from __future__ import annotations

from pallas_kernels import reference
from pallas_kernels.backend import BACKEND_NAMES, AttentionOps, get_attention_ops
from pallas_kernels.layout import KV_CACHE_LAYOUT, NULL_BLOCK_ID, init_kv_cache, kv_cache_shape
from pallas_kernels.reference import copy_blocks, paged_attention, ragged_paged_attention, write_kv

__all__ = [
    "BACKEND_NAMES",
    "KV_CACHE_LAYOUT",
    "NULL_BLOCK_ID",
    "AttentionOps",
    "copy_blocks",
    "get_attention_ops",
    "init_kv_cache",
    "kv_cache_shape",
    "paged_attention",
    "ragged_paged_attention",
    "reference",
    "write_kv",
]
