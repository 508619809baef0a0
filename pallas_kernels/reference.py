"""Pure-JAX references for the paged kernels, with the kernels' exact signatures.

Gather through the block table, dense masked attention with f32 accumulation, output in
q's dtype. They define the semantics the Pallas kernels are tested against, and they are
the engine's fast path where no GPU is present (vectorised, no Python loop over sequences).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from pallas_kernels.quantization import is_fp8, quantize
from pallas_kernels.validation import (
    check_attention_values,
    check_copy_pairs,
    check_slot_mapping,
    validate_attention_inputs,
    validate_copy_blocks,
    validate_write_kv,
)

# Query rows attended per lax.map step (ragged and decode references): bounds the
# gathered K/V to chunk * context instead of num_rows * context.
_RAGGED_CHUNK = 16
# Context tokens gathered per step of the loop over a row group's keys.
_KV_CHUNK_TOKENS = 128


def _attend_rows(
    q,  # f[n, num_q_heads, head_dim]
    k_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    block_rows,  # i32[n, max_blocks_per_seq]: each query row's block table
    positions,  # i32[n]: each row's position; it sees keys in (pos - window, pos]; -1 = none
    *,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scale=None,  # f32 scalar or None: dequantization scale of an fp8 k_cache
    v_scale=None,  # f32 scalar or None
):  # -> f32[n, num_q_heads, head_dim]
    """Masked attention of n query rows over their block tables, f32 accumulation.

    An fp8 cache is dequantized on read (see quantization.py): the gathered tile is cast
    to q's dtype (exact), scores are multiplied by k_scale, the output by v_scale.

    The context is gathered and attended in chunks of _KV_CHUNK_TOKENS keys, merged with
    a running max and sum (exactly the dense softmax up to rounding). Only the chunks
    that hold a key some row can see are visited: a dynamic loop bound keeps the work
    proportional to the rows' real context, not to the block table's padded width.
    """
    n, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    blocks_per_chunk = max(1, min(block_rows.shape[1], _KV_CHUNK_TOKENS // block_size))
    num_chunks = -(-block_rows.shape[1] // blocks_per_chunk)
    # Pad with the null block: its keys sit past every position, so they are masked.
    block_rows = jnp.pad(
        block_rows, ((0, 0), (0, num_chunks * blocks_per_chunk - block_rows.shape[1]))
    )
    chunk_tokens = blocks_per_chunk * block_size
    qg = q.reshape(n, num_kv_heads, group, head_dim)
    fp8 = is_fp8(k_cache.dtype)

    def gather(cache, blocks):  # -> f[n, num_kv_heads, chunk_tokens, head_dim]
        pages = cache[blocks]  # f[n, blocks_per_chunk, num_kv_heads, block_size, head_dim]
        pages = pages.transpose(0, 2, 1, 3, 4)
        return pages.reshape(n, num_kv_heads, chunk_tokens, head_dim)

    def step(c, carry):
        m, denom, acc = carry  # f32[n, kv_heads, group] x2, f32[n, kv_heads, group, head_dim]
        blocks = jax.lax.dynamic_slice_in_dim(block_rows, c * blocks_per_chunk, blocks_per_chunk, 1)
        key_pos = c * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)
        visible = key_pos[None, :] <= positions[:, None]  # bool[n, chunk_tokens]
        if sliding_window is not None:
            visible &= key_pos[None, :] > positions[:, None] - sliding_window
        k = gather(k_cache, blocks)
        if fp8:
            k = k.astype(q.dtype)
        # Zero V outside the visible range: a masked probability of 0 times a NaN/inf in
        # an unused slot (or the null block) would otherwise still poison the output.
        v = jnp.where(visible[:, None, :, None], gather(v_cache, blocks), 0)
        s = jnp.einsum("nhgd,nhkd->nhgk", qg, k, preferred_element_type=jnp.float32) * scale
        if fp8 and k_scale is not None:
            s = s * k_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = visible[:, None, None, :]
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
        alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        denom = denom * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("nhgk,nhkd->nhgd", p, v.astype(jnp.float32))
        return m_new, denom, acc

    # Chunks [first, last] hold every key some row sees; rows at position -1 see none.
    valid = positions >= 0
    last = jnp.max(jnp.where(valid, positions, -1)) // chunk_tokens
    first = jnp.zeros((), jnp.int32)
    if sliding_window is not None:
        lowest = jnp.min(jnp.where(valid, positions - sliding_window + 1, jnp.iinfo(jnp.int32).max))
        first = jnp.maximum(lowest, 0) // chunk_tokens
    init = (
        jnp.full((n, num_kv_heads, group), -jnp.inf, jnp.float32),
        jnp.zeros((n, num_kv_heads, group), jnp.float32),
        jnp.zeros((n, num_kv_heads, group, head_dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(first, last + 1, step, init)
    o = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # rows that see nothing give exactly 0
    if fp8 and v_scale is not None:
        o = o * v_scale
    return o.reshape(n, num_q_heads, head_dim)


def _attend_row_groups(
    q,  # f[n, num_q_heads, head_dim]
    k_cache,
    v_cache,
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq,  # i32[n]: each query row's sequence
    pos,  # i32[n]: each row's position; -1 = padding (sees nothing)
    **attend,
):  # -> f32[n, num_q_heads, head_dim]
    """_attend_rows over groups of _RAGGED_CHUNK rows (lax.map).

    A group gathers only its own rows' tables and loops only to its own longest context,
    so rows of very different lengths do not pay for each other, and the gathered tile
    stays small. Decode (one row per sequence) and ragged batches share it.
    """
    n, num_q_heads, head_dim = q.shape
    chunk = min(_RAGGED_CHUNK, n)
    padded = -(-n // chunk) * chunk
    pad = padded - n
    q_p = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(-1, chunk, num_q_heads, head_dim)
    seq_p = jnp.pad(seq, (0, pad)).reshape(-1, chunk)
    pos_p = jnp.pad(pos, (0, pad), constant_values=-1).reshape(-1, chunk)

    def one_group(args):
        q_c, seq_c, pos_c = args
        return _attend_rows(q_c, k_cache, v_cache, block_tables[seq_c], pos_c, **attend)

    o = jax.lax.map(one_group, (q_p, seq_p, pos_p))
    return o.reshape(padded, num_q_heads, head_dim)[:n]


@partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "interpret", "validate"))
def paged_attention(
    q,  # f[num_seqs, num_q_heads, head_dim]
    k_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq_lens,  # i32[num_seqs]
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale=None,  # f32 scalar (traced) or None = 1.0; fp8 caches only
    v_scale=None,
    interpret: bool = False,
    validate: bool = False,
):  # -> f[num_seqs, num_q_heads, head_dim]
    """Decode attention (one query per sequence, at position seq_len - 1); see the kernel."""
    del interpret  # accepted for signature parity with the kernel
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
    o = _attend_row_groups(
        q,
        k_cache,
        v_cache,
        block_tables,
        jnp.arange(seq_lens.shape[0], dtype=jnp.int32),
        seq_lens - 1,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return o.astype(q.dtype)


def token_seq_positions(
    query_start_loc,  # i32[num_seqs + 1]
    seq_lens,  # i32[num_seqs]
    num_tokens: int,
):  # -> (i32[num_tokens] seq index, i32[num_tokens] position, bool[num_tokens] valid)
    """Maps each flat query row to its sequence and its position in that sequence.

    Row t of sequence i (qsl[i] <= t < qsl[i+1]) sits at position
    seq_lens[i] - (qsl[i+1] - qsl[i]) + (t - qsl[i]): the new tokens are the last ones.
    Rows at or past qsl[-1] are padding (valid=False, position -1: they see nothing).
    """
    num_seqs = seq_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(query_start_loc, t, side="right").astype(jnp.int32) - 1
    seq = jnp.clip(seq, 0, num_seqs - 1)
    valid = (t >= query_start_loc[seq]) & (t < query_start_loc[seq + 1])
    pos = seq_lens[seq] - query_start_loc[seq + 1] + t
    return seq, jnp.where(valid, pos, -1), valid


@partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "interpret", "validate"))
def ragged_paged_attention(
    q,  # f[num_tokens, num_q_heads, head_dim]
    k_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq_lens,  # i32[num_seqs]
    query_start_loc,  # i32[num_seqs + 1]
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale=None,  # f32 scalar (traced) or None = 1.0; fp8 caches only
    v_scale=None,
    interpret: bool = False,
    validate: bool = False,
):  # -> f[num_tokens, num_q_heads, head_dim]
    """Causal attention for a flat batch of prefill chunks and decode tokens; see the kernel."""
    del interpret
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
    seq, pos, _ = token_seq_positions(query_start_loc, seq_lens, q.shape[0])
    o = _attend_row_groups(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq,
        pos,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return o.astype(q.dtype)


def slots_to_indices(slot_mapping, num_blocks: int, block_size: int):  # -> (i32[n], i32[n])
    """(block_id, offset) per slot; slot -1 maps to block num_blocks (dropped by mode="drop")."""
    block = jnp.where(slot_mapping < 0, num_blocks, slot_mapping // block_size)
    return block.astype(jnp.int32), (slot_mapping % block_size).astype(jnp.int32)


@partial(jax.jit, static_argnames=("validate",))
def write_kv(
    k_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    k,  # f[num_tokens, num_kv_heads, head_dim]
    v,  # f[num_tokens, num_kv_heads, head_dim]
    slot_mapping,  # i32[num_tokens]; -1 = padding, dropped
    *,
    k_scale=None,  # f32 scalar (traced) or None = 1.0; fp8 caches only
    v_scale=None,
    validate: bool = False,
):  # -> (k_cache, v_cache)
    """Scatters each token's K/V to its slot; in place when the caches are donated.

    An fp8 cache stores saturate(k / k_scale) and saturate(v / v_scale) (quantization.py).
    """
    validate_write_kv(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
    num_blocks, _, block_size, _ = k_cache.shape
    if validate:
        check_slot_mapping(slot_mapping, num_blocks, block_size)
    block, offset = slots_to_indices(slot_mapping, num_blocks, block_size)
    # cache[block, :, offset, :] has shape [num_tokens, num_kv_heads, head_dim] (the
    # advanced indices are split by a slice, so their axis comes first), matching k.
    k = quantize(k, 1.0 if k_scale is None else k_scale, k_cache.dtype)
    v = quantize(v, 1.0 if v_scale is None else v_scale, v_cache.dtype)
    k_cache = k_cache.at[block, :, offset, :].set(k, mode="drop")
    v_cache = v_cache.at[block, :, offset, :].set(v, mode="drop")
    return k_cache, v_cache


@partial(jax.jit, static_argnames=("validate",))
def copy_blocks(
    k_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    src_block_ids,  # i32[num_copies]
    dst_block_ids,  # i32[num_copies]; -1 = padding, dropped
    *,
    validate: bool = False,
):  # -> (k_cache, v_cache)
    """cache[dst[i]] = cache[src[i]] for every i (destinations distinct, sources unchanged)."""
    validate_copy_blocks(k_cache, v_cache, src_block_ids, dst_block_ids)
    num_blocks = k_cache.shape[0]
    if validate:
        check_copy_pairs(src_block_ids, dst_block_ids, num_blocks)
    dst = jnp.where(dst_block_ids < 0, num_blocks, dst_block_ids)
    src = jnp.clip(src_block_ids, 0, num_blocks - 1)
    k_cache = k_cache.at[dst].set(k_cache[src], mode="drop")
    v_cache = v_cache.at[dst].set(v_cache[src], mode="drop")
    return k_cache, v_cache
