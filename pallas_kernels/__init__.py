"""Paged-attention kernels (Pallas, Triton lowering) and their pure-JAX references.

The top-level ``paged_attention``, ``ragged_paged_attention``, ``write_kv`` and
``copy_blocks`` are the Pallas kernels (GPU, or ``interpret=True`` on CPU);
``reference`` holds pure-JAX versions with the same signatures. Callers that should run
anywhere pick through the seam: ``get_attention_ops("auto")``; ``step_attention`` routes
an engine step to the decode or the ragged kernel.

Never imports paged_jax. Names load on first access (PEP 562), so a jax-free module such
as ``pallas_kernels.names`` can be imported by host code without importing jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pallas_kernels import reference
    from pallas_kernels.backend import AttentionOps, get_attention_ops, step_attention
    from pallas_kernels.block_copy import copy_blocks
    from pallas_kernels.decode_attention import paged_attention
    from pallas_kernels.kv_write import write_kv
    from pallas_kernels.layout import KV_CACHE_LAYOUT, init_kv_cache, kv_cache_shape
    from pallas_kernels.names import BACKEND_NAMES, NULL_BLOCK_ID, AttentionBackend
    from pallas_kernels.ragged_attention import ragged_paged_attention
    from pallas_kernels.validation import checked

# Public name -> the submodule that defines it ("reference" is a submodule itself).
_EXPORTS = {
    "AttentionBackend": "names",
    "BACKEND_NAMES": "names",
    "AttentionOps": "backend",
    "get_attention_ops": "backend",
    "KV_CACHE_LAYOUT": "layout",
    "NULL_BLOCK_ID": "names",
    "init_kv_cache": "layout",
    "kv_cache_shape": "layout",
    "checked": "validation",
    "copy_blocks": "block_copy",
    "paged_attention": "decode_attention",
    "ragged_paged_attention": "ragged_attention",
    "step_attention": "backend",
    "write_kv": "kv_write",
    "reference": "reference",
}


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'pallas_kernels' has no attribute {name!r}")
    module = importlib.import_module(f"pallas_kernels.{module_name}")
    value = module if name == module_name == "reference" else getattr(module, name)
    # Bound here so later lookups skip this function. No submodule shares a public
    # name (the import system would bind the submodule over it).
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "BACKEND_NAMES",
    "KV_CACHE_LAYOUT",
    "NULL_BLOCK_ID",
    "AttentionBackend",
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
