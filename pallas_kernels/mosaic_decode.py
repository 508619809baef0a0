"""Decode paged attention on Mosaic GPU (Hopper): TMA page copies, an SMEM ring, wgmma.

One program (one warpgroup) handles one work item (plan.py: a sequence and a key chunk),
one KV head and one split of the chunk's keys:

    grid = (num_items, num_kv_heads, num_splits)

    q tile   [64, head_dim] in SMEM: the `group` q heads of this KV head, zero rows below
             (wgmma's M is 64 per warpgroup; decode is bandwidth-bound, the padding rows
             cost tensor-core time only). Built once per call in XLA (tiny next to K/V).
    K/V ring [num_stages, block_k, head_dim] x 2 in SMEM; block_k = pages_per_step pages.
             Every page of a step is one TMA copy (cache[page, kv_head] -> its rows of
             the slot); a slot's K (and V) barrier expects pages_per_step arrivals.

    step i:  wait K[slot]; S = Q K^T (wgmma); mask, online softmax; P -> SMEM (bf16/f16);
             wait V[slot]; O += P V (wgmma); refill the slot with step i + num_stages.

So num_stages - 1 steps of pages are in flight while one is computed. Each program writes
an f32 partial output and its log-sum-exp; partials are merged per sequence by
``_attention_kernel.combine_items`` (flash-decoding), as in the Triton decode kernel.

Masking, as the Triton kernels: a key is visible iff it lies in the program's key range,
in the sliding window, and its block-table id is in [0, num_blocks). An id outside the
pool is never followed (block 0 is copied in its place and its keys are masked). Invisible
scores become -1e30 and their probabilities 0; in a step that holds an invisible key the V
rows of those keys are zeroed in SMEM before the PV product, so NaN/inf in the null block
or in unused slots of a sequence's last page never reaches the output (0 * NaN is NaN).

fp8 caches (e4m3fn / e5m2): pages are copied as fp8 and widened to q's dtype in SMEM
(exact) before the products; k_scale multiplies the scores, v_scale the output.

What GPU interpret mode (``plgpu.InterpretGPUParams``; jax 0.11.2 and 0.12.0.1, on CPU)
runs, as exercised by this kernel and its tests: ``plgpu.kernel`` with a multi-dimensional grid and
one warpgroup; TMA ``copy_gmem_to_smem`` of a dynamically indexed page (the id read as a
scalar from the block table in GMEM) into a row slice of a tiled + swizzled SMEM slot;
barriers with several arrivals per phase, reused across ring phases; ``wgmma`` from SMEM
operands (including a transposed view) into a ``plgpu.ACC`` accumulator; register <->
SMEM stores and loads, ``commit_smem``, TMA ``copy_smem_to_gmem`` and
``wait_smem_to_gmem``; ``lax.fori_loop`` with bounds read at run time; ``pl.when``; the
race detector (``detect_races=True``; on 0.11.2 raised through
``mosaic_compat.raise_on_races``) over all of it. It simulates wgmma synchronously
(``wgmma_wait`` is a no-op there) and does not run ``pl.run_state`` or the
warp-specialised pipeline emitters' effects, which this kernel does not use.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import plan as plans
from pallas_kernels._attention_kernel import NEG, combine_items
from pallas_kernels.mosaic_compat import raise_on_races
from pallas_kernels.names import cdiv, mosaic_jax_reason
from pallas_kernels.quantization import is_fp8, kv_scales_array
from pallas_kernels.validation import check_attention_values, validate_attention_inputs

DECODE_KERNEL_NAME = "paged_decode_attention_mosaic"
# Rows of the q tile: one warpgroup's wgmma M.
Q_TILE_ROWS = 64
# SMEM a program may allocate: an H200's per-block opt-in limit (232,448 B) less headroom
# for Mosaic's own barriers and alignment.
SMEM_BUDGET = 225_000
COMPUTE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Head dims whose tiles lower for an H200 (scripts/gpu_compile_check.py's mosaic cases).
SUPPORTED_HEAD_DIMS = (64, 128)


# GPU interpret mode runs the programs one after another on CPU: a step plan's decode
# work list, sized for an H200 (~264 programs), is re-cut to one item per sequence plus
# this many (same outputs, far fewer interpreted programs).
INTERPRET_SPARE_ITEMS = 4


def mosaic_unavailable_reason() -> str | None:
    """None when this jax runs the Mosaic GPU kernels, else a one-line reason."""
    return mosaic_jax_reason(jax.__version__)


def plgpu_module():
    """jax.experimental.pallas.mosaic_gpu, imported on use (older jax lacks parts of it)."""
    reason = mosaic_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    from jax.experimental.pallas import mosaic_gpu

    return mosaic_gpu


def interpret_params(interpret: Any):
    """``interpret`` as the kernel takes it: False -> None (compile for the GPU), True ->
    default GPU interpret mode, an ``InterpretGPUParams`` as given (e.g. detect_races)."""
    if interpret is False or interpret is None:
        return None
    if interpret is True:
        return plgpu_module().InterpretGPUParams()
    return interpret


def swizzled_smem(plgpu, rows: int, cols: int, dtype, num: int | None = None):
    """An SMEM tile in the tiled + swizzled layout wgmma reads (widest swizzle that fits)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(cols * itemsize * 8)
    transforms = (
        plgpu.TilingTransform((8, swizzle // itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )
    shape = (rows, cols) if num is None else (num, rows, cols)
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def widen(x, dtype):  # fp8 tile -> q's dtype, exact
    # Through f32: Hopper converts e4m3/e5m2 only to f16 directly (Mosaic GPU's lowering
    # rejects fp8 -> bf16); GPU interpret mode accepts either.
    return x.astype(jnp.float32).astype(dtype)


def _kernel(
    items_ref,  # i32[num_items, 4] (plan.py)
    seq_lens_ref,  # i32[num_seqs]
    bt_ref,  # i32[num_seqs, max_blocks_per_seq]
    scales_ref,  # f32[2]: k_scale, v_scale
    q_ref,  # f[num_seqs, num_kv_heads, Q_TILE_ROWS, head_dim]
    k_ref,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_ref,
    o_ref,  # f32[num_splits, num_items, num_kv_heads, out_rows, head_dim]
    lse_ref,  # f32[num_splits, num_items, num_kv_heads, out_rows]
    q_smem,  # f[Q_TILE_ROWS, head_dim]
    k_smem,  # f_cache[num_stages, block_k, head_dim]
    v_smem,
    kc_smem,  # f[block_k, head_dim] (fp8 caches: the widened tile) or None
    vc_smem,
    p_smem,  # f[Q_TILE_ROWS, block_k]
    o_smem,  # f32[Q_TILE_ROWS, head_dim]
    lse_smem,  # f32[Q_TILE_ROWS]
    q_bar,
    k_bar,  # [num_stages], pages_per_step arrivals each
    v_bar,
    *,
    plgpu,
    pages_per_step: int,
    num_stages: int,
    out_rows: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    g = jax.lax.axis_index("item")
    h = jax.lax.axis_index("kv_head")
    split = jax.lax.axis_index("split")
    num_splits = jax.lax.axis_size("split")
    num_seqs = bt_ref.shape[0]
    block_k = pages_per_step * k_ref.shape[2]

    seq_raw = items_ref[g, plans.ITEM_SEQ]
    in_use = seq_raw < num_seqs
    seq = jnp.minimum(seq_raw, num_seqs - 1)
    ctx = seq_lens_ref[seq]
    pos = ctx - 1  # the query token's position
    k_hi = jnp.where(in_use, jnp.minimum(ctx, items_ref[g, plans.ITEM_HI]), 0)
    k_lo = jnp.int32(0) if sliding_window is None else pos - sliding_window + 1
    k_lo = jnp.maximum(jnp.maximum(k_lo, 0), items_ref[g, plans.ITEM_LO])
    cb_lo = k_lo // block_k
    num_cb = jnp.maximum((k_hi + block_k - 1) // block_k - cb_lo, 0)
    per_split = (num_cb + num_splits - 1) // num_splits
    my_lo = cb_lo + jnp.minimum(split * per_split, num_cb)
    n_steps = cb_lo + jnp.minimum((split + 1) * per_split, num_cb) - my_lo

    attend_pages(
        plgpu,
        (q_ref.at[seq, h], k_ref, v_ref, bt_ref, scales_ref),
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
        outputs=(
            (o_smem.at[pl.ds(0, out_rows)], o_ref.at[split, g, h]),
            (lse_smem.at[pl.ds(0, out_rows)], lse_ref.at[split, g, h]),
        ),
    )


def attend_pages(
    plgpu,
    inputs,  # (q tile in GMEM, k_ref, v_ref, block tables, f32[2] kv scales)
    scratch,  # (q, k ring, v ring, widened k, widened v, p, o, lse SMEM; q, k, v barriers)
    *,
    seq,
    head,
    k_lo,
    k_hi,
    my_lo,
    n_steps,
    pages_per_step: int,
    num_stages: int,
    scale: float,
    soft_cap: float | None,
    outputs,  # ((o SMEM view, o GMEM ref), (lse SMEM view, lse GMEM ref))
    row_visible=None,  # (tok i32[rows, block_k]) -> bool, the rows' own mask (ragged)
) -> None:
    """The body both Mosaic kernels share: one 64-row q tile attends keys [k_lo, k_hi) of
    sequence `seq`, KV head `head`, compute blocks my_lo .. my_lo + n_steps; pages move by
    TMA through the SMEM ring, QK^T and PV on wgmma, online softmax in f32; the
    normalised output and log-sum-exp are copied to `outputs`."""
    q_src, k_ref, v_ref, bt_ref, scales_ref = inputs
    (q_smem, k_smem, v_smem, kc_smem, vc_smem, p_smem, o_smem, lse_smem) = scratch[:8]
    q_bar, k_bar, v_bar = scratch[8:]
    max_blocks = bt_ref.shape[1]
    num_blocks, _, block_size, head_dim = k_ref.shape
    block_k = pages_per_step * block_size
    rows = Q_TILE_ROWS
    fp8 = kc_smem is not None
    h = head

    def page_ids(cb):  # -> pages_per_step (clamped id, in the pool) scalars of step cb
        out = []
        for j in range(pages_per_step):
            col = cb * pages_per_step + j
            page = bt_ref[seq, jnp.minimum(col, max_blocks - 1)]
            ok = (page >= 0) & (page < num_blocks) & (col < max_blocks)
            out.append((jnp.where(ok, page, 0), ok))
        return out

    def issue(cb, slot):  # TMA of step cb's pages into `slot` (one copy per page and ref)
        for j, (page, _) in enumerate(page_ids(cb)):
            rows_j = pl.ds(j * block_size, block_size)
            plgpu.copy_gmem_to_smem(k_ref.at[page, h], k_smem.at[slot, rows_j], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[page, h], v_smem.at[slot, rows_j], v_bar.at[slot])

    def page_ok_of_keys(key_index, pages):  # -> i32 like key_index: 1 where the id is in the pool
        # Int selects rather than bool scalars broadcast into bool vectors: Mosaic GPU's
        # lowering rejects the latter (an i1 register conversion).
        ok_key = jnp.ones_like(key_index)
        for j, (_, ok) in enumerate(pages):
            ok_key = jnp.where(key_index // block_size == j, ok.astype(jnp.int32), ok_key)
        return ok_key

    plgpu.copy_gmem_to_smem(q_src, q_smem, q_bar)
    for s in range(num_stages):
        pl.when(s < n_steps)(functools.partial(issue, my_lo + s, s))

    plgpu.barrier_wait(q_bar)
    key_col = jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)

    def step(i, carry):
        m, denom, acc = carry  # f32[rows], f32[rows], f32[rows, head_dim]
        cb = my_lo + i
        slot = jax.lax.rem(i, num_stages)
        pages = page_ids(cb)
        all_pages_ok = functools.reduce(jnp.logical_and, [ok for _, ok in pages])
        tok = cb * block_k + key_col
        visible = (tok >= k_lo) & (tok < k_hi) & (page_ok_of_keys(key_col, pages) > 0)
        if row_visible is not None:
            visible &= row_visible(tok)
        # A step wholly inside the key range with every id in the pool needs no V masking
        # (its keys are real and finite; a row mask only zeroes probabilities).
        partial = (cb * block_k < k_lo) | ((cb + 1) * block_k > k_hi) | ~all_pages_ok

        plgpu.barrier_wait(k_bar.at[slot])
        k_tile = k_smem.at[slot]
        if fp8:
            kc_smem[...] = widen(k_smem[slot], kc_smem.dtype)
            plgpu.commit_smem()
            k_tile = kc_smem

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_tile.T)
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((rows, block_k), jnp.float32)) * scale
        if fp8:
            s = s * scales_ref[0]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(visible, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        denom = alpha * denom + jnp.sum(p, axis=1)
        p_smem[...] = p.astype(p_smem.dtype)

        plgpu.barrier_wait(v_bar.at[slot])
        v_tile = v_smem.at[slot]
        if fp8:
            vc_smem[...] = widen(v_smem[slot], vc_smem.dtype)
            v_tile = vc_smem

        @pl.when(partial)
        def _zero_invisible_v():
            key_row = jax.lax.broadcasted_iota(jnp.int32, (block_k, head_dim), 0)
            tok_r = cb * block_k + key_row
            keep = (tok_r >= k_lo) & (tok_r < k_hi) & (page_ok_of_keys(key_row, pages) > 0)
            v_tile[...] = jnp.where(keep, v_tile[...], jnp.zeros((), v_tile.dtype))

        plgpu.commit_smem()  # P (and any masked V) visible to the tensor core

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_tile)
            return acc_ref[...]

        o_step = pl.run_scoped(pv, plgpu.ACC((rows, head_dim), jnp.float32))

        @pl.when(i + num_stages < n_steps)
        def _refill():
            issue(cb + num_stages, slot)

        return m_new, denom, acc * alpha[:, None] + o_step

    init = (
        jnp.full((rows,), NEG, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    m, denom, acc = jax.lax.fori_loop(0, n_steps, step, init)
    has = denom > 0
    o = acc / jnp.where(has, denom, 1.0)[:, None]
    if fp8:
        o = o * scales_ref[1]
    o_smem[...] = o
    lse_smem[...] = jnp.where(has, m + jnp.log(jnp.where(has, denom, 1.0)), NEG)
    plgpu.commit_smem()
    for src, dst in outputs:
        plgpu.copy_smem_to_gmem(src, dst)
    plgpu.wait_smem_to_gmem(0)


def smem_bytes(dtype, cache_dtype, head_dim: int, block_k: int, num_stages: int) -> int:
    """SMEM one program allocates: q tile, K/V ring, fp8 widened tiles, P, f32 output, lse."""
    q_size, c_size = jnp.dtype(dtype).itemsize, jnp.dtype(cache_dtype).itemsize
    ring = num_stages * 2 * block_k * head_dim * c_size
    widened = 2 * block_k * head_dim * q_size if is_fp8(cache_dtype) else 0
    rows = Q_TILE_ROWS
    fixed = rows * head_dim * q_size + rows * block_k * q_size + rows * head_dim * 4 + rows * 4
    return ring + widened + fixed


def default_tiling(dtype, cache_dtype, block_size: int, head_dim: int) -> dict[str, int]:
    """pages_per_step and num_stages of the decode kernel for q/cache dtypes and page shape.

    A step holds up to 64 keys (block_k = pages_per_step * block_size, at least one page):
    wgmma's N and the TMA count per step stay small while a step still amortises its
    barrier waits. Stages: up to 4 while ``smem_bytes`` stays within SMEM_BUDGET; a step
    is halved (down to one page) before the ring drops below 2 stages.
    """
    pages_per_step = max(1, 64 // block_size)
    while True:
        block_k = pages_per_step * block_size
        num_stages = 4
        while num_stages > 1 and smem_bytes(dtype, cache_dtype, head_dim, block_k, num_stages) > (
            SMEM_BUDGET
        ):
            num_stages -= 1
        if num_stages >= 2 or pages_per_step == 1:
            return dict(pages_per_step=pages_per_step, num_stages=num_stages)
        pages_per_step //= 2


def check_shapes(q, k_cache, pages_per_step: int, num_stages: int) -> None:
    _, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    if jnp.dtype(q.dtype) not in COMPUTE_DTYPES:
        raise ValueError(f"q.dtype={q.dtype} must be bfloat16 or float16 for the Mosaic kernel")
    if not is_fp8(k_cache.dtype) and k_cache.dtype != q.dtype:
        raise ValueError(f"k_cache.dtype={k_cache.dtype} must equal q.dtype={q.dtype} or be fp8")
    group = num_q_heads // num_kv_heads
    if group > Q_TILE_ROWS:
        raise ValueError(f"q heads per KV head={group} must be <= {Q_TILE_ROWS} (one wgmma tile)")
    if block_size % 8:
        raise ValueError(f"block_size={block_size} must be a multiple of 8 (TMA row tiles)")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        # 16, 32, 80, 96 and 256 (at a tiling that fits shared memory) fail Mosaic GPU's
        # layout inference when lowered for an H200 (deviceless), although the
        # interpreter runs them: refuse them here, at trace time, by name.
        raise ValueError(
            f"head_dim={head_dim} must be one of {SUPPORTED_HEAD_DIMS} for the Mosaic GPU "
            "kernels (other head dims do not lower yet); use attention_backend='pallas'"
        )
    block_k = pages_per_step * block_size
    if pages_per_step < 1 or block_k % 8 or block_k > 256:
        raise ValueError(
            f"pages_per_step={pages_per_step} must give block_k = pages_per_step * block_size "
            f"a multiple of 8 and <= 256 (wgmma N), got {block_k}"
        )
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")


def mosaic_decode_call(
    q_tiles,  # f[num_seqs, num_kv_heads, Q_TILE_ROWS, head_dim]
    k_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_cache,
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq_lens,  # i32[num_seqs]
    items,  # i32[num_items, 4]
    kv_scales,  # f32[2]
    *,
    group: int,
    pages_per_step: int,
    num_stages: int,
    num_splits: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    interpret: Any,
):  # -> (f32[num_splits, num_items, kv, out_rows, d], f32[num_splits, num_items, kv, out_rows])
    """The ``plgpu.kernel`` call: grid, SMEM scratch (q tile, K/V ring, P, output), barriers.

    out_rows is the group rounded up to 8 rows (a TMA box of whole rows); rows past the
    group are padding the caller drops.
    """
    plgpu = plgpu_module()
    params = interpret_params(interpret)
    num_items = items.shape[0]
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    dtype = q_tiles.dtype
    block_k = pages_per_step * block_size
    out_rows = min(Q_TILE_ROWS, cdiv(group, 8) * 8)
    fp8 = is_fp8(k_cache.dtype)
    scratch = [
        swizzled_smem(plgpu, Q_TILE_ROWS, head_dim, dtype),
        swizzled_smem(plgpu, block_k, head_dim, k_cache.dtype, num=num_stages),
        swizzled_smem(plgpu, block_k, head_dim, v_cache.dtype, num=num_stages),
        swizzled_smem(plgpu, block_k, head_dim, dtype) if fp8 else None,
        swizzled_smem(plgpu, block_k, head_dim, dtype) if fp8 else None,
        swizzled_smem(plgpu, Q_TILE_ROWS, block_k, dtype),
        plgpu.SMEM((Q_TILE_ROWS, head_dim), jnp.float32),
        plgpu.SMEM((Q_TILE_ROWS,), jnp.float32),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=num_stages),
    ]
    body = functools.partial(
        _kernel,
        plgpu=plgpu,
        pages_per_step=pages_per_step,
        num_stages=num_stages,
        out_rows=out_rows,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    out_type = (
        jax.ShapeDtypeStruct(
            (num_splits, num_items, num_kv_heads, out_rows, head_dim), jnp.float32
        ),
        jax.ShapeDtypeStruct((num_splits, num_items, num_kv_heads, out_rows), jnp.float32),
    )
    call = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_items, num_kv_heads, num_splits),
        grid_names=("item", "kv_head", "split"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=params,
        kernel_name=DECODE_KERNEL_NAME,
    )
    out = call(items, seq_lens, block_tables, kv_scales, q_tiles, k_cache, v_cache)
    return raise_on_races(out, params, DECODE_KERNEL_NAME)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "sliding_window",
        "soft_cap",
        "num_splits",
        "num_items",
        "pages_per_step",
        "num_stages",
        "interpret",
        "validate",
    ),
)
def paged_attention_mosaic(
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
    num_splits: int | None = None,
    num_items: int | None = None,
    pages_per_step: int | None = None,
    num_stages: int | None = None,
    interpret: Any = False,
    validate: bool = False,
    plan: plans.AttentionPlan | None = None,
):  # -> f[num_seqs, num_q_heads, head_dim]
    """Attention of each sequence's newest token over its paged context, on Mosaic GPU.

    Same semantics and output as ``pallas_kernels.reference.paged_attention``.

    Args:
        q: One query token per sequence, at position seq_len - 1; bfloat16 or float16.
            With `plan`, the step's flat rows, sequence s's token at
            plan.query_start_loc[s] (sequences whose query range is not one row get 0).
        k_cache, v_cache: The paged caches (layout.py), q's dtype or fp8. block_size a
            multiple of 8, head_dim a multiple of 16.
        block_tables: Each sequence's block ids in token order, padded with 0. An id
            outside [0, num_blocks) is never followed: its keys are invisible.
        seq_lens: Context length of each sequence, including the query token.
        scale: Softmax scale applied to q.k.
        sliding_window: Keys at positions > p - sliding_window are seen (HF convention).
        soft_cap: Scores become soft_cap * tanh(score / soft_cap).
        k_scale, v_scale: Dequantization scales of an fp8 cache (runtime values).
        num_splits: None: a work list of equal key chunks cut from the real lengths
            (plan.decode_items). An int: every sequence split evenly into that many parts.
        num_items: Length of the work list (num_splits=None); > num_seqs. None:
            ``plan.num_decode_items`` (about two programs per SM of an H200). With a
            plan: None keeps its list (in GPU interpret mode: re-cut to num_seqs +
            INTERPRET_SPARE_ITEMS items); an int re-cuts it to that many items.
        pages_per_step, num_stages: Pages per online-softmax step and SMEM ring depth;
            None: ``default_tiling``.
        interpret: False: compile for the GPU. True or a ``plgpu.InterpretGPUParams``
            (e.g. with detect_races=True): GPU interpret mode on CPU.
        validate: Check block ids and lengths against the pool on device (debug; needs
            checkify, see ``pallas_kernels.checked``).
        plan: A step's precomputed work list (``step_attention``): its decode chunks are
            used as they are (num_splits ignored; see num_items).

    Returns:
        The attention output, in q's dtype, one row per sequence.
    """
    num_seqs = block_tables.shape[0]
    validate_attention_inputs(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        None if plan is None else plan.query_start_loc,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    if validate:
        if plan is None:
            check_attention_values(k_cache, block_tables, seq_lens)
        else:
            qsl = plan.query_start_loc
            check_attention_values(k_cache, block_tables, seq_lens, qsl, q.shape[0])
    num_rows, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    tiling = default_tiling(q.dtype, k_cache.dtype, block_size, head_dim)
    pages_per_step = tiling["pages_per_step"] if pages_per_step is None else pages_per_step
    num_stages = tiling["num_stages"] if num_stages is None else num_stages
    check_shapes(q, k_cache, pages_per_step, num_stages)
    group = num_q_heads // num_kv_heads
    block_k = pages_per_step * block_size
    qsl = jnp.arange(num_seqs + 1, dtype=jnp.int32)
    if plan is not None:
        # Chunk edges are multiples of plan.decode_block_k, not necessarily of this
        # kernel's block_k: a step that straddles an edge is masked like a partial page.
        items = plan.decode_items
        if num_items is None and interpret not in (False, None):
            num_items = num_seqs + INTERPRET_SPARE_ITEMS
        if num_items is not None:
            if num_items <= num_seqs:
                raise ValueError(f"num_items={num_items} must be > num_seqs={num_seqs}")
            items = plans.decode_items(
                seq_lens,
                plan.query_start_loc,
                block_k=plan.decode_block_k,
                num_items=num_items,
                sliding_window=sliding_window,
            )
        splits = 1
    elif num_splits is None:
        if num_items is None:
            num_items = plans.num_decode_items(num_seqs, num_kv_heads)
        if num_items <= num_seqs:
            raise ValueError(f"num_items={num_items} must be > num_seqs={num_seqs}")
        items = plans.decode_items(
            seq_lens,
            qsl,
            block_k=block_k,
            num_items=num_items,
            sliding_window=sliding_window,
        )
        splits = 1
    else:
        if num_splits < 1:
            raise ValueError(f"num_splits={num_splits} must be None or an int >= 1")
        seq_ids = jnp.arange(num_seqs, dtype=jnp.int32)
        zeros = jnp.zeros_like(seq_ids)
        items = jnp.stack(
            [seq_ids, seq_ids, zeros, jnp.full_like(seq_ids, plans.NO_KEY_LIMIT)], axis=1
        )
        splits = num_splits
    if plan is not None:  # each sequence's row (a decode token's; others get no item)
        rows = jnp.minimum(plan.query_start_loc[:-1], num_rows - 1)
        q = q[rows]
    # The q tile of each (sequence, KV head): its group of q heads, zero rows below.
    q_tiles = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, Q_TILE_ROWS - group), (0, 0)))
    o, lse = mosaic_decode_call(
        q_tiles,
        k_cache,
        v_cache,
        block_tables.astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        items,
        kv_scales_array(k_scale, v_scale),
        group=group,
        pages_per_step=pages_per_step,
        num_stages=num_stages,
        num_splits=splits,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpret=interpret,
    )
    out = combine_items(
        o[:, :, :, :group], lse[:, :, :, :group], items[:, plans.ITEM_SEQ], num_seqs
    )
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)
