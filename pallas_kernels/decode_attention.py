"""Decode paged attention: one query token per sequence, split-K (flash-decoding).

Grid ``(num_seqs, num_kv_heads, num_splits)``: each program takes the q heads of one KV
head of one sequence (padded to >= 16 rows so the scores are one tensor-core dot) and an
even share of that sequence's visible key range, so a single long sequence still fills
the GPU. Partial outputs are merged by log-sum-exp in XLA. The query sits at position
seq_len - 1; rows with seq_len 0 return zeros. Kernel body: ``_attention_kernel.py``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._attention_kernel import (
    check_tiling,
    combine_splits,
    default_num_splits,
    default_num_warps,
    group_queries,
    paged_flash_attention,
    ungroup_output,
)
from pallas_kernels.quantization import kv_scales_array
from pallas_kernels.validation import check_attention_values, validate_attention_inputs


@partial(
    jax.jit,
    static_argnames=(
        "scale",
        "sliding_window",
        "soft_cap",
        "block_k",
        "num_splits",
        "num_warps",
        "num_stages",
        "interpret",
        "validate",
    ),
)
def paged_attention(
    q,  # f[num_seqs, num_q_heads, head_dim]
    k_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    block_tables,  # i32[num_seqs, max_blocks_per_seq]; 0 (null block) pads
    seq_lens,  # i32[num_seqs]; 0 = padded row
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale=None,  # f32 scalar (traced) or None = 1.0; fp8 caches only
    v_scale=None,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    validate: bool = False,
):  # -> f[num_seqs, num_q_heads, head_dim]
    """Attention of each sequence's newest token over its paged context.

    Args:
        q: One query token per sequence, at position seq_len - 1.
        k_cache, v_cache: The paged caches (see layout.py).
        block_tables: Each sequence's block ids in token order, padded with 0.
        seq_lens: Context length of each sequence, including the query token.
        scale: Softmax scale applied to q.k.
        sliding_window: Keys at positions > p - sliding_window are seen (HF convention).
        soft_cap: Scores become soft_cap * tanh(score / soft_cap).
        k_scale, v_scale: Dequantization scales of an fp8 cache (runtime values).
        block_k: Keys per online-softmax step (power of two >= 16; need not be a
            multiple of block_size). None: 128 for 16-bit caches, 64 for f32.
        num_splits: Split-K factor; None picks one from the static shapes (each split
            >= 512 keys, about 2 programs per SM).
        num_warps, num_stages: Triton compiler params; num_warps None: 4, or 8 for large
            tiles (``default_num_warps``); num_stages None: 3 for 16-bit
            caches, 2 for f32 (shared memory: stages x 2 K/V tiles must fit 227 KB).
            Defaults are reasoned for the H200, not yet measured (docs/kernels.md).
        interpret: Run the Pallas interpreter (CPU tests).
        validate: Check block ids and lengths against the pool on device (debug;
            needs checkify, see ``pallas_kernels.checked``).

    Returns:
        The attention output, in q's dtype.
    """
    validate_attention_inputs(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    if validate:
        check_attention_values(k_cache, block_tables, seq_lens)
    num_seqs, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    wide = jnp.dtype(k_cache.dtype).itemsize >= 4
    block_k = (64 if wide else 128) if block_k is None else block_k
    num_stages = (2 if wide else 3) if num_stages is None else num_stages
    check_tiling(head_dim, block_k=block_k)
    block_k = max(block_k, 16)
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = default_num_splits(num_seqs * num_kv_heads, max_context, block_k)
    heads = max(16, pl.next_power_of_2(num_q_heads // num_kv_heads))
    if num_warps is None:
        num_warps = default_num_warps(heads, block_k, head_dim)
    seq_ids = jnp.arange(num_seqs, dtype=jnp.int32)
    o, lse = paged_flash_attention(
        group_queries(q, num_kv_heads, heads, num_seqs),
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        jnp.arange(num_seqs + 1, dtype=jnp.int32),  # one query row per sequence
        seq_ids,
        seq_ids,
        kv_scales_array(k_scale, v_scale),
        block_q=1,
        block_k=block_k,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpret=interpret,
        name="paged_decode_attention",
    )
    return ungroup_output(combine_splits(o, lse), num_seqs, num_q_heads, q.dtype)
