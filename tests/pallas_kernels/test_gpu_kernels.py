"""The Triton kernels compiled for a real GPU against the pure-JAX reference, one factor at a
time away from Llama-3-8B's decode shape (bf16, head_dim 128, GQA 4, block 16): the cache
dtype (bf16, fp8 e4m3), head_dim (64, 128, 256), GQA (1, 4, 8), a sliding window, a soft cap.

On a GPU these catch lowering and interpret-vs-compiled divergences (jax#26130, #38497) that
the interpret-mode suite cannot. Without one they skip, unless PAGED_JAX_GPU_TESTS_INTERPRET=1
(set by `scripts/gpu_checks.sh --rehearse`) runs the same tests on CPU in Pallas interpret
mode at cut shapes: the rehearsal proves the device run's test cell, not the GPU.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pk_testing import assert_close, make_case

import pallas_kernels as pk
from pallas_kernels import reference

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU and os.environ.get("PAGED_JAX_GPU_TESTS_INTERPRET") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (ON_GPU or INTERPRET),
        reason="needs an NVIDIA GPU (Triton lowering); PAGED_JAX_GPU_TESTS_INTERPRET=1 runs "
        "them in interpret mode on CPU (scripts/gpu_checks.sh --rehearse)",
    ),
]
BS = 16
# Lengths straddling block edges (1, bs-1, bs, bs+1), long ones, and a padded row (0).
DECODE_LENS = [3, BS - 1, BS, BS + 1, 40, 0] if INTERPRET else [1, 15, 16, 17, 2048, 700, 0, 1500]
# (seq_lens, q_lens, num_rows): a prefill chunk over a context, decode rows, padding.
RAGGED = (
    ([40, 17, 5, 0], [24, 1, 5, 0], 34)
    if INTERPRET
    else ([300, 1000, 513, 64, 0], [300, 200, 1, 1, 0], 512)
)
KV_HEADS = 2 if INTERPRET else 8  # the GQA-8 case keeps 32 q heads on the GPU: 4 kv heads
WINDOW = 8 if INTERPRET else 256
CAP = 30.0
K_SCALE, V_SCALE = 0.5, 0.25  # fp8 dequantization scales (runtime values)
# One factor at a time from the base (bf16 cache, head_dim 128, GQA 4, no window, no cap).
BASE = dict(dtype="bfloat16", head_dim=128, group=4, window=None, cap=None)
FACTORS = {
    "base": {},
    "fp8_e4m3": dict(dtype="fp8_e4m3"),
    "d64": dict(head_dim=64),
    "d256": dict(head_dim=256),
    "gqa1": dict(group=1),
    "gqa8": dict(group=8),
    "window": dict(window=WINDOW),
    "softcap": dict(cap=CAP),
}
RAGGED_FACTORS = ("base", "fp8_e4m3", "d256", "gqa8", "window", "softcap")


def case_and_kwargs(seed: int, factor: str, *, ragged: bool):
    """A poisoned paged case for `factor` and the kernels' keyword arguments."""
    f = {**BASE, **FACTORS[factor]}
    kv_heads = KV_HEADS // 2 if f["group"] == 8 and not INTERPRET else KV_HEADS
    seq_lens, q_lens, num_rows = RAGGED if ragged else (DECODE_LENS, None, None)
    case = make_case(
        seed,
        seq_lens=seq_lens,
        q_lens=q_lens,
        num_rows=num_rows,
        block_size=BS,
        num_kv_heads=kv_heads,
        group=f["group"],
        head_dim=f["head_dim"],
        dtype="bfloat16",
    )
    kw = dict(scale=f["head_dim"] ** -0.5, sliding_window=f["window"], soft_cap=f["cap"])
    k_cache, v_cache = case.k_cache, case.v_cache
    if f["dtype"] == "fp8_e4m3":  # stored = x / scale in e4m3 (|x| < 6 stays in range)
        k_cache = (k_cache.astype(jnp.float32) / K_SCALE).astype(jnp.float8_e4m3fn)
        v_cache = (v_cache.astype(jnp.float32) / V_SCALE).astype(jnp.float8_e4m3fn)
        kw.update(k_scale=K_SCALE, v_scale=V_SCALE)
    args = (case.q, k_cache, v_cache, case.block_tables, case.seq_lens)
    if ragged:
        args += (case.query_start_loc,)
    return args, kw


@pytest.mark.parametrize("factor", list(FACTORS))
def test_decode_matches_reference(factor):
    args, kw = case_and_kwargs(0, factor, ragged=False)
    out = pk.paged_attention(*args, **kw, interpret=INTERPRET)
    want = reference.paged_attention(*args, **kw)
    assert out.shape == want.shape and out.dtype == jnp.bfloat16
    assert_close(out, want.astype(jnp.float32), "bfloat16")


def test_decode_without_split_matches_reference():
    # num_splits=1: one program per (sequence, kv head), no log-sum-exp merge.
    args, kw = case_and_kwargs(1, "base", ragged=False)
    out = pk.paged_attention(*args, **kw, num_splits=1, interpret=INTERPRET)
    assert_close(out, reference.paged_attention(*args, **kw).astype(jnp.float32), "bfloat16")


@pytest.mark.parametrize("factor", RAGGED_FACTORS)
def test_ragged_matches_reference(factor):
    args, kw = case_and_kwargs(2, factor, ragged=True)
    out = pk.ragged_paged_attention(*args, **kw, interpret=INTERPRET)
    want = reference.ragged_paged_attention(*args, **kw)
    assert_close(out, want.astype(jnp.float32), "bfloat16")


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_write_kv_and_copy_blocks_match_reference(dtype):
    cache_dtype = jnp.float8_e4m3fn if dtype == "fp8_e4m3" else jnp.bfloat16
    num_kv_heads, head_dim, n = (2, 64, 40) if INTERPRET else (8, 128, 100)
    k_cache, v_cache = pk.init_kv_cache(64, BS, num_kv_heads, head_dim, cache_dtype)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((n, num_kv_heads, head_dim)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((n, num_kv_heads, head_dim)), jnp.bfloat16)
    # Every 7th token is padding (-1: dropped); the rest land from block 1 on.
    slots = jnp.asarray(np.where(np.arange(n) % 7 == 3, -1, BS + np.arange(n)), jnp.int32)
    kw = dict(k_scale=K_SCALE, v_scale=V_SCALE) if dtype == "fp8_e4m3" else {}
    got = pk.write_kv(k_cache, v_cache, k, v, slots, **kw, interpret=INTERPRET)
    want = reference.write_kv(k_cache, v_cache, k, v, slots, **kw)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    src, dst = jnp.array([1, 2, 3], jnp.int32), jnp.array([40, 41, -1], jnp.int32)
    got = pk.copy_blocks(*want, src, dst, interpret=INTERPRET)
    ref = reference.copy_blocks(*want, src, dst)
    for g, w in zip(got, ref):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
