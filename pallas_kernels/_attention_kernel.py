"""The paged flash-attention kernel shared by decode and ragged attention, and its combine.

One program handles one *query block* (block_q consecutive query tokens of one sequence)
for one KV head and one split of that block's key range:

    grid = (num_query_blocks, num_kv_heads, num_splits)

    rows of the program's q tile (M = block_q * heads_per_kv, all q heads of one KV head):
        token 0: head 0 .. head g-1 | token 1: head 0 .. g-1 | ...
    key range of the query block, cut into block_k-token compute blocks and split evenly:
        [k_lo ............................................. k_hi)
        |  split 0   |  split 1   |  split 2   |  split 3   |

Each compute block gathers block_k tokens through the block table (page id per token,
so block_k need not be a multiple of block_size) and runs one online-softmax step. The
program writes its normalised partial output and log-sum-exp; ``combine_splits`` merges
the splits in XLA (flash-decoding). Masking: a key is visible to a query at position p iff
p - window < key <= p (and key < seq_len); invisible scores become a finite -1e30 and
their probabilities exactly 0, and K/V are *masked loads* outside [k_lo, k_hi)
intersected with [0, seq_len) (read as 0, never dereferenced on a GPU), so NaN/inf in
the null block or unused slots can never reach the output, and block-table entries past
a sequence's length are never followed.

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

from pallas_kernels.quantization import is_fp8

NEG = -1e30  # finite "minus infinity": exp(NEG - NEG) = 1 stays finite, unlike inf - inf
# Full f32 precision for f32 dots (IEEE, not TF32); bf16/f16 dots are unaffected.
DOT_PRECISION = jax.lax.Precision.HIGHEST
# Smallest key range one split-K program gets: below this, the partial output's write and
# the combine cost more than the extra parallelism buys (H200 reasoning in docs/kernels.md).
MIN_SPLIT_TOKENS = 512


def _kernel(
    block_seq_ref,  # i32[num_query_blocks]: sequence of each query block (num_seqs = unused)
    block_row_ref,  # i32[num_query_blocks]: first flat query row of each query block
    qsl_ref,  # i32[num_seqs + 1]
    seq_lens_ref,  # i32[num_seqs]
    bt_ref,  # i32[num_seqs, max_blocks_per_seq]
    q_ref,  # f[rows, heads_per_kv, head_dim] (this KV head)
    k_ref,  # f[num_blocks, block_size, head_dim] (this KV head)
    v_ref,  # f[num_blocks, block_size, head_dim] (this KV head)
    scales_ref,  # f32[2]: k_scale, v_scale (fp8 caches: dequantized on read)
    o_ref,  # f[rows, heads_per_kv, head_dim] (this KV head, this split)
    lse_ref,  # f32[rows, heads_per_kv] (this KV head, this split)
    *,
    block_q: int,
    block_k: int,
    block_size: int,
    num_seqs: int,
    max_blocks_per_seq: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    g = pl.program_id(0)
    split = pl.program_id(2)
    num_splits = pl.num_programs(2)
    heads = q_ref.shape[1]
    head_dim = q_ref.shape[2]
    m_rows = block_q * heads

    seq_raw = block_seq_ref[g]
    in_use = seq_raw < num_seqs
    seq = jnp.minimum(seq_raw, num_seqs - 1)
    q_start = qsl_ref[seq]
    q_end = jnp.where(in_use, qsl_ref[seq + 1], q_start)
    row0 = block_row_ref[g]
    ctx = seq_lens_ref[seq]
    first_pos = ctx - (q_end - q_start)  # position of row q_start

    # Positions of the valid rows of this block: [p_lo, p_hi].
    p_lo = first_pos + (row0 - q_start)
    p_hi = first_pos + (jnp.minimum(row0 + block_q, q_end) - 1 - q_start)
    k_hi = jnp.where(in_use, jnp.minimum(p_hi + 1, ctx), 0)  # unused blocks do no work
    k_lo = jnp.zeros_like(k_hi) if sliding_window is None else p_lo - sliding_window + 1
    k_lo = jnp.maximum(k_lo, 0)
    cb_lo = k_lo // block_k
    num_cb = jnp.maximum(pl.cdiv(k_hi, block_k) - cb_lo, 0)
    per_split = pl.cdiv(num_cb, num_splits)
    my_lo = cb_lo + jnp.minimum(split * per_split, num_cb)
    my_hi = cb_lo + jnp.minimum((split + 1) * per_split, num_cb)

    q = q_ref[pl.ds(row0, block_q), :, :].reshape(m_rows, q_ref.shape[2])
    fp8 = is_fp8(k_ref.dtype)  # fp8 tiles are cast to q's dtype (exact), scales applied after
    # Position of each of the M rows (row r is token r // heads of the block).
    row_pos = p_lo + jax.lax.broadcasted_iota(jnp.int32, (m_rows,), 0) // heads

    def step(cb, carry):
        m, denom, acc = carry
        tok = cb * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        page_col = jnp.minimum(tok // block_size, max_blocks_per_seq - 1)
        pages = bt_ref[seq, page_col]  # i32[block_k]: page of each token
        offs = tok % block_size
        key_ok = (tok >= k_lo) & (tok < k_hi)
        kv_mask = jnp.broadcast_to(key_ok[:, None], (block_k, head_dim))
        # Masked loads: keys outside the range read as 0 and are never fetched, so a
        # garbage id past seq_len is never followed and NaN in unused slots stays out
        # (p = 0 times a NaN V would still be NaN; a loaded 0 is not).
        # All-array indices (no slices), which the interpreter can discharge too.
        tile = (block_k, head_dim)
        idx = (
            jnp.broadcast_to(pages[:, None], tile),
            jnp.broadcast_to(offs[:, None], tile),
            jax.lax.broadcasted_iota(jnp.int32, tile, 1),
        )
        # Triton cannot cast an int fill to fp8; a float one it can (sm89+).
        other = 0.0 if fp8 else 0
        k = plgpu.load(k_ref.at[idx], mask=kv_mask, other=other)  # f[block_k, head_dim]
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
        return m_new, denom, acc * alpha[:, None] + pv

    init = (
        jnp.full((m_rows,), NEG, jnp.float32),
        jnp.zeros((m_rows,), jnp.float32),
        jnp.zeros((m_rows, q_ref.shape[2]), jnp.float32),
    )
    m, denom, acc = jax.lax.fori_loop(my_lo, my_hi, step, init)
    has = denom > 0
    o = acc / jnp.where(has, denom, 1.0)[:, None]
    if fp8:
        o = o * scales_ref[1]
    lse = jnp.where(has, m + jnp.log(jnp.where(has, denom, 1.0)), NEG)

    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    row_ok = (rows >= q_start) & (rows < q_end)
    o_mask = jnp.broadcast_to(row_ok[:, None, None], (block_q, heads, o_ref.shape[2]))
    plgpu.store(
        o_ref.at[pl.ds(row0, block_q), :, :],
        o.reshape(block_q, heads, o_ref.shape[2]).astype(o_ref.dtype),
        mask=o_mask,
    )
    lse_mask = jnp.broadcast_to(row_ok[:, None], (block_q, heads))
    plgpu.store(lse_ref.at[pl.ds(row0, block_q), :], lse.reshape(block_q, heads), mask=lse_mask)


def paged_flash_attention(
    q,  # f[rows, num_kv_heads, heads_per_kv, head_dim]; rows >= used rows + block_q
    k_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq_lens,  # i32[num_seqs]
    query_start_loc,  # i32[num_seqs + 1]
    block_seq,  # i32[num_query_blocks]
    block_row,  # i32[num_query_blocks]
    kv_scales,  # f32[2]: k_scale, v_scale (read by fp8 caches only)
    *,
    block_q: int,
    block_k: int,
    num_splits: int,
    num_warps: int,
    num_stages: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    interpret: bool,
    name: str,
):  # -> (f[num_splits, rows, kv, heads, d] partial outputs, f32[num_splits, rows, kv, heads] lse)
    """The pallas_call: grid, BlockSpecs and compiler params around ``_kernel``."""
    rows, num_kv_heads, heads, head_dim = q.shape
    num_blocks, _, block_size, _ = k_cache.shape
    num_seqs, max_blocks_per_seq = block_tables.shape
    num_query_blocks = block_seq.shape[0]
    out_dtype = q.dtype if num_splits == 1 else jnp.float32

    def whole(x):
        zeros = (0,) * x.ndim
        return pl.BlockSpec(x.shape, lambda g, h, s: zeros)

    kernel = functools.partial(
        _kernel,
        block_q=block_q,
        block_k=block_k,
        block_size=block_size,
        num_seqs=num_seqs,
        max_blocks_per_seq=max_blocks_per_seq,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    kv_spec = pl.BlockSpec(
        (num_blocks, pl.squeezed, block_size, head_dim), lambda g, h, s: (0, h, 0, 0)
    )
    return pl.pallas_call(
        kernel,
        grid=(num_query_blocks, num_kv_heads, num_splits),
        in_specs=[
            whole(block_seq),
            whole(block_row),
            whole(query_start_loc),
            whole(seq_lens),
            whole(block_tables),
            pl.BlockSpec((rows, pl.squeezed, heads, head_dim), lambda g, h, s: (0, h, 0, 0)),
            kv_spec,
            kv_spec,
            whole(kv_scales),
        ],
        out_specs=[
            pl.BlockSpec(
                (pl.squeezed, rows, pl.squeezed, heads, head_dim), lambda g, h, s: (s, 0, h, 0, 0)
            ),
            pl.BlockSpec((pl.squeezed, rows, pl.squeezed, heads), lambda g, h, s: (s, 0, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_splits, rows, num_kv_heads, heads, head_dim), out_dtype),
            jax.ShapeDtypeStruct((num_splits, rows, num_kv_heads, heads), jnp.float32),
        ],
        # Triton params select the Triton lowering (GPU Pallas defaults to Mosaic GPU).
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(block_seq, block_row, query_start_loc, seq_lens, block_tables, q, k_cache, v_cache, kv_scales)


def combine_splits(
    o,  # f[num_splits, rows, num_kv_heads, heads, head_dim]
    lse,  # f32[num_splits, rows, num_kv_heads, heads]
):  # -> f32[rows, num_kv_heads, heads, head_dim]
    """Merges split-K partial outputs by their log-sum-exp (exactly 0 where no split saw a key)."""
    if o.shape[0] == 1:
        return o[0].astype(jnp.float32)
    m = jnp.max(lse, axis=0)
    w = jnp.exp(lse - m[None])  # splits that saw nothing have lse = NEG: weight 0 or, if all
    w = jnp.where(lse > NEG / 2, w, 0.0)  # saw nothing, every weight is 0 and so is the sum
    total = jnp.sum(w, axis=0)
    out = jnp.einsum("srkh,srkhd->rkhd", w, o.astype(jnp.float32))
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def default_num_splits(num_programs: int, max_context: int, block_k: int) -> int:
    """Enough splits for ~2 programs per SM on a 132-SM GPU, but each split >= 512 keys
    (MIN_SPLIT_TOKENS) and >= one block_k, and at most 32."""
    target = 264
    per_split = max(MIN_SPLIT_TOKENS, block_k)
    return max(1, min(target // max(num_programs, 1), pl.cdiv(max_context, per_split), 32))


def default_num_warps(rows: int, block_k: int, head_dim: int) -> int:
    """Warps for one program: 8 when its q and K/V tiles are large, else 4.

    rows: query rows of the program's tile (query tokens x q heads per KV head);
    block_k: keys per step. A program holds a rows x head_dim accumulator and streams
    block_k x head_dim K/V tiles; past (rows + block_k) * head_dim = 24,576 elements
    (e.g. 128 rows at head_dim 128, or decode at head_dim 256) 4 warps exceed the
    255-register budget on sm_90 and spill, while 8 warps fit
    (scripts/gpu_compile_check.py).
    """
    return 8 if (rows + block_k) * head_dim >= 24_576 else 4


def check_tiling(head_dim: int, **knobs: int) -> None:
    """Triton loads need power-of-two extents; dots need at least 16 along each side."""
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim={head_dim} must be a power of two >= 16 for the Pallas kernels")
    for name, value in knobs.items():
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"{name}={value!r} must be a power-of-two int")


def group_queries(
    q,  # f[n, num_q_heads, head_dim]
    num_kv_heads: int,
    heads: int,
    rows: int,
):  # -> f[rows, num_kv_heads, heads, head_dim], zero-padded
    """Puts the q heads that share a KV head side by side, padded to `heads` and `rows`."""
    n, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    qg = q.reshape(n, num_kv_heads, group, head_dim)
    if heads == group and rows == n:
        return qg
    return jnp.pad(qg, ((0, rows - n), (0, 0), (0, heads - group), (0, 0)))


def ungroup_output(
    o,  # f32[rows, num_kv_heads, heads, head_dim]
    n: int,
    num_q_heads: int,
    dtype,
):  # -> f[n, num_q_heads, head_dim]
    rows, num_kv_heads, heads, head_dim = o.shape
    group = num_q_heads // num_kv_heads
    return o[:n, :, :group].reshape(n, num_q_heads, head_dim).astype(dtype)
