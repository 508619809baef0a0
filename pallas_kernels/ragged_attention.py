"""Ragged paged attention: a flat batch of prefill chunks and decode tokens in one call.

The flat query rows are cut into *query blocks* of block_q tokens that never straddle two
sequences (sequence i contributes cdiv(q_len_i, block_q) blocks). Their number is at most
cdiv(num_tokens, block_q) + num_seqs, a static bound, so the grid is
``(cdiv(num_tokens, block_q) + num_seqs, num_kv_heads, num_splits)``; blocks past the
real ones do no work. The block -> (sequence, first row) map is computed in XLA from
query_start_loc. The kernel (``_attention_kernel.py``) masks causally inside each chunk
over the cached prefix and the new tokens alike.

    flat rows:   | seq0 (prefill, 37) | seq1 (chunk, 20) |s2|s3| padding ... |
    q blocks:    [16][16][ 5]          [16][ 4]           [1][1]  (unused ...)
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


def query_blocks(
    query_start_loc,  # i32[num_seqs + 1]
    num_query_blocks: int,
    block_q: int,
):  # -> (i32[num_query_blocks] sequence (num_seqs = unused), i32[num_query_blocks] first row)
    """Assigns each grid query block to a sequence and its first flat row."""
    num_seqs = query_start_loc.shape[0] - 1
    q_lens = jnp.maximum(query_start_loc[1:] - query_start_loc[:-1], 0)
    blocks = (q_lens + block_q - 1) // block_q  # i32[num_seqs]
    ends = jnp.cumsum(blocks)
    j = jnp.arange(num_query_blocks, dtype=jnp.int32)
    seq = jnp.searchsorted(ends, j, side="right").astype(jnp.int32)  # num_seqs when unused
    seq_c = jnp.minimum(seq, num_seqs - 1)
    row = query_start_loc[seq_c] + (j - (ends[seq_c] - blocks[seq_c])) * block_q
    return seq, jnp.where(seq < num_seqs, row, 0).astype(jnp.int32)


@partial(
    jax.jit,
    static_argnames=(
        "scale",
        "sliding_window",
        "soft_cap",
        "block_q",
        "block_k",
        "num_splits",
        "num_warps",
        "num_stages",
        "interpret",
        "validate",
    ),
)
def ragged_paged_attention(
    q,  # f[num_tokens, num_q_heads, head_dim]
    k_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    block_tables,  # i32[num_seqs, max_blocks_per_seq]; 0 (null block) pads
    seq_lens,  # i32[num_seqs]; whole context incl. new tokens; 0 = padded sequence
    query_start_loc,  # i32[num_seqs + 1]
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale=None,  # f32 scalar (traced) or None = 1.0; fp8 caches only
    v_scale=None,
    block_q: int = 16,
    block_k: int = 64,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
    validate: bool = False,
):  # -> f[num_tokens, num_q_heads, head_dim]
    """Causal attention of every new token over its sequence's paged context.

    Sequence i's new tokens are rows query_start_loc[i]:query_start_loc[i+1] and sit at
    the last q_len_i positions of its seq_lens[i]-token context (their K/V are already
    written). Rows past query_start_loc[-1] are padding and return zeros.

    Args:
        block_q: Query tokens per program (power of two); rows per dot are
            block_q * next_pow2(heads per KV head), raised to at least 16.
        block_k, num_splits, num_warps, num_stages, interpret, validate: As in
            ``paged_attention`` (validate also checks query_start_loc).
        Others: as in ``paged_attention``.

    Returns:
        The attention output, in q's dtype.
    """
    validate_attention_inputs(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    if validate:
        check_attention_values(k_cache, block_tables, seq_lens, query_start_loc, q.shape[0])
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    _, num_kv_heads, block_size, _ = k_cache.shape
    check_tiling(head_dim, block_q=block_q, block_k=block_k)
    block_k = max(block_k, 16)
    heads = pl.next_power_of_2(num_q_heads // num_kv_heads)
    block_q = max(block_q, 16 // heads)  # at least 16 rows in the q tile
    if num_warps is None:
        num_warps = default_num_warps(block_q * heads, block_k, head_dim)
    num_query_blocks = pl.cdiv(num_tokens, block_q) + num_seqs
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = default_num_splits(num_query_blocks * num_kv_heads, max_context, block_k)
    block_seq, block_row = query_blocks(query_start_loc, num_query_blocks, block_q)
    # block_q spare rows: a block's row window never runs off the end of the buffers.
    rows = num_tokens + block_q
    o, lse = paged_flash_attention(
        group_queries(q, num_kv_heads, heads, rows),
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        block_seq,
        block_row,
        kv_scales_array(k_scale, v_scale),
        block_q=block_q,
        block_k=block_k,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpret=interpret,
        name="ragged_paged_attention",
    )
    out = combine_splits(o, lse)
    # Rows no query block wrote (padding past query_start_loc[-1]) hold garbage: zero them.
    row = jnp.arange(rows, dtype=jnp.int32)
    out = jnp.where((row < query_start_loc[-1])[:, None, None, None], out, 0.0)
    return ungroup_output(out, num_tokens, num_q_heads, q.dtype)
