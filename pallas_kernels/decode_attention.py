"""Decode paged attention: one query token per sequence, flash-decoding over a work list.

Each program takes the q heads of one KV head of one sequence (padded to >= 16 rows so
the scores are one tensor-core dot) and one *key chunk* of that sequence: by default the
chunks come from a work list cut per call from the real lengths (pallas_kernels/plan.py),
so one long sequence among short ones is spread over several programs while the short
ones keep one each; partial outputs are merged per sequence by log-sum-exp in XLA. An
explicit ``num_splits`` instead cuts every sequence into that many even splits. The query
sits at position seq_len - 1; rows with seq_len 0 return zeros. Kernel body:
``_attention_kernel.py``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from pallas_kernels import plan as plans
from pallas_kernels._attention_kernel import (
    check_tiling,
    combine_items,
    combine_rows,
    default_num_warps,
    paged_flash_attention,
    q_heads_per_tile,
)
from pallas_kernels.quantization import kv_scales_array
from pallas_kernels.tuning import current_device_kind, tuned_config
from pallas_kernels.validation import (
    array_shape,
    check_attention_values,
    check_offsets_fit,
    validate_attention_inputs,
)

# Shared memory one program aims to stay under, so two programs fit an H200 SM
# (232,448 B per block opt-in, 233,472 B per SM): num_stages K/V tiles in flight.
_SMEM_PER_PROGRAM = 110_000


def decode_defaults(
    dtype, head_dim: int, group: int, block_size: int
) -> dict[str, int]:  # -> block_k, num_stages, num_warps
    """The decode kernel's tiling for a cache dtype and head shape.

    A tuned entry for this GPU (pallas_kernels/tuning.py) wins. Otherwise: block_k 64
    (32 at head_dim >= 256, and for f32), and as many pipeline stages (2-4) as keep
    stages x (K + V tile) under ~110 KB, so two programs share an SM while num_stages - 1
    tiles are in flight; warps by ``default_num_warps`` (8 for f32). Reasoned for the H200 from
    deviceless compiles (scripts/gpu_compile_check.py), not yet measured.
    """
    tuned = tuned_config(
        "paged_decode_attention",
        device_kind=current_device_kind(),
        dtype=dtype,
        head_dim=head_dim,
        group=group,
        block_size=block_size,
    )
    itemsize = jnp.dtype(dtype).itemsize
    tile_d = 1 << max(head_dim - 1, 1).bit_length()
    block_k = 32 if tile_d >= 256 or itemsize >= 4 else 64
    stage_bytes = 2 * block_k * tile_d * itemsize
    num_stages = max(2, min(4, _SMEM_PER_PROGRAM // stage_bytes))
    heads = q_heads_per_tile(group, 1)
    # f32 tiles: 8 warps, or the scores and accumulator spill past 255 registers.
    num_warps = 8 if itemsize >= 4 else default_num_warps(heads, block_k, tile_d)
    config = dict(block_k=block_k, num_stages=num_stages, num_warps=num_warps)
    if tuned:
        config.update({k: tuned[k] for k in config if k in tuned})
    return config


def decode_rows(
    q,  # f[num_rows, num_q_heads, head_dim]
    k_cache,
    v_cache,
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq_lens,  # i32[num_seqs]
    items,  # i32[num_items, 4] decode work list (plan.decode_items) or per-sequence items
    query_start_loc,  # i32[num_seqs + 1]
    kv_scales,  # f32[2]
    *,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    block_k: int,
    num_splits: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    work_list: bool,
):  # -> f32 or q-dtype [num_seqs, num_kv_heads, group, head_dim]
    """The decode kernel over per-sequence q rows at query_start_loc[s]; one row per
    sequence in its output (f32 when merged, q's dtype for one split of per-sequence items)."""
    num_seqs = block_tables.shape[0]
    num_q_heads = q.shape[1]
    num_kv_heads = k_cache.shape[1]
    heads = q_heads_per_tile(num_q_heads // num_kv_heads, 1)
    kw = dict(
        block_q=1,
        block_k=block_k,
        heads=heads,
        num_warps=num_warps,
        num_stages=num_stages,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpret=interpret,
        name="paged_decode_attention",
    )
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, items, kv_scales)
    if work_list:
        o, lse = paged_flash_attention(*args, num_splits=num_splits, out_mode="items", **kw)
        return combine_items(o, lse, items[:, plans.ITEM_SEQ], num_seqs)
    # Per-sequence items (item s = sequence s) with their rows at query_start_loc[s].
    if num_splits == 1 and q.shape[0] == num_seqs:
        return paged_flash_attention(*args, num_splits=1, out_mode="direct", **kw)
    o, lse = paged_flash_attention(*args, num_splits=num_splits, out_mode="rows", **kw)
    merged = combine_rows(o, lse)
    return merged[query_start_loc[:-1].clip(0, q.shape[0] - 1)]


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
    q,  # f[num_seqs, num_q_heads, head_dim], or f[num_tokens, ...] rows given by `plan`
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
    plan: plans.AttentionPlan | None = None,
):  # -> f[num_seqs, num_q_heads, head_dim]
    """Attention of each sequence's newest token over its paged context.

    Args:
        q: One query token per sequence, at position seq_len - 1 (row i = sequence i);
            with `plan`, the step's flat rows, sequence s's token at
            plan.query_start_loc[s] (sequences whose query range is not one row get 0).
        k_cache, v_cache: The paged caches (see layout.py).
        block_tables: Each sequence's block ids in token order, padded with 0. An id
            outside [0, num_blocks) is never followed: its keys are invisible.
        seq_lens: Context length of each sequence, including the query token.
        scale: Softmax scale applied to q.k.
        sliding_window: Keys at positions > p - sliding_window are seen (HF convention).
        soft_cap: Scores become soft_cap * tanh(score / soft_cap).
        k_scale, v_scale: Dequantization scales of an fp8 cache (runtime values).
        block_k: Keys per online-softmax step (power of two >= 16; need not be a
            multiple of block_size). None: ``decode_defaults``.
        num_splits: None: a work list of equal key chunks cut from the real lengths
            (balanced across mixed lengths, pallas_kernels/plan.py). An int: every
            sequence split evenly into that many parts (1: no merge at all).
        num_warps, num_stages: Triton compiler params; None: ``decode_defaults`` (stages
            sized so num_stages - 1 K/V tiles are in flight within ~110 KB of shared
            memory). Reasoned for the H200, not yet measured (docs/kernels.md).
        interpret: Run the Pallas interpreter (CPU tests).
        validate: Check block ids and lengths against the pool on device (debug;
            needs checkify, see ``pallas_kernels.checked``).
        plan: A step's precomputed work list (``step_attention``); its decode chunks
            are used as they are.

    Returns:
        The attention output, in q's dtype, one row per sequence.
    """
    num_seqs = array_shape("block_tables", block_tables)[0]
    qsl = jnp.arange(num_seqs + 1, dtype=jnp.int32) if plan is None else plan.query_start_loc
    validate_attention_inputs(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        None if plan is None else qsl,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    check_offsets_fit("k_cache", k_cache)
    check_offsets_fit("v_cache", v_cache)
    if validate:
        if plan is None:
            check_attention_values(k_cache, block_tables, seq_lens)
        else:
            check_attention_values(k_cache, block_tables, seq_lens, qsl, q.shape[0])
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    _, num_kv_heads, block_size, _ = k_cache.shape
    defaults = decode_defaults(k_cache.dtype, head_dim, num_q_heads // num_kv_heads, block_size)
    if plan is not None:
        block_k = plan.decode_block_k
    block_k = defaults["block_k"] if block_k is None else block_k
    num_stages = defaults["num_stages"] if num_stages is None else num_stages
    check_tiling(head_dim, block_k=block_k)
    block_k = max(block_k, 16)
    if num_warps is None:
        num_warps = defaults["num_warps"]
    work_list = num_splits is None
    if plan is not None:
        items = plan.decode_items
        work_list = True
    elif work_list:
        items = plans.decode_items(
            seq_lens,
            qsl,
            block_k=block_k,
            num_items=plans.num_decode_items(num_seqs, num_kv_heads),
            sliding_window=sliding_window,
        )
    else:
        seq_ids = jnp.arange(num_seqs, dtype=jnp.int32)
        zeros = jnp.zeros_like(seq_ids)
        items = jnp.stack(
            [seq_ids, seq_ids, zeros, jnp.full_like(seq_ids, plans.NO_KEY_LIMIT)], axis=1
        )
    out = decode_rows(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        items,
        qsl,
        kv_scales_array(k_scale, v_scale),
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        block_k=block_k,
        num_splits=1 if work_list else num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        work_list=work_list,
    )
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)
