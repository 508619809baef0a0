"""The paged flash-attention kernel shared by decode and ragged attention, and its merges.

One program handles one *work item* (pallas_kernels/plan.py: a sequence, its first query
row and a key range) for one KV head and one split of that item's keys:

    grid = (num_items, num_kv_heads, num_splits)

    rows of the program's q tile (M = block_q * heads, all q heads of one KV head, padded
    to `heads` rows per token):
        token 0: head 0 .. heads-1 | token 1: head 0 .. heads-1 | ...
    key range of the item, cut into block_k-token compute blocks and split evenly:
        [k_lo ............................................. k_hi)
        |  split 0   |  split 1   |  split 2   |  split 3   |

q and the output are read and written in the caller's ``[tokens, q_heads, head_dim]``
layout with masked loads and stores (padding heads, a head_dim that is not a power of
two, rows past the end): no padded copy of q and no slice of the output exist outside.

Each compute block gathers block_k tokens through the block table (a page id per token,
so block_k need not be a multiple of block_size) and runs one online-softmax step. The
page ids of block i + 1 are loaded during block i: the K/V addresses of a block never wait
on a load of the same iteration, which lets Triton's software pipeliner keep num_stages - 1
K/V tiles in flight (cp.async into shared memory) while the current one is computed.

Output modes (static): "direct" writes the normalised output in q's dtype (one split);
"rows" writes each split's f32 partial output and log-sum-exp at its query rows, merged
by ``combine_rows``; "items" writes one partial per item (decode work lists, block_q 1),
merged per sequence by ``combine_items`` (flash-decoding).

Masking: a key is visible to a query at position p iff p - window < key <= p (and
key < seq_len); invisible scores become a finite -1e30 and their probabilities exactly 0.
K/V are *masked loads* outside the item's key range and wherever the block table holds an
id outside [0, num_blocks) (such a key is invisible: a corrupt table can never make the
kernel read outside the cache), so NaN/inf in the null block or unused slots never reach
the output and entries past a sequence's length are never followed.

Precision: both dots accumulate in f32; with f32 inputs they run at
``lax.Precision.HIGHEST`` (Triton's IEEE f32 dot). Triton's default for f32 is TF32
(10-bit mantissa), which would make f32 GPU outputs differ from CPU ones by ~1e-3.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.names import DECODE_TARGET_PROGRAMS, MIN_CHUNK_TOKENS
from pallas_kernels.plan import ITEM_HI, ITEM_LO, ITEM_ROW, ITEM_SEQ
from pallas_kernels.quantization import is_fp8

NEG = -1e30  # finite "minus infinity": exp(NEG - NEG) = 1 stays finite, unlike inf - inf
# Full f32 precision for f32 dots (IEEE, not TF32); bf16/f16 dots are unaffected.
DOT_PRECISION = jax.lax.Precision.HIGHEST
# Smallest key range one split-K program gets (the decode work list's chunk floor, too):
# below it the partial output's write and the merge cost more than the parallelism buys.
MIN_SPLIT_TOKENS = MIN_CHUNK_TOKENS
OUT_MODES = ("direct", "rows", "items")


def _kernel(
    items_ref,  # i32[num_items, 4]: (sequence, first row, key lo, key hi); plan.py
    qsl_ref,  # i32[num_seqs + 1]
    seq_lens_ref,  # i32[num_seqs]
    bt_ref,  # i32[num_seqs, max_blocks_per_seq]
    q_ref,  # f[num_rows, group, head_dim] (this KV head)
    k_ref,  # f[num_blocks, block_size, head_dim] (this KV head)
    v_ref,  # f[num_blocks, block_size, head_dim] (this KV head)
    scales_ref,  # f32[2]: k_scale, v_scale (fp8 caches: dequantized on read)
    o_ref,  # direct: f[num_rows, group, d]; rows: f32[num_rows, ...]; items: f32[num_items, ...]
    *lse_refs,  # rows/items: f32[num_rows or num_items, group]; direct: none
    block_q: int,
    block_k: int,
    heads: int,
    tile_d: int,
    num_seqs: int,
    max_blocks_per_seq: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    out_mode: str,
):
    g = pl.program_id(0)
    split = pl.program_id(2)
    num_splits = pl.num_programs(2)
    num_rows, group, head_dim = q_ref.shape
    num_blocks, block_size, _ = k_ref.shape
    m_rows = block_q * heads

    seq_raw = items_ref[g, ITEM_SEQ]
    row0 = items_ref[g, ITEM_ROW]
    in_use = seq_raw < num_seqs
    seq = jnp.minimum(seq_raw, num_seqs - 1)
    q_start = qsl_ref[seq]
    q_end = jnp.where(in_use, qsl_ref[seq + 1], q_start)
    ctx = seq_lens_ref[seq]
    first_pos = ctx - (q_end - q_start)  # position of row q_start

    # Positions of the valid rows of this item: [p_lo, p_hi].
    p_lo = first_pos + (row0 - q_start)
    p_hi = first_pos + (jnp.minimum(row0 + block_q, q_end) - 1 - q_start)
    k_hi = jnp.minimum(jnp.minimum(p_hi + 1, ctx), items_ref[g, ITEM_HI])
    k_hi = jnp.where(in_use, k_hi, 0)  # unused items do no work
    k_lo = jnp.zeros_like(k_hi) if sliding_window is None else p_lo - sliding_window + 1
    k_lo = jnp.maximum(jnp.maximum(k_lo, 0), items_ref[g, ITEM_LO])
    cb_lo = k_lo // block_k
    num_cb = jnp.maximum(pl.cdiv(k_hi, block_k) - cb_lo, 0)
    per_split = pl.cdiv(num_cb, num_splits)
    my_lo = cb_lo + jnp.minimum(split * per_split, num_cb)
    my_hi = cb_lo + jnp.minimum((split + 1) * per_split, num_cb)

    # q tile [block_q, heads, tile_d] read in place: rows past the item, padding heads and
    # lanes past head_dim are masked (read as 0, never fetched). The head and lane slices
    # may run past their axis (a masked overhang, as Triton pointers and the
    # interpreter's padded slices both allow); their start is a traced 0 so the static
    # bounds check of the indexer does not reject the overhang.
    shape3 = (block_q, heads, tile_d)
    rows3 = row0 + jax.lax.broadcasted_iota(jnp.int32, shape3, 0)
    heads3 = jax.lax.broadcasted_iota(jnp.int32, shape3, 1)
    lanes3 = jax.lax.broadcasted_iota(jnp.int32, shape3, 2)
    row_hi = jnp.where(in_use, q_end, num_rows)  # unused items zero the padding rows
    zero = jnp.minimum(g, 0)
    head_slice, lane_slice = pl.ds(zero, heads), pl.ds(zero, tile_d)
    q_mask = (heads3 < group) & (lanes3 < head_dim) & (rows3 < row_hi)
    q_view = q_ref.at[pl.ds(row0, block_q), head_slice, lane_slice]
    q = plgpu.load(q_view, mask=q_mask, other=0).reshape(m_rows, tile_d)
    fp8 = is_fp8(k_ref.dtype)  # fp8 tiles are cast to q's dtype (exact), scales applied after
    # Position of each of the M rows (row r is token r // heads of the item).
    row_pos = p_lo + jax.lax.broadcasted_iota(jnp.int32, (m_rows,), 0) // heads

    tile = (block_k, tile_d)
    lanes = jax.lax.broadcasted_iota(jnp.int32, tile, 1)
    # Lanes past a head_dim that is not a power of two are masked (their addresses run
    # into the next row, never fetched; the interpreter's gather clamps them). No min()
    # on the iota: Triton then still sees each row as contiguous runs and copies it with
    # wide cp.async transfers into shared memory.
    masked_lanes = tile_d != head_dim
    lane_ok = lanes < head_dim

    def load_pages(cb):  # -> i32[block_k] page of each token of compute block cb
        tok = cb * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        page_col = jnp.minimum(tok // block_size, max_blocks_per_seq - 1)
        return bt_ref[seq, page_col]

    def step(cb, carry):
        m, denom, acc, pages = carry
        next_pages = load_pages(cb + 1)  # ahead of the K/V loads they address
        tok = cb * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        page_ok = (pages >= 0) & (pages < num_blocks)
        key_ok = (tok >= k_lo) & (tok < k_hi) & page_ok
        kv_mask = (
            key_ok[:, None] & lane_ok if masked_lanes else jnp.broadcast_to(key_ok[:, None], tile)
        )
        # Masked loads: keys outside the range read as 0 and are never fetched, so a
        # garbage id past seq_len (or out of the pool) is never followed and NaN in unused
        # slots stays out (p = 0 times a NaN V would still be NaN; a loaded 0 is not).
        # All-array indices (no slices), which the interpreter can discharge too.
        idx = (
            jnp.broadcast_to(jnp.where(page_ok, pages, 0)[:, None], tile),
            jnp.broadcast_to((tok % block_size)[:, None], tile),
            lanes,
        )
        # Triton cannot cast an int fill to fp8; a float one it can (sm89+).
        other = 0.0 if fp8 else 0
        k = plgpu.load(k_ref.at[idx], mask=kv_mask, other=other)  # f[block_k, tile_d]
        v = plgpu.load(v_ref.at[idx], mask=kv_mask, other=other)
        if fp8:
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        s = jax.lax.dot_general(
            q,
            k,
            (((1,), (1,)), ((), ())),
            precision=DOT_PRECISION,
            preferred_element_type=jnp.float32,
        )  # f32[M, block_k]
        s = s * scale
        if fp8:
            s = s * scales_ref[0]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        visible = key_ok[None, :] & (tok[None, :] <= row_pos[:, None])
        if sliding_window is not None:
            visible &= tok[None, :] > row_pos[:, None] - sliding_window
        s = jnp.where(visible, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        denom = alpha * denom + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(
            p.astype(v.dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=DOT_PRECISION,
            preferred_element_type=jnp.float32,
        )
        return m_new, denom, acc * alpha[:, None] + pv, next_pages

    init = (
        jnp.full((m_rows,), NEG, jnp.float32),
        jnp.zeros((m_rows,), jnp.float32),
        jnp.zeros((m_rows, tile_d), jnp.float32),
        load_pages(my_lo),
    )
    m, denom, acc, _ = jax.lax.fori_loop(my_lo, my_hi, step, init)
    has = denom > 0
    o = acc / jnp.where(has, denom, 1.0)[:, None]
    if fp8:
        o = o * scales_ref[1]
    o = o.reshape(shape3)

    if out_mode == "items":  # block_q == 1: the item's own slot, always written
        real = (heads3 < group) & (lanes3 < head_dim)
        plgpu.store(
            o_ref.at[g, head_slice, lane_slice],
            o.reshape(heads, tile_d),
            mask=real.reshape(heads, tile_d),
        )
    else:
        o_view = o_ref.at[pl.ds(row0, block_q), head_slice, lane_slice]
        plgpu.store(o_view, o.astype(o_ref.dtype), mask=q_mask)
    if not lse_refs:
        return
    (lse_ref,) = lse_refs
    lse = jnp.where(has, m + jnp.log(jnp.where(has, denom, 1.0)), NEG)
    shape2 = (block_q, heads)
    heads2 = jax.lax.broadcasted_iota(jnp.int32, shape2, 1)
    if out_mode == "items":
        real = (heads2 < group).reshape(heads)
        plgpu.store(lse_ref.at[g, head_slice], lse.reshape(heads), mask=real)
    else:
        rows2 = row0 + jax.lax.broadcasted_iota(jnp.int32, shape2, 0)
        ok = (heads2 < group) & (rows2 < row_hi)
        plgpu.store(lse_ref.at[pl.ds(row0, block_q), head_slice], lse.reshape(shape2), mask=ok)


def paged_flash_attention(
    q,  # f[num_rows, num_q_heads, head_dim]
    k_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq_lens,  # i32[num_seqs]
    query_start_loc,  # i32[num_seqs + 1]
    items,  # i32[num_items, 4] (plan.py)
    kv_scales,  # f32[2]: k_scale, v_scale (read by fp8 caches only)
    *,
    block_q: int,
    block_k: int,
    heads: int,
    num_splits: int,
    num_warps: int,
    num_stages: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    out_mode: str,
    interpret: bool,
    name: str,
):
    """The pallas_call: grid, BlockSpecs and compiler params around ``_kernel``.

    Returns, by out_mode: "direct": f[num_rows, num_kv_heads, group, head_dim] in q's
    dtype; "rows": (f32[num_splits, num_rows, kv, group, d], f32[num_splits, num_rows, kv,
    group]); "items": the same with num_items in place of num_rows.
    """
    if out_mode not in OUT_MODES:
        raise ValueError(f"out_mode={out_mode!r} must be one of {OUT_MODES}")
    if out_mode == "direct" and num_splits != 1:
        raise ValueError(f"out_mode='direct' needs num_splits=1, got {num_splits}")
    if out_mode == "items" and block_q != 1:
        raise ValueError(f"out_mode='items' needs block_q=1, got {block_q}")
    num_rows, num_q_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    num_seqs, max_blocks_per_seq = block_tables.shape
    num_items = items.shape[0]
    group = num_q_heads // num_kv_heads
    qg = q.reshape(num_rows, num_kv_heads, group, head_dim)  # a bitcast, not a copy

    def whole(x):
        zeros = (0,) * x.ndim
        return pl.BlockSpec(x.shape, lambda g, h, s: zeros)

    kernel = functools.partial(
        _kernel,
        block_q=block_q,
        block_k=block_k,
        heads=heads,
        tile_d=pl.next_power_of_2(head_dim),
        num_seqs=num_seqs,
        max_blocks_per_seq=max_blocks_per_seq,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        out_mode=out_mode,
    )
    kv_spec = pl.BlockSpec(
        (num_blocks, pl.squeezed, block_size, head_dim), lambda g, h, s: (0, h, 0, 0)
    )
    out_rows = num_items if out_mode == "items" else num_rows
    if out_mode == "direct":
        out_specs = pl.BlockSpec(
            (num_rows, pl.squeezed, group, head_dim), lambda g, h, s: (0, h, 0, 0)
        )
        out_shape = jax.ShapeDtypeStruct((num_rows, num_kv_heads, group, head_dim), q.dtype)
    else:
        out_specs = [
            pl.BlockSpec(
                (pl.squeezed, out_rows, pl.squeezed, group, head_dim),
                lambda g, h, s: (s, 0, h, 0, 0),
            ),
            pl.BlockSpec((pl.squeezed, out_rows, pl.squeezed, group), lambda g, h, s: (s, 0, h, 0)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct(
                (num_splits, out_rows, num_kv_heads, group, head_dim), jnp.float32
            ),
            jax.ShapeDtypeStruct((num_splits, out_rows, num_kv_heads, group), jnp.float32),
        ]
    return pl.pallas_call(
        kernel,
        grid=(num_items, num_kv_heads, num_splits),
        in_specs=[
            whole(items),
            whole(query_start_loc),
            whole(seq_lens),
            whole(block_tables),
            pl.BlockSpec((num_rows, pl.squeezed, group, head_dim), lambda g, h, s: (0, h, 0, 0)),
            kv_spec,
            kv_spec,
            whole(kv_scales),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        # Triton params select the Triton lowering (GPU Pallas defaults to Mosaic GPU).
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(items, query_start_loc, seq_lens, block_tables, qg, k_cache, v_cache, kv_scales)


def combine_rows(
    o,  # f32[num_splits, rows, num_kv_heads, group, head_dim]
    lse,  # f32[num_splits, rows, num_kv_heads, group]
):  # -> f32[rows, num_kv_heads, group, head_dim]
    """Merges split-K partial outputs by their log-sum-exp (exactly 0 where no split saw a key)."""
    if o.shape[0] == 1:
        return o[0]
    m = jnp.max(lse, axis=0)
    w = jnp.exp(lse - m[None])  # splits that saw nothing have lse = NEG: weight 0 or, if all
    w = jnp.where(lse > NEG / 2, w, 0.0)  # saw nothing, every weight is 0 and so is the sum
    total = jnp.sum(w, axis=0)
    out = jnp.einsum("srkh,srkhd->rkhd", w, o)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def combine_items(
    o,  # f32[num_splits, num_items, num_kv_heads, group, head_dim]
    lse,  # f32[num_splits, num_items, num_kv_heads, group]
    item_seq,  # i32[num_items]; num_seqs = unused
    num_seqs: int,
):  # -> f32[num_seqs, num_kv_heads, group, head_dim]
    """Merges each sequence's partial outputs (its items x splits) by log-sum-exp.

    A sequence with no item, or whose items saw no key, gets exactly 0.
    """
    n, num_items = o.shape[:2]
    o = o.reshape((n * num_items,) + o.shape[2:])
    lse = lse.reshape((n * num_items,) + lse.shape[2:])
    seg = jnp.tile(item_seq, n)
    valid = lse > NEG / 2
    lse = jnp.where(valid, lse, NEG)
    m = jax.ops.segment_max(lse, seg, num_segments=num_seqs + 1)  # [S + 1, kv, group]
    w = jnp.where(valid, jnp.exp(lse - m[seg]), 0.0)
    total = jax.ops.segment_sum(w, seg, num_segments=num_seqs + 1)
    acc = jax.ops.segment_sum(
        w[..., None] * jnp.where(valid[..., None], o, 0.0), seg, num_segments=num_seqs + 1
    )
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]
    return out[:num_seqs]


def default_num_splits(num_programs: int, max_context: int, block_k: int) -> int:
    """Enough splits for ~2 programs per SM on a 132-SM GPU, but each split >= 512 keys
    (MIN_SPLIT_TOKENS) and >= one block_k, and at most 32."""
    per_split = max(MIN_SPLIT_TOKENS, block_k)
    return max(
        1,
        min(DECODE_TARGET_PROGRAMS // max(num_programs, 1), pl.cdiv(max_context, per_split), 32),
    )


def default_num_warps(rows: int, block_k: int, head_dim: int) -> int:
    """Warps for one program: 8 when its q tile has 128 rows or more, or when its q and
    K/V tiles are large together, else 4.

    rows: query rows of the program's tile (query tokens x q heads per KV head);
    block_k: keys per step; head_dim: padded to a power of two. A program holds a rows x
    head_dim accumulator and streams block_k x head_dim K/V tiles; at 128 rows, or past
    (rows + block_k) * head_dim = 24,576 elements (e.g. decode at head_dim 256), 4 warps
    exceed the 255-register budget on sm_90 and spill, while 8 warps fit
    (scripts/gpu_compile_check.py).
    """
    return 8 if rows >= 128 or (rows + block_k) * head_dim >= 24_576 else 4


def check_tiling(head_dim: int, **knobs: int) -> None:
    """head_dim >= 16 (any value: lanes are masked up to a power of two); the tiling
    knobs are power-of-two ints (Triton block extents)."""
    if not isinstance(head_dim, int) or head_dim < 16:
        raise ValueError(f"head_dim={head_dim} must be an int >= 16 for the Pallas kernels")
    for name, value in knobs.items():
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"{name}={value!r} must be a power-of-two int")


def q_heads_per_tile(group: int, block_q: int) -> int:
    """Rows per query token in a program's q tile: the group padded to a power of two,
    and far enough that the tile has at least 16 rows (a tensor-core dot's minimum)."""
    return max(pl.next_power_of_2(group), pl.cdiv(16, block_q))
