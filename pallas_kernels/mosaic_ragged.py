"""Ragged (mixed prefill + decode) paged attention on Mosaic GPU (Hopper).

The flat query rows are cut into query blocks of block_q tokens of one sequence
(``plan.ragged_items``, the Triton ragged kernel's work items). One program (one
warpgroup) handles a 64-row *tile* of one query block, one KV head and one split of the
tile's causal key range:

    grid = (num_items, num_kv_heads, num_subtiles * num_splits)

    rows of a query block (all q heads of the KV head, token-major):
        token 0: head 0 .. group-1 | token 1: head 0 .. group-1 | ...
    cut into num_subtiles = cdiv(block_q * group, 64) tiles of 64 rows (wgmma's M per
    warpgroup); block_q * group = 64 (e.g. block_q 16 at GQA 4) wastes no row.

q is laid out once per call in XLA as [num_kv_heads, rows, head_dim] (token-major rows
of each KV head), so a tile is one TMA box of 64 consecutive rows. Pages move exactly as
in the decode kernel (mosaic_decode.py): one TMA copy per page into a num_stages-deep
K/V ring of SMEM slots guarded by barriers; QK^T and PV on wgmma from SMEM; P through
SMEM in q's dtype; V rows of keys outside the tile's key range or behind an id outside
the pool zeroed in SMEM before the PV product (NaN in unused pages never reaches the
output); fp8 tiles widened through f32.

Masking: a row at position p sees keys in (p - window, p] that lie in the program's key
range and whose block-table id is in [0, num_blocks); scores of the others are -1e30 and
their probabilities 0. Rows past the query block's last token see nothing.

Outputs: each program writes its tile's f32 output and log-sum-exp into a per-item
buffer (no two programs share a row, and TMA boxes need static sizes); XLA merges the
splits by log-sum-exp and scatters each item's rows to its flat rows. Rows covered by
no item -- padding rows past query_start_loc[-1] and, with a plan's ``skip_decode``, the
decode rows the step's decode kernel fills -- are 0.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import plan as plans
from pallas_kernels._attention_kernel import combine_rows, default_num_splits
from pallas_kernels.mosaic_compat import raise_on_races
from pallas_kernels.mosaic_decode import (
    Q_TILE_ROWS,
    attend_pages,
    check_shapes,
    default_tiling,
    interpret_params,
    plgpu_module,
    swizzled_smem,
)
from pallas_kernels.names import cdiv
from pallas_kernels.quantization import is_fp8, kv_scales_array
from pallas_kernels.validation import check_attention_values, validate_attention_inputs

RAGGED_KERNEL_NAME = "ragged_paged_attention_mosaic"


def _kernel(
    items_ref,  # i32[num_items, 4] (plan.py)
    qsl_ref,  # i32[num_seqs + 1]
    seq_lens_ref,  # i32[num_seqs]
    bt_ref,  # i32[num_seqs, max_blocks_per_seq]
    scales_ref,  # f32[2]: k_scale, v_scale
    q_ref,  # f[num_items * num_kv_heads * num_subtiles, 64, head_dim]: the tiles' q rows
    k_ref,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_ref,
    o_ref,  # f32[num_splits * num_items * num_kv_heads * num_subtiles, 64, head_dim]
    lse_ref,  # f32[num_splits * num_items * num_kv_heads * num_subtiles, 64]
    q_smem,  # f[64, head_dim]
    k_smem,  # f_cache[num_stages, block_k, head_dim]
    v_smem,
    kc_smem,  # f[block_k, head_dim] (fp8 caches: the widened tile) or None
    vc_smem,
    p_smem,  # f[64, block_k]
    o_smem,  # f32[64, head_dim]
    lse_smem,  # f32[64]
    q_bar,
    k_bar,  # [num_stages], pages_per_step arrivals each
    v_bar,
    *,
    plgpu,
    group: int,
    block_q: int,
    num_subtiles: int,
    pages_per_step: int,
    num_stages: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    g = jax.lax.axis_index("item")
    h = jax.lax.axis_index("kv_head")
    part = jax.lax.axis_index("part")
    num_items = jax.lax.axis_size("item")
    num_kv_heads = jax.lax.axis_size("kv_head")
    num_splits = jax.lax.axis_size("part") // num_subtiles
    sub = part // num_splits
    split = jax.lax.rem(part, num_splits)
    num_seqs = bt_ref.shape[0]
    block_k = pages_per_step * k_ref.shape[2]
    rows = Q_TILE_ROWS

    seq_raw = items_ref[g, plans.ITEM_SEQ]
    in_use = seq_raw < num_seqs
    seq = jnp.minimum(seq_raw, num_seqs - 1)
    row0 = jnp.where(in_use, items_ref[g, plans.ITEM_ROW], 0)
    q_start = qsl_ref[seq]
    q_end = qsl_ref[seq + 1]
    ctx = seq_lens_ref[seq]
    pos0 = ctx - (q_end - q_start) + (row0 - q_start)  # position of the block's token 0
    num_tok = jnp.where(in_use, jnp.clip(q_end - row0, 0, block_q), 0)  # real tokens
    # Tokens of this tile: [t_lo, t_hi) of the query block.
    t_lo = (sub * rows) // group
    t_hi = jnp.minimum((sub * rows + rows - 1) // group + 1, num_tok)
    k_hi = jnp.where(t_hi > t_lo, jnp.minimum(pos0 + t_hi, ctx), 0)
    k_hi = jnp.minimum(k_hi, items_ref[g, plans.ITEM_HI])
    k_lo = jnp.int32(0) if sliding_window is None else pos0 + t_lo - sliding_window + 1
    k_lo = jnp.maximum(jnp.maximum(k_lo, 0), items_ref[g, plans.ITEM_LO])
    cb_lo = k_lo // block_k
    num_cb = jnp.maximum((k_hi + block_k - 1) // block_k - cb_lo, 0)
    per_split = (num_cb + num_splits - 1) // num_splits
    my_lo = cb_lo + jnp.minimum(split * per_split, num_cb)
    n_steps = cb_lo + jnp.minimum((split + 1) * per_split, num_cb) - my_lo

    tile = (g * num_kv_heads + h) * num_subtiles + sub
    # Token of each tile row within the query block, its position, whether it is real.
    key_shape = (rows, block_k)
    tok_of_row = (sub * rows + jax.lax.broadcasted_iota(jnp.int32, key_shape, 0)) // group
    row_pos = pos0 + tok_of_row
    row_ok = (tok_of_row < num_tok).astype(jnp.int32)

    def row_visible(tok):  # causal (and windowed) per row; rows past the block see nothing
        visible = (tok <= row_pos) & (row_ok > 0)
        if sliding_window is not None:
            visible &= tok > row_pos - sliding_window
        return visible

    out = split * num_items * num_kv_heads * num_subtiles + tile
    attend_pages(
        plgpu,
        (q_ref.at[tile], k_ref, v_ref, bt_ref, scales_ref),
        (q_smem, k_smem, v_smem, kc_smem, vc_smem, p_smem, o_smem, lse_smem, q_bar, k_bar, v_bar),
        seq=seq,
        head=h,
        k_lo=k_lo,
        k_hi=k_hi,
        my_lo=my_lo,
        n_steps=n_steps,
        pages_per_step=pages_per_step,
        num_stages=num_stages,
        scale=scale,
        soft_cap=soft_cap,
        outputs=((o_smem, o_ref.at[out]), (lse_smem, lse_ref.at[out])),
        row_visible=row_visible,
    )


def mosaic_ragged_call(
    q_tiles,  # f[num_items * num_kv_heads * num_subtiles, 64, head_dim]
    k_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_cache,
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq_lens,  # i32[num_seqs]
    query_start_loc,  # i32[num_seqs + 1]
    items,  # i32[num_items, 4]
    kv_scales,  # f32[2]
    *,
    group: int,
    block_q: int,
    pages_per_step: int,
    num_stages: int,
    num_splits: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    interpret: Any,
):  # -> (f32[num_splits, num_items, kv, subtiles * 64, d], f32[num_splits, num_items, kv, subtiles * 64])
    """The ``plgpu.kernel`` call: grid, SMEM scratch (q tile, K/V ring, P, output), barriers."""
    plgpu = plgpu_module()
    params = interpret_params(interpret)
    num_items = items.shape[0]
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    dtype = q_tiles.dtype
    block_k = pages_per_step * block_size
    rows = Q_TILE_ROWS
    num_subtiles = cdiv(block_q * group, rows)
    fp8 = is_fp8(k_cache.dtype)
    scratch = [
        swizzled_smem(plgpu, rows, head_dim, dtype),
        swizzled_smem(plgpu, block_k, head_dim, k_cache.dtype, num=num_stages),
        swizzled_smem(plgpu, block_k, head_dim, v_cache.dtype, num=num_stages),
        swizzled_smem(plgpu, block_k, head_dim, dtype) if fp8 else None,
        swizzled_smem(plgpu, block_k, head_dim, dtype) if fp8 else None,
        swizzled_smem(plgpu, rows, block_k, dtype),
        plgpu.SMEM((rows, head_dim), jnp.float32),
        plgpu.SMEM((rows,), jnp.float32),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=num_stages),
    ]
    body = functools.partial(
        _kernel,
        plgpu=plgpu,
        group=group,
        block_q=block_q,
        num_subtiles=num_subtiles,
        pages_per_step=pages_per_step,
        num_stages=num_stages,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    num_tiles = num_splits * num_items * num_kv_heads * num_subtiles
    out_type = (
        jax.ShapeDtypeStruct((num_tiles, rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((num_tiles, rows), jnp.float32),
    )
    call = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_items, num_kv_heads, num_subtiles * num_splits),
        grid_names=("item", "kv_head", "part"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=params,
        kernel_name=RAGGED_KERNEL_NAME,
    )
    o, lse = raise_on_races(
        call(items, query_start_loc, seq_lens, block_tables, kv_scales, q_tiles, k_cache, v_cache),
        params,
        RAGGED_KERNEL_NAME,
    )
    shape = (num_splits, num_items, num_kv_heads, num_subtiles * rows)
    return o.reshape(shape + (head_dim,)), lse.reshape(shape)


def default_block_q(group: int) -> int:
    """Query tokens per block when no plan gives them: one 64-row tile (at least 1)."""
    return max(1, Q_TILE_ROWS // group)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "sliding_window",
        "soft_cap",
        "block_q",
        "num_splits",
        "pages_per_step",
        "num_stages",
        "interpret",
        "validate",
    ),
)
def ragged_paged_attention_mosaic(
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
    block_q: int | None = None,
    num_splits: int | None = None,
    pages_per_step: int | None = None,
    num_stages: int | None = None,
    interpret: Any = False,
    validate: bool = False,
    plan: plans.AttentionPlan | None = None,
):  # -> f[num_tokens, num_q_heads, head_dim]
    """Causal attention of every new token over its sequence's paged context, on Mosaic GPU.

    Same semantics and output as ``pallas_kernels.reference.ragged_paged_attention``:
    sequence i's new tokens are rows query_start_loc[i]:query_start_loc[i+1] at the last
    q_len_i positions of its seq_lens[i]-token context; rows past query_start_loc[-1] are 0.

    Args:
        q: bfloat16 or float16.
        k_cache, v_cache: q's dtype or fp8; block_size a multiple of 8, head_dim of 16.
        block_q: Query tokens per work item (any int >= 1); None: ``default_block_q``
            (one 64-row tile). A plan's ``ragged_block_q`` wins.
        num_splits: Splits of each tile's key range, merged by log-sum-exp; None: an
            even count from the static shapes (``default_num_splits``).
        pages_per_step, num_stages: As in ``paged_attention_mosaic``.
        interpret: False: compile for the GPU. True or a ``plgpu.InterpretGPUParams``
            (e.g. with detect_races=True): GPU interpret mode on CPU.
        validate: Check block ids, lengths and query_start_loc on device (checkify).
        plan: A step's precomputed query blocks (``step_attention``). When its
            ``skip_decode`` is set, rows of single-token sequences are 0 here (the step's
            decode kernel fills them).
        Others: As in ``paged_attention_mosaic``.

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
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    tiling = default_tiling(q.dtype, k_cache.dtype, block_size, head_dim)
    pages_per_step = tiling["pages_per_step"] if pages_per_step is None else pages_per_step
    num_stages = tiling["num_stages"] if num_stages is None else num_stages
    check_shapes(q, k_cache, pages_per_step, num_stages)
    if plan is not None:
        block_q = plan.ragged_block_q
        items = plan.ragged_items
    else:
        block_q = default_block_q(group) if block_q is None else block_q
        if not isinstance(block_q, int) or block_q < 1:
            raise ValueError(f"block_q={block_q!r} must be an int >= 1")
        items = plans.ragged_items(query_start_loc, num_tokens, block_q)
    rows = Q_TILE_ROWS
    num_subtiles = cdiv(block_q * group, rows)
    block_k = pages_per_step * block_size
    if num_splits is None:
        num_programs = items.shape[0] * num_kv_heads * num_subtiles
        num_splits = default_num_splits(num_programs, block_tables.shape[1] * block_size, block_k)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be None or an int >= 1")
    qsl = query_start_loc.astype(jnp.int32)
    num_items = items.shape[0]
    num_seqs = block_tables.shape[0]
    # The flat row of each item's token t (num_tokens where the item has no such token).
    seq = items[:, plans.ITEM_SEQ]
    end = jnp.where(seq < num_seqs, qsl[jnp.minimum(seq + 1, num_seqs)], 0)
    token_row = items[:, plans.ITEM_ROW][:, None] + jnp.arange(block_q, dtype=jnp.int32)[None]
    token_row = jnp.where(token_row < end[:, None], token_row, num_tokens).reshape(-1)
    # q tiles, gathered in XLA: each item's rows of each KV head, token-major, zero-padded
    # to whole 64-row tiles, so each tile is one aligned TMA box. (A box at the item's
    # own flat row would start at row0 * group, which Mosaic's tiled SMEM copies need to
    # be a multiple of 8.)
    q_tiles = q.at[token_row].get(mode="fill", fill_value=0)
    q_tiles = q_tiles.reshape(num_items, block_q, num_kv_heads, group, head_dim)
    q_tiles = q_tiles.transpose(0, 2, 1, 3, 4).reshape(num_items, num_kv_heads, -1, head_dim)
    pad = num_subtiles * rows - block_q * group
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, pad), (0, 0)))
    q_tiles = q_tiles.reshape(num_items * num_kv_heads * num_subtiles, rows, head_dim)
    o, lse = mosaic_ragged_call(
        q_tiles,
        k_cache,
        v_cache,
        block_tables.astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        qsl,
        items,
        kv_scales_array(k_scale, v_scale),
        group=group,
        block_q=block_q,
        pages_per_step=pages_per_step,
        num_stages=num_stages,
        num_splits=num_splits,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpret=interpret,
    )
    real = block_q * group
    o = combine_rows(o[..., :real, :], lse[..., :real])  # f32[num_items, kv, real, d]
    o = o.reshape(num_items, num_kv_heads, block_q, group, head_dim).transpose(0, 2, 1, 3, 4)
    o = o.reshape(num_items * block_q, num_q_heads, head_dim)
    # Each item's rows go to their flat rows; rows past its sequence's end are dropped.
    out = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
    return out.at[token_row].set(o, mode="drop").astype(q.dtype)
