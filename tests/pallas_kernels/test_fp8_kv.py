"""FP8 KV cache: write_kv quantization and fp8 attention, kernels vs references vs numpy.

The numpy model (ml_dtypes casts, float64 attention over the dequantized cache) is
written apart from pallas_kernels.quantization: stored = fp8(clip(x / scale)), read =
f32(stored) * scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from pk_testing import Case, assert_close, make_case, naive_attention

import pallas_kernels as pk
from pallas_kernels import reference
from pallas_kernels.quantization import quantize

NP_FP8 = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}
JNP_FP8 = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


def np_quantize(x: np.ndarray, scale: float, name: str) -> np.ndarray:
    """The numpy model of the write: divide in f32, saturate at the format's max, cast."""
    limit = float(ml_dtypes.finfo(NP_FP8[name]).max)
    y = np.asarray(x, np.float32) / np.float32(scale)
    return np.clip(y, -limit, limit).astype(NP_FP8[name])


def np_dequantize(x: np.ndarray, scale: float) -> np.ndarray:
    return x.astype(np.float32) * np.float32(scale)


def test_fp8_dtypes_work_on_this_jax():
    # jax 0.10.2 on CPU: fp8 arrays, casts (no saturation: that is our clip's job),
    # and the Pallas interpreter reading and writing fp8 refs.
    x = jnp.asarray([1.0, 500.0, 0.01], jnp.float32)
    assert np.isnan(float(x.astype(jnp.float8_e4m3fn)[1]))  # e4m3fn: no inf, 500 -> NaN
    assert np.isinf(float((x * 200).astype(jnp.float8_e5m2)[1]))
    for name in NP_FP8:
        stored = quantize(x, 1.0, JNP_FP8[name])
        np.testing.assert_array_equal(
            np.asarray(stored).view(np.uint8), np_quantize(np.asarray(x), 1.0, name).view(np.uint8)
        )


@pytest.mark.parametrize(
    "name,in_dtype", [("fp8_e4m3", "float32"), ("fp8_e5m2", "bfloat16")], ids=["e4m3", "e5m2"]
)
def test_write_kv_quantizes_like_numpy_and_kernel_matches(name, in_dtype):
    num_blocks, kv_heads, bs, head_dim = 4, 2, 8, 64
    k_cache, v_cache = pk.init_kv_cache(num_blocks, bs, kv_heads, head_dim, JNP_FP8[name])
    rng = np.random.default_rng(0)
    n = 9
    slots = rng.permutation(np.arange(bs, num_blocks * bs))[:n].astype(np.int32)
    slots[[2, 7]] = -1  # padding: dropped
    # Values spanning the format: tiny (subnormal after scaling), normal, and beyond max
    # (saturate), for both signs.
    k = rng.standard_normal((n, kv_heads, head_dim)) * np.logspace(-4, 4, head_dim)
    v = rng.standard_normal((n, kv_heads, head_dim)) * 3.0
    k, v = (np.asarray(jnp.asarray(a, in_dtype).astype(jnp.float32)) for a in (k, v))
    k_scale, v_scale = 0.37, 1.9
    args = (k_cache, v_cache, jnp.asarray(k, in_dtype), jnp.asarray(v, in_dtype), slots)
    want_k, want_v = reference.write_kv(*args, k_scale=k_scale, v_scale=v_scale)
    got_k, got_v = pk.write_kv(*args, k_scale=k_scale, v_scale=v_scale, block_t=4, interpret=True)
    for got, want, x, scale in ((got_k, want_k, k, k_scale), (got_v, want_v, v, v_scale)):
        assert got.dtype == JNP_FP8[name]
        got_bits, want_bits = np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)
        np.testing.assert_array_equal(got_bits, want_bits)  # kernel == reference, bit for bit
        model = np.zeros((num_blocks, kv_heads, bs, head_dim), NP_FP8[name])
        for t, slot in enumerate(slots):
            if slot >= 0:
                model[slot // bs, :, slot % bs] = np_quantize(x[t], scale, name)
        np.testing.assert_array_equal(want_bits, model.view(np.uint8))
    limit = float(ml_dtypes.finfo(NP_FP8[name]).max)
    stored = np.asarray(want_k).astype(np.float32)
    assert np.isfinite(stored).all() and np.abs(stored).max() == limit  # saturated, not NaN


def fp8_case(seed: int, name: str, k_scale: float, v_scale: float, q_dtype: str, **kw) -> Case:
    """A make_case whose caches are quantized by the numpy model (NaN poison stays NaN)."""
    case = make_case(seed, dtype="float32", **kw)
    k8 = np_quantize(np.asarray(case.k_cache) * 4.0, k_scale, name)  # values past 1.0 too
    v8 = np_quantize(np.asarray(case.v_cache), v_scale, name)
    live = np.asarray(case.clean_k != 0)
    clean_k = np.where(live, np_dequantize(k8, k_scale), 0.0)
    clean_v = np.where(live, np_dequantize(v8, v_scale), 0.0)
    return Case(
        q=case.q.astype(q_dtype),
        k_cache=jnp.asarray(k8),
        v_cache=jnp.asarray(v8),
        clean_k=clean_k,
        clean_v=clean_v,
        block_tables=case.block_tables,
        seq_lens=case.seq_lens,
        query_start_loc=case.query_start_loc,
    )


FP8_CASES = [  # name, q dtype, bs, kv_heads, group, window, cap, splits
    pytest.param("fp8_e4m3", "bfloat16", 16, 1, 4, 11, None, 3, id="e4m3-qbf16-gqa4-win-split3"),
    pytest.param("fp8_e5m2", "float32", 8, 2, 2, None, 5.0, 2, id="e5m2-q32-gqa2-cap-split2"),
]
K_SCALE, V_SCALE = 0.05, 0.7


@pytest.mark.parametrize("name,q_dtype,bs,kv_heads,group,window,cap,splits", FP8_CASES)
def test_fp8_decode_reference_vs_numpy_and_kernel(
    name, q_dtype, bs, kv_heads, group, window, cap, splits
):
    case = fp8_case(
        20,
        name,
        K_SCALE,
        V_SCALE,
        q_dtype,
        seq_lens=[1, bs - 1, bs, bs + 1, 3 * bs + 2, 0],
        block_size=bs,
        num_kv_heads=kv_heads,
        group=group,
        head_dim=64,
    )
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    kw = dict(scale=0.125, sliding_window=window, soft_cap=cap, k_scale=K_SCALE, v_scale=V_SCALE)
    ref = reference.paged_attention(*args, **kw)
    assert ref.dtype == case.q.dtype
    tol = "float32" if q_dtype == "float32" else "bfloat16"
    naive = naive_attention(case, scale=0.125, sliding_window=window, soft_cap=cap)
    assert_close(ref, naive, tol)
    out = pk.paged_attention(*args, **kw, block_k=16, num_splits=splits, interpret=True)
    assert_close(out, np.asarray(ref.astype(jnp.float32)), tol)


@pytest.mark.parametrize("name,q_dtype,bs,kv_heads,group,window,cap,splits", FP8_CASES)
def test_fp8_ragged_reference_vs_numpy_and_kernel(
    name, q_dtype, bs, kv_heads, group, window, cap, splits
):
    case = fp8_case(
        21,
        name,
        K_SCALE,
        V_SCALE,
        q_dtype,
        seq_lens=[bs + 3, 3 * bs + 5, 2 * bs + 1, 0],
        q_lens=[bs + 3, bs - 2, 1, 0],
        num_rows=2 * bs + 6,
        block_size=bs,
        num_kv_heads=kv_heads,
        group=group,
        head_dim=64,
    )
    args = (
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
    )
    kw = dict(scale=0.125, sliding_window=window, soft_cap=cap, k_scale=K_SCALE, v_scale=V_SCALE)
    ref = reference.ragged_paged_attention(*args, **kw)
    tol = "float32" if q_dtype == "float32" else "bfloat16"
    assert_close(ref, naive_attention(case, scale=0.125, sliding_window=window, soft_cap=cap), tol)
    out = pk.ragged_paged_attention(
        *args, **kw, block_q=4, block_k=16, num_splits=splits, interpret=True
    )
    assert_close(out, np.asarray(ref.astype(jnp.float32)), tol)


def test_scales_are_runtime_values_not_recompiles():
    case = fp8_case(
        22, "fp8_e4m3", 1.0, 1.0, "float32", seq_lens=[5, 9], block_size=8, num_kv_heads=1,
        group=2, head_dim=64,
    )  # fmt: skip
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    fn = jax.jit(lambda ks, vs: reference.paged_attention(*args, scale=0.1, k_scale=ks, v_scale=vs))
    base = np.asarray(fn(jnp.float32(1.0), jnp.float32(1.0)))
    doubled_v = np.asarray(fn(jnp.float32(1.0), jnp.float32(2.0)))
    np.testing.assert_allclose(doubled_v, 2 * base, rtol=1e-6)  # v_scale scales the output
    other_k = np.asarray(fn(jnp.float32(3.0), jnp.float32(1.0)))
    assert np.abs(other_k - base).max() > 1e-3  # k_scale sharpens the softmax
    assert fn._cache_size() == 1  # three scale values, one compilation


def test_fp8_scale_validation_errors():
    f32_cache = pk.init_kv_cache(3, 8, 1, 64, jnp.float32)
    fp8_cache = pk.init_kv_cache(3, 8, 1, 64, jnp.float8_e4m3fn)
    k = jnp.ones((2, 1, 64), jnp.float32)
    slots = jnp.asarray([8, 9], jnp.int32)
    with pytest.raises(ValueError, match="k_scale must be None for a float32 cache"):
        reference.write_kv(*f32_cache, k, k, slots, k_scale=2.0)
    with pytest.raises(ValueError, match=r"v_scale must be a float scalar \(shape \(\)\)"):
        reference.write_kv(*fp8_cache, k, k, slots, v_scale=jnp.ones((2,), jnp.float32))
    with pytest.raises(ValueError, match=r"k_scale must be a float scalar .* dtype int32"):
        pk.write_kv(*fp8_cache, k, k, slots, k_scale=jnp.int32(2), interpret=True)
    q = jnp.ones((1, 2, 64), jnp.int32)
    tables, lens = jnp.ones((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="q must have a float dtype"):
        reference.paged_attention(q, *fp8_cache, tables, lens, scale=1.0)
    with pytest.raises(ValueError, match="must be one of float32, bfloat16, float16, float8"):
        pk.init_kv_cache(3, 8, 1, 64, jnp.int8)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kernels_lower_to_triton(name):
    # Cross-lowering for CUDA on this CPU machine: the fp8 loads, casts and the in-kernel
    # quantization pass the Triton lowering rules (PTX needs a GPU: gpu_checks.sh).
    from pk_testing import TRITON_CALL as call
    from pk_testing import lower_for_cuda as lower

    i32 = jnp.int32
    cache = jax.ShapeDtypeStruct((64, 8, 16, 128), JNP_FP8[name])
    q = jax.ShapeDtypeStruct((4, 32, 128), jnp.bfloat16)
    tables, lens = jax.ShapeDtypeStruct((4, 8), i32), jax.ShapeDtypeStruct((4,), i32)
    scale = jax.ShapeDtypeStruct((), jnp.float32)

    def decode(q, kc, vc, t, n, ks, vs):
        return pk.paged_attention(q, kc, vc, t, n, scale=0.1, k_scale=ks, v_scale=vs)

    def ragged(q, kc, vc, t, n, qsl, ks, vs):
        return pk.ragged_paged_attention(q, kc, vc, t, n, qsl, scale=0.1, k_scale=ks, v_scale=vs)

    def write(kc, vc, k, v, slots, ks, vs):
        return pk.write_kv(kc, vc, k, v, slots, k_scale=ks, v_scale=vs)

    qsl = jax.ShapeDtypeStruct((5,), i32)
    new = jax.ShapeDtypeStruct((40, 8, 128), jnp.bfloat16)
    assert call in lower(decode, q, cache, cache, tables, lens, scale, scale)
    assert call in lower(ragged, q, cache, cache, tables, lens, qsl, scale, scale)
    text = lower(write, cache, cache, new, new, jax.ShapeDtypeStruct((40,), i32), scale, scale)
    assert call in text
