"""Decode and ragged Pallas kernels (interpret mode on CPU) against the references.

Every case poisons block 0, spare blocks and the slots past seq_len with NaN (or huge
values), so a passing case also proves none of them can reach an output.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from pk_testing import assert_close, make_case

import pallas_kernels as pk
from pallas_kernels import reference

SWEEP = [  # block_size, kv_heads, group, head_dim, dtype, window, cap, block_k, num_splits
    pytest.param(8, 2, 1, 64, "float32", None, None, 16, 1, id="bs8-mha-d64-f32"),
    pytest.param(8, 1, 4, 64, "bfloat16", None, None, 32, 3, id="bs8-gqa4-d64-bf16-split3"),
    pytest.param(16, 1, 8, 128, "float32", None, 5.0, 16, 2, id="bs16-gqa8-d128-f32-cap"),
    pytest.param(16, 2, 4, 64, "float32", 11, None, 16, 4, id="bs16-gqa4-d64-f32-window"),
    pytest.param(32, 1, 1, 128, "bfloat16", None, None, 64, None, id="bs32-mqa-d128-bf16"),
    pytest.param(32, 2, 8, 64, "bfloat16", 40, 30.0, 16, 2, id="bs32-gqa8-d64-bf16-win-cap"),
]


@pytest.mark.parametrize("bs,kv_heads,group,head_dim,dtype,window,cap,block_k,splits", SWEEP)
def test_decode_kernel_matches_reference(
    bs, kv_heads, group, head_dim, dtype, window, cap, block_k, splits
):
    case = make_case(
        10,
        seq_lens=[1, bs - 1, bs, bs + 1, 4 * bs + 3, 0],
        block_size=bs,
        num_kv_heads=kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
    )
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    kw = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=cap)
    out = pk.paged_attention(*args, **kw, block_k=block_k, num_splits=splits, interpret=True)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, reference.paged_attention(*args, **kw).astype(jnp.float32), dtype)
    assert not np.asarray(out[-1].astype(jnp.float32)).any()  # seq_len 0 -> zeros


RAGGED = [  # bs, kv_heads, group, head_dim, dtype, window, cap, block_q, splits
    pytest.param(8, 2, 1, 64, "float32", None, None, 4, 1, id="bs8-mha-d64-f32-bq4"),
    pytest.param(16, 1, 4, 128, "bfloat16", None, None, 8, 2, id="bs16-gqa4-d128-bf16-split2"),
    pytest.param(16, 2, 8, 64, "float32", 13, 4.0, 2, 1, id="bs16-gqa8-d64-f32-win-cap"),
    pytest.param(32, 1, 4, 64, "float32", None, None, 16, 3, id="bs32-gqa4-d64-f32-split3"),
]


@pytest.mark.parametrize("bs,kv_heads,group,head_dim,dtype,window,cap,block_q,splits", RAGGED)
def test_ragged_kernel_matches_reference(
    bs, kv_heads, group, head_dim, dtype, window, cap, block_q, splits
):
    # fresh prefill | chunk continuing a cached prefix | decode x2 (one at a block edge)
    # | padded sequence | padding rows past query_start_loc[-1]
    case = make_case(
        11,
        seq_lens=[bs + 3, 3 * bs + 5, 2 * bs + 1, bs, 0],
        q_lens=[bs + 3, bs - 2, 1, 1, 0],
        num_rows=2 * bs + 8,
        block_size=bs,
        num_kv_heads=kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
    )
    args = (
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
    )
    kw = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=cap)
    out = pk.ragged_paged_attention(
        *args, **kw, block_q=block_q, block_k=16, num_splits=splits, interpret=True
    )
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, reference.ragged_paged_attention(*args, **kw).astype(jnp.float32), dtype)
    assert not np.asarray(out[int(case.query_start_loc[-1]) :].astype(jnp.float32)).any()


def test_kernels_ignore_huge_values_in_unused_slots():
    case = make_case(
        12, seq_lens=[5, 17, 0], block_size=8, num_kv_heads=1, group=4, head_dim=64, poison=3e38
    )
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    expected = reference.paged_attention(*args, scale=0.125)
    assert_close(
        pk.paged_attention(*args, scale=0.125, num_splits=2, interpret=True), expected, "float32"
    )


def test_ragged_all_decode_equals_decode_kernel():
    case = make_case(13, seq_lens=[9, 1, 24, 0], block_size=8, num_kv_heads=2, group=4, head_dim=64)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    decode = pk.paged_attention(*args, scale=0.125, num_splits=2, interpret=True)
    qsl = jnp.array([0, 1, 2, 3, 3], jnp.int32)  # the padded sequence has no query row
    ragged = pk.ragged_paged_attention(*args, qsl, scale=0.125, interpret=True)
    np.testing.assert_allclose(np.asarray(ragged[:3]), np.asarray(decode[:3]), atol=2e-5, rtol=2e-5)


def test_backend_seam_runs_interpreted_kernels():
    ops = pk.get_attention_ops("pallas_interpret")
    case = make_case(14, seq_lens=[3, 12], block_size=8, num_kv_heads=1, group=1, head_dim=64)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    np.testing.assert_allclose(
        np.asarray(ops.paged_attention(*args, scale=0.125)),
        np.asarray(reference.paged_attention(*args, scale=0.125)),
        atol=2e-5,
        rtol=2e-5,
    )
