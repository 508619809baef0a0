"""Copy-on-write inside the jitted step: ``cache[dst] = cache[src]`` for every layer, first.

The host schedules the copies (``KVCacheManager.take_pending_copies``) and the StepInput
carries them as a fixed-width StepCopies (src, dst) padded with dst = -1, so the step
keeps one shape. They run before the step's KV writes, on the donated caches, through
the attention backend's ``copy_blocks`` (the Pallas kernel on GPU, the XLA reference else).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

import pallas_kernels
from paged_jax.worker.step_input import StepCopies


def copy_kv_blocks(
    kv_caches: Sequence[tuple[jax.Array, jax.Array]],
    copies: StepCopies,  # src i32[C], dst i32[C] (-1 = padding)
    *,
    attention_backend: str = "auto",
) -> list[tuple[jax.Array, jax.Array]]:
    """Copies whole blocks (all heads) of every layer's K and V cache from src to dst ids.

    Destinations are distinct and never also a source (the block manager's holds
    guarantee it), so the copies may run in any order.
    """
    copy = pallas_kernels.get_attention_ops(attention_backend).copy_blocks
    return [tuple(copy(k, v, copies.src, copies.dst)) for k, v in kv_caches]
