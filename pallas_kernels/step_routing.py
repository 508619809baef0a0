"""Attention of one engine step: the decode kernel when every row is a decode, else ragged.

A decode-only step (every sequence has exactly one new token, row i = sequence i) goes to
``paged_attention``, whose program packs all q heads of one KV head into one tile (one
query row per sequence). The ragged kernel would instead give each decode token a
block_q-token query block, computing block_q times the rows it needs. Which path runs is
a static Python bool, chosen on the host per step, so each (bucket, path) compiles once
and the step never branches on device.

    decode-only rows:  q[T]  = [s0 | s1 | s2 | ... | s(n-1) | pad ...]     (T >= or < S)
    decode kernel:     q[S]  = [s0 | s1 | ... | s(n-1) | pad(seq_len 0 -> 0)]
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.validation import check_decode_rows


def step_attention(
    ops,  # pallas_kernels.AttentionOps
    q,  # f[num_tokens, num_q_heads, head_dim]
    k_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq_lens,  # i32[num_seqs]
    query_start_loc,  # i32[num_seqs + 1]
    *,
    decode_only: bool,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale=None,  # f32 scalar (traced) or None = 1.0; fp8 caches only
    v_scale=None,
):  # -> f[num_tokens, num_q_heads, head_dim]
    """Ragged paged attention, through the decode kernel when ``decode_only``.

    Args:
        ops: The backend's ops (``get_attention_ops``).
        decode_only: Static. True promises query_start_loc = [0, 1, ..., n, n, ..., n]:
            sequence i's single new token is row i; padded sequences have seq_len 0.
            Checked on device when ``ops.validate``.
        Others: As in ``ragged_paged_attention``.

    Returns:
        The same values as ``ops.ragged_paged_attention`` (rows past the real tokens 0).
    """
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if k_scale is not None or v_scale is not None:  # fp8 caches (others reject scales)
        kw.update(k_scale=k_scale, v_scale=v_scale)
    if not decode_only:
        return ops.ragged_paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, **kw
        )
    if ops.validate:
        check_decode_rows(query_start_loc)
    num_tokens = q.shape[0]
    num_seqs = block_tables.shape[0]
    if num_tokens >= num_seqs:
        q_seq = q[:num_seqs]
    else:
        q_seq = jnp.pad(q, ((0, num_seqs - num_tokens), (0, 0), (0, 0)))
    out = ops.paged_attention(q_seq, k_cache, v_cache, block_tables, seq_lens, **kw)
    # Rows past query_start_loc[-1] (padding tokens) must be 0, as the ragged kernel's are.
    row = jnp.arange(num_seqs, dtype=jnp.int32)
    out = jnp.where((row < query_start_loc[-1])[:, None, None], out, 0)
    if num_tokens >= num_seqs:
        return jnp.pad(out, ((0, num_tokens - num_seqs), (0, 0), (0, 0)))
    return out[:num_tokens]
