"""KV write by slot mapping: scatters new tokens' K/V into the paged caches, in place.

Grid ``(cdiv(num_tokens, block_t), num_kv_heads)``: a program loads block_t tokens' rows
of one KV head and stores each to ``cache[slot // block_size, head, slot % block_size]``
with a masked scatter. A slot outside ``[0, num_blocks * block_size)`` (-1 = padding, or
any bad id) is dropped on device, always (one compare per token); ``validate=True``
raises on one instead. Every operand is passed whole (a pointer): the tail tile past
num_tokens and the lanes past a head_dim that is not a power of two (80, 96) are
masked, so nothing is padded outside the kernel. The caches are aliased to the outputs
(``input_output_aliases``), so the write is in place when the caller donates them (the
engine's step jit does); without donation XLA first copies the cache. The XLA-scatter
fallback is ``reference.write_kv`` (also in place under donation). An fp8 cache is
quantized in the kernel (divide by the f32 scale, saturate, cast; quantization.py).
"""

from __future__ import annotations

import functools
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.layout import next_power_of_two, tile_warps
from pallas_kernels.quantization import kv_scales_array, quantize
from pallas_kernels.validation import check_offsets_fit, check_slot_mapping, validate_write_kv


def _write_kv_kernel(
    slot_ref,  # i32[num_tokens] (whole array)
    k_ref,  # f[num_tokens, num_kv_heads, head_dim] (whole array)
    v_ref,  # f[num_tokens, num_kv_heads, head_dim]
    k_cache_in_ref,  # aliased to k_cache_ref; unused
    v_cache_in_ref,  # aliased to v_cache_ref; unused
    scales_ref,  # f32[2]: k_scale, v_scale (used by fp8 caches only)
    k_cache_ref,  # f[num_blocks, num_kv_heads, block_size, head_dim] (whole cache)
    v_cache_ref,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    *,
    block_t: int,
    lanes: int,  # head_dim rounded up to a power of two (Triton tile extents)
):
    del k_cache_in_ref, v_cache_in_ref
    num_tokens, _, head_dim = k_ref.shape
    num_blocks, _, block_size, _ = k_cache_ref.shape
    head = pl.program_id(1)
    shape = (block_t, lanes)
    rows = pl.program_id(0) * block_t + jax.lax.broadcasted_iota(jnp.int32, (block_t,), 0)
    row_ok = rows < num_tokens if num_tokens % block_t else None  # the last tile's tail
    if row_ok is not None:
        rows = jnp.minimum(rows, num_tokens - 1)  # an in-range address; masked below
    slot = _load(slot_ref.at[rows], row_ok, -1)
    # Bounds always on: a slot outside the pool (-1 padding, or any bad id) is dropped,
    # never followed; one extra compare per token.
    keep = (slot >= 0) & (slot < num_blocks * block_size)
    slot = jnp.where(keep, slot, 0)  # any in-range address; the store is masked off
    # All-array indices (no slices): a masked gather/scatter the interpreter can
    # discharge too. Lanes past head_dim stay out of range (never accessed: masked).
    lane = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    lane_ok = lane < head_dim if lanes != head_dim else None
    row2 = jnp.broadcast_to(rows[:, None], shape)
    src = (row2, head, lane)
    load_mask = lane_ok
    if row_ok is not None:
        load_mask = _and(jnp.broadcast_to(row_ok[:, None], shape), lane_ok)
    k = _load(k_ref.at[src], load_mask, 0)
    v = _load(v_ref.at[src], load_mask, 0)
    block = jnp.broadcast_to((slot // block_size)[:, None], shape)
    offset = jnp.broadcast_to((slot % block_size)[:, None], shape)
    mask = _and(jnp.broadcast_to(keep[:, None], shape), lane_ok)
    dst = (block, head, offset, lane)
    k = quantize(k, scales_ref[0], k_cache_ref.dtype)
    v = quantize(v, scales_ref[1], v_cache_ref.dtype)
    plgpu.store(k_cache_ref.at[dst], k, mask=mask)
    plgpu.store(v_cache_ref.at[dst], v, mask=mask)


def _load(ref, mask, other):  # mask None: a plain load (Triton takes no `other` then)
    return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=other)


def _and(a, b):  # None = all true (a mask that is not needed costs no op)
    return a if b is None else b if a is None else a & b


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
    num_warps: int | None = None,
    interpret: bool = False,
    validate: bool = False,
):  # -> (k_cache, v_cache), updated
    """Writes each token's K/V at its slot; slots must be distinct (except -1).

    A slot outside the pool is dropped (the rest of the call still lands).

    Args:
        k_scale, v_scale: An fp8 cache stores saturate(k / k_scale); runtime values.
        block_t: Tokens per program (power of two).
        num_warps: Triton compiler param; None: ``layout.tile_warps`` of the program's
            K and V rows (1 for bf16 head_dim 128, 4 for f32 head_dim 256).
        interpret: Run the Pallas interpreter (CPU tests).
        validate: Check every slot against the pool on device (debug; needs checkify).
    """
    validate_write_kv(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    if validate:
        check_slot_mapping(slot_mapping, num_blocks, block_size)
    check_offsets_fit("k_cache", k_cache)
    check_offsets_fit("v_cache", v_cache)
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"block_t={block_t} must be a power of two")
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return k_cache, v_cache
    if num_warps is None:
        wide = max(jnp.dtype(k.dtype).itemsize, jnp.dtype(k_cache.dtype).itemsize)
        num_warps = tile_warps(2 * block_t * next_power_of_two(head_dim), wide)
    whole = _whole_spec
    return pl.pallas_call(
        functools.partial(_write_kv_kernel, block_t=block_t, lanes=next_power_of_two(head_dim)),
        grid=(pl.cdiv(num_tokens, block_t), num_kv_heads),
        in_specs=[
            whole(slot_mapping.shape),
            whole(k.shape),
            whole(v.shape),
            whole(k_cache.shape),
            whole(v_cache.shape),
            whole((2,)),
        ],
        out_specs=[whole(k_cache.shape), whole(v_cache.shape)],
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


def _whole_spec(shape):  # the whole array in every program: a pointer, any shape
    zeros = (0,) * len(shape)
    return pl.BlockSpec(shape, lambda t, h: zeros)
