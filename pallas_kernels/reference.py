"""Pure-JAX references for the paged kernels, with the kernels' exact signatures.

Gather through the block table, dense masked attention with f32 accumulation, output in
q's dtype. They define the semantics the Pallas kernels are tested against, and they are
the engine's fast path where no GPU is present (vectorised, no Python loop over sequences).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental.pallas import cdiv

from pallas_kernels.quantization import is_fp8, quantize
from pallas_kernels.validation import (
    check_attention_values,
    check_copy_pairs,
    check_slot_mapping,
    validate_attention_inputs,
    validate_copy_blocks,
    validate_write_kv,
)

# Decode reference: sequences sorted by context length, _DECODE_GROUP of them per lax.map
# step; bounds the gathered K/V to _DECODE_GROUP * chunk instead of num_seqs * context,
# and a group of similar lengths loops only to its own longest.
_DECODE_GROUP = 32
# Ragged reference: tiles of up to _Q_TILE consecutive rows of one sequence share one
# gathered K/V (one matrix product instead of _Q_TILE matrix-vector ones); _TILE_GROUP
# tiles per lax.map step. A decode row is a tile of its own (its spare rows compute
# masked zeros); a prefill chunk gathers each key page once per _Q_TILE rows.
_Q_TILE = 8
_TILE_GROUP = 2
# Context tokens gathered per step of the loop over a row group's keys.
_KV_CHUNK_TOKENS = 128


def _attend_rows(
    q,  # f[n, b, num_q_heads, head_dim]: n tiles of b query rows of one sequence each
    k_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    block_rows,  # i32[n, max_blocks_per_seq]: each tile's block table
    positions,  # i32[n, b]: each row's position; it sees keys in (pos - window, pos]; -1 = none
    *,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scale=None,  # f32 scalar or None: dequantization scale of an fp8 k_cache
    v_scale=None,  # f32 scalar or None
):  # -> f32[n, b, num_q_heads, head_dim]
    """Masked attention of n query tiles over their block tables, f32 accumulation.

    The b rows of a tile share one block table (one sequence), so its keys are gathered
    once for all b rows and the scores are a matrix product; decode rows are tiles of 1.
    The q heads of one kv head and the b rows form the rows of that product.

    The context is gathered and attended in chunks of _KV_CHUNK_TOKENS keys, merged with
    a running max and sum (exactly the dense softmax up to rounding). Only the chunks
    that hold a key some row can see are visited: a dynamic loop bound keeps the work
    proportional to the rows' real context, not to the block table's padded width.

    Pages are gathered whole (a block is one contiguous row of the cache) in the cache's
    dtype and widened to f32 after the gather: the dots run in f32, which is exact for
    every cache dtype (an fp8 cache is dequantized on read, quantization.py: scores are
    multiplied by k_scale, the output by v_scale).
    """
    n, b, num_q_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    rows = group * b  # query rows per kv head, ordered (q head in its group, tile row)
    blocks_per_chunk = max(1, min(block_rows.shape[1], _KV_CHUNK_TOKENS // block_size))
    num_chunks = cdiv(block_rows.shape[1], blocks_per_chunk)
    # Pad with the null block: its keys sit past every position, so they are masked.
    block_rows = jnp.pad(
        block_rows, ((0, 0), (0, num_chunks * blocks_per_chunk - block_rows.shape[1]))
    )
    chunk_tokens = blocks_per_chunk * block_size
    qg = q.reshape(n, b, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    qg = qg.reshape(n, num_kv_heads, rows, head_dim).astype(jnp.float32)
    fp8 = is_fp8(k_cache.dtype)
    # One row per block, so a gather copies whole contiguous pages.
    k_pages = k_cache.reshape(num_blocks, -1)  # [num_blocks, num_kv_heads * bs * d]
    v_pages = v_cache.reshape(num_blocks, -1)

    def step(c, carry):
        m, denom, acc = carry  # f32[n, kv_heads, rows] x2, f32[n, kv_heads, rows, d]
        # Tie the pools to the loop step: otherwise XLA hoists the widening of a narrow
        # cache (its CPU gather runs in f32) out of the loop as a conversion of the whole
        # pool, which costs time in proportion to the pool instead of the context.
        k_rows, v_rows, c = jax.lax.optimization_barrier((k_pages, v_pages, c))
        blocks = jax.lax.dynamic_slice_in_dim(block_rows, c * blocks_per_chunk, blocks_per_chunk, 1)
        key_pos = c * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)
        visible = key_pos <= positions[..., None]  # bool[n, b, chunk_tokens]
        if sliding_window is not None:
            visible &= key_pos > positions[..., None] - sliding_window
        # A block id outside the pool is never followed: its keys are invisible.
        page_ok = (blocks >= 0) & (blocks < num_blocks)  # bool[n, blocks_per_chunk]
        visible &= jnp.repeat(page_ok, block_size, axis=1)[:, None, :]
        blocks = jnp.where(page_ok, blocks, 0)
        page_shape = (n, blocks_per_chunk, num_kv_heads, block_size, head_dim)
        k = k_rows[blocks].reshape(page_shape).astype(jnp.float32)
        # The chunk's (block, offset) pair is contracted as it was gathered: no reshape
        # of the pages into one token axis first.
        s = jnp.einsum("nhrd,nchtd->nhrct", qg, k).reshape(n, num_kv_heads, rows, chunk_tokens)
        s = s * scale
        if fp8 and k_scale is not None:
            s = s * k_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        # visible[n, b, k] -> mask[n, 1, (g, b), k]
        mask = jnp.broadcast_to(visible[:, None, None], (n, 1, group, b, chunk_tokens))
        mask = mask.reshape(n, 1, rows, chunk_tokens)
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
        alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        denom = denom * alpha + jnp.sum(p, axis=-1)
        # Zero V outside every row's visible range: a masked probability of 0 times a
        # NaN/inf in an unused slot (or the null block) would otherwise poison the output.
        seen = jnp.any(visible, axis=1).reshape(n, blocks_per_chunk, 1, block_size, 1)
        v = jnp.where(seen, v_rows[blocks].reshape(page_shape).astype(jnp.float32), 0.0)
        p_pages = p.reshape(n, num_kv_heads, rows, blocks_per_chunk, block_size)
        acc = acc * alpha[..., None] + jnp.einsum("nhrct,nchtd->nhrd", p_pages, v)
        return m_new, denom, acc

    # Chunks [first, last] hold every key some row sees; rows at position -1 see none.
    valid = positions >= 0
    last = jnp.max(jnp.where(valid, positions, -1)) // chunk_tokens
    first = jnp.zeros((), jnp.int32)
    if sliding_window is not None:
        lowest = jnp.min(jnp.where(valid, positions - sliding_window + 1, jnp.iinfo(jnp.int32).max))
        first = jnp.maximum(lowest, 0) // chunk_tokens
    init = (
        jnp.full((n, num_kv_heads, rows), -jnp.inf, jnp.float32),
        jnp.zeros((n, num_kv_heads, rows), jnp.float32),
        jnp.zeros((n, num_kv_heads, rows, head_dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(first, last + 1, step, init)
    o = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # rows that see nothing give exactly 0
    if fp8 and v_scale is not None:
        o = o * v_scale
    # [n, kv_heads, (g, b), d] -> [n, b, kv_heads * g, d]
    o = o.reshape(n, num_kv_heads, group, b, head_dim).transpose(0, 3, 1, 2, 4)
    return o.reshape(n, b, num_q_heads, head_dim)


def _attend_tile_groups(
    q,  # f[n, b, num_q_heads, head_dim]: query tiles
    k_cache,
    v_cache,
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq,  # i32[n]: each tile's sequence
    pos,  # i32[n, b]: each row's position; -1 = padding (sees nothing)
    tiles_per_group: int,
    **attend,
):  # -> f32[n, b, num_q_heads, head_dim]
    """_attend_rows over groups of ``tiles_per_group`` tiles (lax.map).

    A group gathers only its own tiles' tables and loops only to its own longest context,
    so tiles of very different lengths do not pay for each other, and the gathered K/V
    stays small; a group of padding tiles runs no loop step at all.
    """
    n, b, num_q_heads, head_dim = q.shape
    chunk = min(tiles_per_group, n)
    padded = cdiv(n, chunk) * chunk
    pad = padded - n
    q_p = jnp.pad(q, ((0, pad), (0, 0), (0, 0), (0, 0))).reshape(
        -1, chunk, b, num_q_heads, head_dim
    )
    seq_p = jnp.pad(seq, (0, pad)).reshape(-1, chunk)
    pos_p = jnp.pad(pos, ((0, pad), (0, 0)), constant_values=-1).reshape(-1, chunk, b)

    def one_group(args):
        q_c, seq_c, pos_c = args
        return _attend_rows(q_c, k_cache, v_cache, block_tables[seq_c], pos_c, **attend)

    o = jax.lax.map(one_group, (q_p, seq_p, pos_p))
    return o.reshape(padded, b, num_q_heads, head_dim)[:n]


def query_tiles(
    query_start_loc,  # i32[num_seqs + 1]
    seq_lens,  # i32[num_seqs]
    num_tokens: int,
    tile: int,
):  # -> (i32[n] seq, i32[n, tile] row, i32[n, tile] position), n = static tile count
    """Cuts each sequence's new tokens into tiles of at most ``tile`` consecutive rows.

    Tiles never straddle sequences, so a tile's rows share one block table (a decode row
    is a tile of its own). The tile count is static: the sum over sequences of
    cdiv(q_len, tile) is <= num_tokens // tile + min(S, num_tokens). Unused tiles and rows
    past a tile's tokens get row = num_tokens (out of range: their output is dropped)
    and position -1 (they see nothing).
    """
    num_seqs = seq_lens.shape[0]
    n = num_tokens // tile + min(num_seqs, num_tokens)
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    tiles_per_seq = (q_len + tile - 1) // tile
    ends = jnp.cumsum(tiles_per_seq)
    i = jnp.arange(n, dtype=jnp.int32)
    s = jnp.clip(jnp.searchsorted(ends, i, side="right"), 0, num_seqs - 1).astype(jnp.int32)
    j = i - (ends[s] - tiles_per_seq[s])  # tile index within its sequence
    offset = j[:, None] * tile + jnp.arange(tile, dtype=jnp.int32)  # row within the sequence
    live = (i < ends[-1])[:, None] & (offset < q_len[s][:, None])
    row = jnp.where(live, query_start_loc[s][:, None] + offset, num_tokens)
    position = jnp.where(live, seq_lens[s][:, None] - q_len[s][:, None] + offset, -1)
    return s, row.astype(jnp.int32), position.astype(jnp.int32)


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
    # Longest first: a row group loops to its own longest context, so similar lengths
    # share a group; outputs go back to the callers' order below.
    order = jnp.argsort(seq_lens, descending=True).astype(jnp.int32)
    o = _attend_tile_groups(
        q[order][:, None],
        k_cache,
        v_cache,
        block_tables,
        order,
        (seq_lens[order] - 1)[:, None],
        tiles_per_group=_DECODE_GROUP,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )[:, 0]
    o = jnp.zeros_like(o).at[order].set(o, unique_indices=True)
    return o.astype(q.dtype)


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
    num_tokens = q.shape[0]
    seq, row, pos = query_tiles(query_start_loc, seq_lens, num_tokens, _Q_TILE)
    o = _attend_tile_groups(
        q.at[row].get(mode="fill", fill_value=0),
        k_cache,
        v_cache,
        block_tables,
        seq,
        pos,
        tiles_per_group=_TILE_GROUP,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    # Each real row is in exactly one tile; padding rows (past query_start_loc[-1]) stay 0.
    out = jnp.zeros((num_tokens,) + q.shape[1:], jnp.float32)
    out = out.at[row.reshape(-1)].set(o.reshape((-1,) + q.shape[1:]), mode="drop")
    return out.astype(q.dtype)


def slots_to_indices(slot_mapping, num_blocks: int, block_size: int):  # -> (i32[n], i32[n])
    """(block_id, offset) per slot; a slot outside [0, num_blocks * block_size) (-1 is
    padding) maps to block num_blocks, which mode="drop" drops."""
    bad = (slot_mapping < 0) | (slot_mapping >= num_blocks * block_size)
    block = jnp.where(bad, num_blocks, slot_mapping // block_size)
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
    """cache[dst[i]] = cache[src[i]] for every i (destinations distinct, sources unchanged).

    A pair whose src or dst is not a block id in [0, num_blocks) is dropped (dst -1 is
    padding).
    """
    validate_copy_blocks(k_cache, v_cache, src_block_ids, dst_block_ids)
    num_blocks = k_cache.shape[0]
    if validate:
        check_copy_pairs(src_block_ids, dst_block_ids, num_blocks)
    bad = (src_block_ids < 0) | (src_block_ids >= num_blocks)
    bad |= (dst_block_ids < 0) | (dst_block_ids >= num_blocks)
    dst = jnp.where(bad, num_blocks, dst_block_ids)  # past the end: mode="drop" drops it
    src = jnp.clip(src_block_ids, 0, num_blocks - 1)  # any in-range row; dropped if bad
    k_cache = k_cache.at[dst].set(k_cache[src], mode="drop")
    v_cache = v_cache.at[dst].set(v_cache[src], mode="drop")
    return k_cache, v_cache
