"""KV write by slot mapping: scatters new tokens' K/V into the paged caches, in place.

Grid ``(cdiv(num_tokens, block_t), num_kv_heads)``: a program loads block_t tokens' rows
of one KV head and stores each to ``cache[slot // block_size, head, slot % block_size]``
with a masked scatter (slot -1 = padding, not stored). The caches are aliased to the
outputs (``input_output_aliases``), so the write is in place when the caller donates
them (the engine's step jit does); without donation XLA first copies the cache. The
XLA-scatter fallback is ``reference.write_kv`` (also in place under donation). An fp8
cache is quantized in the kernel (divide by the f32 scale, saturate, cast; quantization.py).
"""

from __future__ import annotations

import functools
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.quantization import kv_scales_array, quantize
from pallas_kernels.validation import check_slot_mapping, validate_write_kv


def _write_kv_kernel(
    slot_ref,  # i32[block_t]
    k_ref,  # f[block_t, head_dim] (this KV head)
    v_ref,  # f[block_t, head_dim]
    k_cache_in_ref,  # aliased to k_cache_ref; unused
    v_cache_in_ref,  # aliased to v_cache_ref; unused
    scales_ref,  # f32[2]: k_scale, v_scale (used by fp8 caches only)
    k_cache_ref,  # f[num_blocks, num_kv_heads, block_size, head_dim] (whole cache)
    v_cache_ref,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    *,
    block_size: int,
):
    del k_cache_in_ref, v_cache_in_ref
    head = pl.program_id(1)
    slot = slot_ref[...]
    keep = slot >= 0
    slot = jnp.where(keep, slot, 0)  # any in-range address; the store is masked off
    # All-array indices (no slices): a masked scatter the interpreter can discharge too.
    shape = k_ref.shape  # (block_t, head_dim)
    block = jnp.broadcast_to((slot // block_size)[:, None], shape)
    offset = jnp.broadcast_to((slot % block_size)[:, None], shape)
    lane = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    mask = jnp.broadcast_to(keep[:, None], shape)
    dst = (block, head, offset, lane)
    k = quantize(k_ref[...], scales_ref[0], k_cache_ref.dtype)
    v = quantize(v_ref[...], scales_ref[1], v_cache_ref.dtype)
    plgpu.store(k_cache_ref.at[dst], k, mask=mask)
    plgpu.store(v_cache_ref.at[dst], v, mask=mask)


@partial(jax.jit, static_argnames=("block_t", "num_warps", "interpret", "validate"))
def write_kv(
    k_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    k,  # f[num_tokens, num_kv_heads, head_dim]
    v,  # f[num_tokens, num_kv_heads, head_dim]
    slot_mapping,  # i32[num_tokens]; slot = block_id * block_size + offset; -1 dropped
    *,
    k_scale=None,  # f32 scalar (traced) or None = 1.0; fp8 caches only
    v_scale=None,
    block_t: int = 16,
    num_warps: int = 1,
    interpret: bool = False,
    validate: bool = False,
):  # -> (k_cache, v_cache), updated
    """Writes each token's K/V at its slot; slots must be distinct (except -1).

    Args:
        k_scale, v_scale: An fp8 cache stores saturate(k / k_scale); runtime values.
        block_t: Tokens per program (power of two).
        num_warps: Triton compiler param.
        interpret: Run the Pallas interpreter (CPU tests).
        validate: Check every slot against the pool on device (debug; needs checkify).
    """
    validate_write_kv(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    if validate:
        check_slot_mapping(slot_mapping, num_blocks, block_size)
    num_tokens = k.shape[0]
    if head_dim & (head_dim - 1) or block_t & (block_t - 1):
        raise ValueError(f"head_dim={head_dim} and block_t={block_t} must be powers of two")
    padded = pl.cdiv(num_tokens, block_t) * block_t
    if padded != num_tokens:
        pad = padded - num_tokens
        k = jnp.pad(k, ((0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, pad), (0, 0), (0, 0)))
        slot_mapping = jnp.pad(slot_mapping, (0, pad), constant_values=-1)
    row_spec = pl.BlockSpec((block_t, pl.squeezed, head_dim), lambda t, h: (t, h, 0))
    cache_spec = pl.BlockSpec(k_cache.shape, lambda t, h: (0, 0, 0, 0))
    return pl.pallas_call(
        functools.partial(_write_kv_kernel, block_size=block_size),
        grid=(padded // block_t, num_kv_heads),
        in_specs=[
            pl.BlockSpec((block_t,), lambda t, h: (t,)),
            row_spec,
            row_spec,
            cache_spec,
            cache_spec,
            pl.BlockSpec((2,), lambda t, h: (0,)),
        ],
        out_specs=[cache_spec, cache_spec],
        out_shape=[
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ],
        input_output_aliases={3: 0, 4: 1},
        # Triton params select the Triton lowering (GPU Pallas defaults to Mosaic GPU).
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="paged_write_kv",
    )(slot_mapping, k, v, k_cache, v_cache, kv_scales_array(k_scale, v_scale))
