"""The Pallas kernels under the reference module's names (what ``backend.py`` binds)."""

from __future__ import annotations

from pallas_kernels.block_copy import copy_blocks
from pallas_kernels.decode_attention import paged_attention
from pallas_kernels.kv_write import write_kv
from pallas_kernels.ragged_attention import ragged_paged_attention

__all__ = ["copy_blocks", "paged_attention", "ragged_paged_attention", "write_kv"]
