"""The Mosaic GPU kernels compiled and run on a Hopper GPU, against the reference.

GPU interpret mode (test_mosaic_kernels.py) runs the kernels on CPU but accepts programs
the real lowering rejects; these tests compile them for the device and compare outputs
at Llama-3-8B heads (32 q / 8 kv, head_dim 128, bf16, block 16). Skipped, with the
backend's own reason, without jax >= 0.11.2 and a Hopper or newer GPU.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from pk_testing import assert_close, make_case

import pallas_kernels as pk
from pallas_kernels import reference
from pallas_kernels.backend import mosaic_unavailable

WHY = mosaic_unavailable("mosaic_gpu")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY is not None, reason=WHY or "")]


def _decode_case(dtype="bfloat16"):
    return make_case(
        0,
        seq_lens=[1, 15, 16, 17, 2048, 700, 0, 1500],
        block_size=16,
        num_kv_heads=8,
        group=4,
        head_dim=128,
        dtype=dtype,
    )


@pytest.mark.parametrize("window,cap", [(None, None), (512, 30.0)])
def test_mosaic_decode_on_the_gpu_matches_the_reference(window, cap):
    case = _decode_case()
    ops = pk.get_attention_ops("mosaic_gpu")
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    kw = dict(scale=128**-0.5, sliding_window=window, soft_cap=cap)
    out = ops.paged_attention(*args, **kw)
    want = reference.paged_attention(*args, **kw).astype(jnp.float32)
    assert_close(out, want, "bfloat16")


def test_mosaic_ragged_on_the_gpu_matches_the_reference():
    case = make_case(
        1,
        seq_lens=[300, 700, 33, 1024, 0],
        q_lens=[300, 64, 1, 1, 0],
        num_rows=400,
        block_size=16,
        num_kv_heads=8,
        group=4,
        head_dim=128,
        dtype="bfloat16",
    )
    ops = pk.get_attention_ops("mosaic_gpu")
    args = (
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
    )
    out = ops.ragged_paged_attention(*args, scale=128**-0.5)
    want = reference.ragged_paged_attention(*args, scale=128**-0.5).astype(jnp.float32)
    assert_close(out, want, "bfloat16")
