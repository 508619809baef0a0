"""The paged KV cache layout: ``[num_blocks, num_kv_heads, block_size, head_dim]``, K and V apart.

Why block-major with the head axis second:

* Kernel reads. The unit an attention kernel loads is "tokens of one block for one
  KV head": in this layout that is one contiguous ``block_size * head_dim`` tile, so a
  gathered page is a single linear run of memory (coalesced, no stride across heads).
* Block operations. Everything a block owns (all heads, all offsets) is one contiguous
  ``num_kv_heads * block_size * head_dim`` slab, so copy-on-write and swap-in/out move
  one run of memory per block, and ``cache[block_ids]`` is a plain leading-axis gather.
* Slot writes. A token's slot ``block_id * block_size + offset`` maps to
  ``cache[block_id, :, offset, :]``: ``num_kv_heads`` rows of ``head_dim`` contiguous
  elements each; writes are few (one token per row) so the stride costs nothing.

The token-major alternative ``[num_blocks, block_size, num_kv_heads, head_dim]`` makes a
token's write contiguous but turns every kernel read into a strided tile; head-major
``[num_kv_heads, num_blocks, ...]`` (JAX's GPU op) splits a block across the array, so a
block copy becomes ``num_kv_heads`` separate runs. Reads dominate, so we pick block-major.
Block 0 is the null block: zeroed here, padding in every block table, never read into an
output (kernels mask by position, and zero V before ``p @ V`` so even NaN cannot leak).

Addressing. JAX's Triton lowering turns an index into an array into an *element* offset
of 32-bit signed ints when the array is at most 2**32 bytes, and of 64-bit ints above.
So an array of more than 2**31 elements but at most 2**32 bytes (only possible with a
1-byte dtype: an fp8 cache of 2-4 GiB) has offsets that wrap negative and reads or
writes out of bounds. ``offsets_wrap`` says whether a shape is in that window and
``max_offset_safe_blocks`` gives the largest pool under it (2**31 elements); the kernels
refuse a wrapping cache (``validation.check_offsets_fit``) and the engine's memory-sized
pool is capped by it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.names import NULL_BLOCK_ID as NULL_BLOCK_ID  # re-exported
from pallas_kernels.quantization import FP8_DTYPES

KV_CACHE_LAYOUT = "[num_blocks, num_kv_heads, block_size, head_dim]"


# JAX's Triton lowering: arrays of at most this many bytes get 32-bit signed element
# offsets, which address elements [0, I32_OFFSET_ELEMENTS) only.
I32_OFFSET_BYTES = 2**32
I32_OFFSET_ELEMENTS = 2**31


def offsets_wrap(shape: Sequence[int], itemsize: int) -> bool:
    """Whether a Triton kernel's 32-bit element offsets wrap on an array of this shape.

    True for more than 2**31 elements in at most 2**32 bytes (1-byte dtypes only).
    """
    elements = math.prod(int(d) for d in shape)
    return elements > I32_OFFSET_ELEMENTS and elements * int(itemsize) <= I32_OFFSET_BYTES


def max_offset_safe_blocks(block_elems: int, itemsize: int, num_blocks: int) -> int:
    """The largest block count <= num_blocks whose array a Triton kernel addresses right.

    ``num_blocks`` itself when its array is safe (at most 2**31 elements, or over 2**32
    bytes, where offsets are 64-bit); else ``2**31 // block_elems`` blocks.

    Args:
        block_elems: Elements of one block of the array (the product of the other dims).
        itemsize: Bytes per element.
        num_blocks: The wanted block count (the leading dim).
    """
    if not offsets_wrap((num_blocks, block_elems), itemsize):
        return int(num_blocks)
    return I32_OFFSET_ELEMENTS // int(block_elems)


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (n >= 1): a Triton tile extent covering n lanes."""
    return 1 << (int(n) - 1).bit_length()


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """The shape of one of the K or V caches, in this package's layout."""
    for name, value in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")
    return (num_blocks, num_kv_heads, block_size, head_dim)


def init_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: jnp.dtype = jnp.bfloat16,
) -> tuple[jax.Array, jax.Array]:
    """Zeroed K and V caches, each ``dtype[num_blocks, num_kv_heads, block_size, head_dim]``.

    Args:
        num_blocks: Physical blocks, including the null block 0.
        block_size: Tokens per block.
        num_kv_heads: KV heads of one attention layer.
        head_dim: Size of one head.
        dtype: Cache dtype: f32, bf16, f16, or fp8 (e4m3fn / e5m2, quantized with
            per-tensor scales: quantization.py).

    Returns:
        ``(k_cache, v_cache)``; callers allocate one pair per layer.
    """
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.float32, jnp.bfloat16, jnp.float16, *FP8_DTYPES):
        raise ValueError(
            f"dtype={dtype} must be one of float32, bfloat16, float16, float8_e4m3fn, float8_e5m2"
        )
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def tile_warps(tile_elems: int, itemsize: int, floor: int = 1) -> int:
    """Triton warps for a program that holds `tile_elems` elements of `itemsize` bytes in
    registers (e.g. the K and V rows of a write or a block copy): one warp per 8 KB
    (64 32-bit registers a thread), a power of two in [floor, 8]. More bytes per warp
    spill on sm_90 (an f32 head_dim-256 write at 1 warp spilled 296 B)."""
    warps = floor
    while warps < 8 and tile_elems * itemsize > warps * 8192:
        warps *= 2
    return warps
