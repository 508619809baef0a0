"""Block copy for copy-on-write and swap-in: ``cache[dst[i]] = cache[src[i]]``, in place.

Grid ``(num_copies, num_kv_heads)``: a program moves one contiguous
``[block_size, head_dim]`` tile (one block, one KV head) of K and of V. The caches are
aliased to the outputs, so the copy is in place when the caller donates them. Padding
copies use dst -1 (skipped). Bounds are always on: a pair whose src or dst is not a
block id in ``[0, num_blocks)`` is dropped on device (a few scalar compares per
program); ``validate=True`` raises on one instead. A block_size or head_dim that is not
a power of two (head_dim 80, 96) is served with a tile rounded up to powers of two and
the extra rows and lanes masked. Destinations must be distinct and must not also be
sources in the same call (programs run in any order); the block manager's copy-on-write
and swap-in always copy into freshly allocated blocks. ``reference.copy_blocks`` is the
XLA fallback (gather, then scatter).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.layout import next_power_of_two, tile_warps
from pallas_kernels.validation import check_copy_pairs, check_offsets_fit, validate_copy_blocks


def _copy_blocks_kernel(
    src_ref,  # i32[num_copies]
    dst_ref,  # i32[num_copies]
    k_cache_in_ref,  # aliased to k_cache_ref; unused
    v_cache_in_ref,  # aliased to v_cache_ref; unused
    k_cache_ref,  # f[num_blocks, num_kv_heads, block_size, head_dim] (whole cache)
    v_cache_ref,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    *,
    tile: tuple[int, int],  # (block_size, head_dim) rounded up to powers of two
):
    del k_cache_in_ref, v_cache_in_ref
    i, head = pl.program_id(0), pl.program_id(1)
    num_blocks, _, block_size, head_dim = k_cache_ref.shape
    src, dst = src_ref[i], dst_ref[i]
    # Bounds always on: a bad src must drop the copy, not copy some other block.
    keep = (src >= 0) & (src < num_blocks) & (dst >= 0) & (dst < num_blocks)
    src = jnp.where(keep, src, 0)  # in-range addresses; the store is masked off
    dst = jnp.where(keep, dst, 0)
    # All-array indices: rows and lanes past block_size / head_dim stay out of range
    # (masked: never accessed on a GPU, dropped by the interpreter).
    row = jax.lax.broadcasted_iota(jnp.int32, tile, 0)
    lane = jax.lax.broadcasted_iota(jnp.int32, tile, 1)
    in_tile = None
    if tile[0] != block_size:
        in_tile = row < block_size
    if tile[1] != head_dim:
        in_tile = lane < head_dim if in_tile is None else in_tile & (lane < head_dim)
    mask = jnp.broadcast_to(keep, tile)
    if in_tile is not None:
        mask &= in_tile
    src_at = (jnp.broadcast_to(src, tile), head, row, lane)
    dst_at = (jnp.broadcast_to(dst, tile), head, row, lane)
    k = plgpu.load(k_cache_ref.at[src_at], mask=in_tile)
    v = plgpu.load(v_cache_ref.at[src_at], mask=in_tile)
    plgpu.store(k_cache_ref.at[dst_at], k, mask=mask)
    plgpu.store(v_cache_ref.at[dst_at], v, mask=mask)


@partial(jax.jit, static_argnames=("num_warps", "interpret", "validate"))
def copy_blocks(
    k_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    src_block_ids,  # i32[num_copies]
    dst_block_ids,  # i32[num_copies]; -1 = padding, skipped
    *,
    num_warps: int | None = None,
    interpret: bool = False,
    validate: bool = False,
):  # -> (k_cache, v_cache), updated
    """Copies whole blocks (all heads) from src to dst ids.

    A pair whose src or dst is not a block id in [0, num_blocks) is dropped.

    Args:
        num_warps: Triton compiler param; None: ``layout.tile_warps`` of one K and one
            V tile, at least 2 (8 for f32 at block 32 x head_dim 256).
        interpret: Run the Pallas interpreter (CPU tests).
        validate: Check the (src, dst) pairs against the pool on device (debug; needs
            checkify).
    """
    validate_copy_blocks(k_cache, v_cache, src_block_ids, dst_block_ids)
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    if validate:
        check_copy_pairs(src_block_ids, dst_block_ids, num_blocks)
    check_offsets_fit("k_cache", k_cache)
    check_offsets_fit("v_cache", v_cache)
    num_copies = src_block_ids.shape[0]
    if num_copies == 0:
        return k_cache, v_cache

    tile = (next_power_of_two(block_size), next_power_of_two(head_dim))
    if num_warps is None:
        num_warps = tile_warps(2 * tile[0] * tile[1], jnp.dtype(k_cache.dtype).itemsize, 2)

    def whole(shape):
        zeros = (0,) * len(shape)
        return pl.BlockSpec(shape, lambda i, h: zeros)

    cache_spec = whole(k_cache.shape)
    return pl.pallas_call(
        partial(
            _copy_blocks_kernel,
            tile=(next_power_of_two(block_size), next_power_of_two(head_dim)),
        ),
        grid=(num_copies, num_kv_heads),
        in_specs=[whole((num_copies,)), whole((num_copies,)), cache_spec, cache_spec],
        out_specs=[cache_spec, cache_spec],
        out_shape=[
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ],
        input_output_aliases={2: 0, 3: 1},
        # Triton params select the Triton lowering (GPU Pallas defaults to Mosaic GPU).
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="paged_copy_blocks",
    )(src_block_ids, dst_block_ids, k_cache, v_cache)
