"""Real Triton compilation on a GPU at benchmark-like shapes (Llama-3-8B heads, block 16).

Skipped without a GPU; the interpret-mode suite cannot catch lowering or
interpret-vs-compiled divergences (jax#26130, #38497), these can.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pk_testing import assert_close, make_case

import pallas_kernels as pk
from pallas_kernels import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        jax.default_backend() != "gpu", reason="needs an NVIDIA GPU (Triton lowering)"
    ),
]


@pytest.mark.parametrize("num_splits", [1, None], ids=["nosplit", "autosplit"])
def test_decode_compiles_and_matches(num_splits):
    case = make_case(
        0,
        seq_lens=[1, 15, 16, 17, 2048, 700, 0, 1500],
        block_size=16,
        num_kv_heads=8,
        group=4,
        head_dim=128,
        dtype="bfloat16",
    )
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    out = pk.paged_attention(*args, scale=128**-0.5, num_splits=num_splits)
    assert_close(
        out, reference.paged_attention(*args, scale=128**-0.5).astype(jnp.float32), "bfloat16"
    )


def test_ragged_compiles_and_matches():
    case = make_case(
        1,
        seq_lens=[300, 1000, 513, 64, 0],
        q_lens=[300, 200, 1, 1, 0],
        num_rows=512,
        block_size=16,
        num_kv_heads=8,
        group=4,
        head_dim=128,
        dtype="bfloat16",
    )
    args = (
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
    )
    kw = dict(scale=128**-0.5, sliding_window=256, soft_cap=30.0)
    out = pk.ragged_paged_attention(*args, **kw)
    assert_close(out, reference.ragged_paged_attention(*args, **kw).astype(jnp.float32), "bfloat16")


def test_write_kv_and_copy_blocks_compile():
    k_cache, v_cache = pk.init_kv_cache(64, 16, 8, 128, jnp.bfloat16)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((100, 8, 128)), jnp.bfloat16)
    slots = jnp.asarray(np.where(np.arange(100) % 7 == 3, -1, 16 + np.arange(100)), jnp.int32)
    got = pk.write_kv(k_cache, v_cache, k, k, slots)
    want = reference.write_kv(k_cache, v_cache, k, k, slots)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    src, dst = jnp.array([1, 2, 3], jnp.int32), jnp.array([40, 41, -1], jnp.int32)
    got = pk.copy_blocks(*want, src, dst)
    ref = reference.copy_blocks(*want, src, dst)
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(ref[1], np.float32))
