"""Ragged paged attention: a flat batch of prefill chunks and decode tokens in one call.

The flat query rows are cut into *query blocks* of block_q tokens that never straddle two
sequences (sequence i contributes cdiv(q_len_i, block_q) blocks). Their number is at most
cdiv(num_tokens, block_q) + num_seqs, a static bound, so the grid is
``(cdiv(num_tokens, block_q) + num_seqs, num_kv_heads, num_splits)``; blocks past the
real ones do no work but zero the padding rows. The block table of work items
(pallas_kernels/plan.py) is computed in XLA from query_start_loc, once per engine step
when ``step_attention`` passes its plan. The kernel (``_attention_kernel.py``) masks
causally inside each chunk over the cached prefix and the new tokens alike.

    flat rows:   | seq0 (prefill, 37) | seq1 (chunk, 20) |s2|s3| padding ... |
    q blocks:    [16][16][ 5]          [16][ 4]           [1][1]  [pad rows]

In an engine step (``step_attention`` with a plan), the single-token sequences s2, s3
get no query block here: the decode kernel takes them with one token's rows per tile.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import plan as plans
from pallas_kernels._attention_kernel import (
    check_tiling,
    combine_rows,
    default_num_splits,
    default_num_warps,
    paged_flash_attention,
    q_heads_per_tile,
)
from pallas_kernels.quantization import kv_scales_array
from pallas_kernels.tuning import current_device_kind, tuned_config
from pallas_kernels.validation import (
    check_attention_values,
    check_offsets_fit,
    validate_attention_inputs,
)


def ragged_defaults(dtype, head_dim: int, group: int, block_size: int) -> dict[str, int]:
    """block_q, block_k, num_stages (and num_warps if tuned) of the ragged kernel.

    A tuned entry for this GPU (pallas_kernels/tuning.py) wins. Otherwise block_k 32 with
    3 stages (two K/V tiles in flight; f32: block_k 16), and block_q 16 lowered until the
    q tile (block_q x next_pow2(group) rows x head_dim) holds at most 8,192 elements
    (2,048 for f32), where the deviceless H200 compiles stay under 255 registers without
    spilling at the warps ``default_num_warps`` gives (f32: 8 warps; fp8 at head_dim
    256: 16-row q tiles, block_k 16, 8 warps) (scripts/gpu_compile_check.py).
    """
    tuned = tuned_config(
        "ragged_paged_attention",
        device_kind=current_device_kind(),
        dtype=dtype,
        head_dim=head_dim,
        group=group,
        block_size=block_size,
    )
    wide = jnp.dtype(dtype).itemsize >= 4
    tile_d = pl.next_power_of_2(head_dim)
    cap = (2_048 if wide else 8_192) // (pl.next_power_of_2(group) * tile_d)
    block_q = 16
    while block_q > 1 and block_q > cap:
        block_q //= 2
    config = dict(block_q=block_q, block_k=16 if wide else 32, num_stages=3)
    if wide:  # f32 scores, tiles and accumulator: 8 warps, or they spill
        # (at head_dim 256 also a single K/V stage: the ptxas path spills 4 B with two)
        config.update(num_warps=8, num_stages=2 if tile_d >= 256 else 3)
    if jnp.dtype(dtype).itemsize == 1 and tile_d >= 256:
        # fp8 tiles are widened to q's dtype in registers: at head_dim 256 that spills
        # unless the K/V tile is small, the q tile at most 16 rows and 8 warps share it.
        block_q = max(1, min(block_q, 16 // pl.next_power_of_2(group)))
        config.update(block_q=block_q, block_k=16, num_warps=8)
    if tuned:
        keys = ("block_q", "block_k", "num_stages", "num_warps")
        config.update({k: tuned[k] for k in keys if k in tuned})
    return config


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
    block_q: int | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    validate: bool = False,
    plan: plans.AttentionPlan | None = None,
):  # -> f[num_tokens, num_q_heads, head_dim]
    """Causal attention of every new token over its sequence's paged context.

    Sequence i's new tokens are rows query_start_loc[i]:query_start_loc[i+1] and sit at
    the last q_len_i positions of its seq_lens[i]-token context (their K/V are already
    written). Rows past query_start_loc[-1] are padding and return zeros.

    Args:
        block_q: Query tokens per program (power of two); rows per dot are
            block_q * next_pow2(heads per KV head), raised to at least 16. None:
            ``ragged_defaults`` (16 untuned).
        block_k, num_splits, num_warps, num_stages, interpret, validate: As in
            ``paged_attention`` (validate also checks query_start_loc); num_splits None
            picks an even split count from the static shapes.
        plan: A step's precomputed query blocks (``step_attention``). When its
            ``skip_decode`` is set, rows of single-token sequences are left unwritten
            (the step's decode kernel fills them).
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
    check_offsets_fit("k_cache", k_cache)
    check_offsets_fit("v_cache", v_cache)
    if validate:
        check_attention_values(k_cache, block_tables, seq_lens, query_start_loc, q.shape[0])
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    defaults = ragged_defaults(k_cache.dtype, head_dim, group, block_size)
    if plan is not None:
        block_q = plan.ragged_block_q
    block_q = defaults["block_q"] if block_q is None else block_q
    block_k = defaults["block_k"] if block_k is None else block_k
    num_stages = defaults["num_stages"] if num_stages is None else num_stages
    num_warps = defaults.get("num_warps") if num_warps is None else num_warps
    check_tiling(head_dim, block_q=block_q, block_k=block_k)
    block_k = max(block_k, 16)
    block_q = ragged_block_q(group, block_q)
    heads = q_heads_per_tile(group, block_q)
    tile_d = 1 << (head_dim - 1).bit_length()
    if num_warps is None:
        num_warps = default_num_warps(block_q * heads, block_k, tile_d)
    if plan is None:
        items = plans.ragged_items(query_start_loc, num_tokens, block_q)
    else:
        items = plan.ragged_items
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = default_num_splits(items.shape[0] * num_kv_heads, max_context, block_k)
    kw = dict(
        block_q=block_q,
        block_k=block_k,
        heads=heads,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpret=interpret,
        name="ragged_paged_attention",
    )
    args = (
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        items,
        kv_scales_array(k_scale, v_scale),
    )
    if num_splits == 1:  # unused items zero the padding rows: nothing to do after
        out = paged_flash_attention(*args, out_mode="direct", **kw)
        return out.reshape(q.shape)
    o, lse = paged_flash_attention(*args, out_mode="rows", **kw)
    return combine_rows(o, lse).reshape(q.shape).astype(q.dtype)


def ragged_block_q(group: int, block_q: int) -> int:
    """block_q raised so the q tile (block_q x next_pow2(group) rows) has >= 16 rows."""
    return max(block_q, 16 // pl.next_power_of_2(group))
