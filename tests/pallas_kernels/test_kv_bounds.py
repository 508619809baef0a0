"""write_kv / copy_blocks: device-side bounds (always on) and head_dims that are not 2**k.

A slot outside ``[0, num_blocks * block_size)`` is dropped, and a copy whose source or
destination is not a block id is dropped; the good entries of the same call still land
and everything else in the caches stays bit-identical (raw bytes, fp8 included). Run on
the Pallas kernels (interpret mode) and on the references. ``validate=True`` still
raises, naming the field.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from pk_testing import capture_triton_asm, lower_for_cuda

import pallas_kernels as pk
from pallas_kernels import reference
from pallas_kernels.quantization import quantize

BACKENDS = ["pallas_interpret", "reference"]
NUM_BLOCKS, KV_HEADS, BS, D = 5, 2, 8, 64


def _raw(x) -> bytes:
    return np.asarray(x).tobytes()


def _caches(seed, dtype, shape=(NUM_BLOCKS, KV_HEADS, BS, D)):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))


def _expected_write(cache, new, slots, scale=1.0):
    """numpy: cache with new[t] stored at each in-range slot (raw dtype, quantized as
    the op does)."""
    out = np.array(cache)
    num_slots = cache.shape[0] * cache.shape[2]
    q = np.asarray(quantize(jnp.asarray(new), jnp.float32(scale), cache.dtype))
    for t, s in enumerate(slots):
        if 0 <= s < num_slots:
            out[s // cache.shape[2], :, s % cache.shape[2]] = q[t]
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_slots_are_dropped_and_the_rest_lands(backend, dtype):
    ops = pk.get_attention_ops(backend)
    k_cache, v_cache = _caches(0, dtype)
    rng = np.random.default_rng(1)
    slots = np.array([-5, 3, NUM_BLOCKS * BS, 17, 2**30, -1, 2**31 - 1, 39], np.int32)
    k = rng.standard_normal((len(slots), KV_HEADS, D)).astype(np.float32)
    v = rng.standard_normal((len(slots), KV_HEADS, D)).astype(np.float32)
    k_new, v_new = (jnp.asarray(x, jnp.float32 if "float8" in dtype else dtype) for x in (k, v))
    got_k, got_v = ops.write_kv(k_cache, v_cache, k_new, v_new, jnp.asarray(slots))
    for got, cache, new in ((got_k, k_cache, k_new), (got_v, v_cache, v_new)):
        assert _raw(got) == _raw(_expected_write(cache, new, slots))
    # Only the bad slots: the caches come back byte for byte.
    bad = np.array([-5, NUM_BLOCKS * BS, 2**30, -(2**31), 2**31 - 1], np.int32)
    k_bad = k_new[: len(bad)]
    got_k, got_v = ops.write_kv(k_cache, v_cache, k_bad, k_bad, jnp.asarray(bad))
    assert _raw(got_k) == _raw(k_cache) and _raw(got_v) == _raw(v_cache)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_copies_with_a_bad_source_or_destination_are_dropped(backend, dtype):
    ops = pk.get_attention_ops(backend)
    k_cache, v_cache = _caches(2, dtype)
    src = jnp.array([1, NUM_BLOCKS, 2, -3, 2**30, 1], jnp.int32)
    dst = jnp.array([3, 4, NUM_BLOCKS, 2, 0, -7], jnp.int32)
    got_k, got_v = ops.copy_blocks(k_cache, v_cache, src, dst)
    for got, cache in ((got_k, k_cache), (got_v, v_cache)):
        want = np.array(cache)
        want[3] = want[1]  # the only good pair; (5 -> 4) must not copy the last block
        assert _raw(got) == _raw(want)
    # Only bad pairs: untouched, byte for byte.
    got_k, got_v = ops.copy_blocks(k_cache, v_cache, src[1:5], dst[1:5])
    assert _raw(got_k) == _raw(k_cache) and _raw(got_v) == _raw(v_cache)


@pytest.mark.parametrize("backend", BACKENDS)
def test_validate_still_raises_naming_the_field(backend):
    ops = pk.get_attention_ops(backend, validate=True)
    k_cache, v_cache = _caches(3, "float32")
    new = jnp.zeros((2, KV_HEADS, D), jnp.float32)
    with pytest.raises(checkify.JaxRuntimeError, match=r"slot_mapping\[1\] = 1073741824 must"):
        pk.checked(ops.write_kv)(k_cache, v_cache, new, new, jnp.array([3, 2**30], jnp.int32))
    copy = pk.checked(ops.copy_blocks)
    with pytest.raises(checkify.JaxRuntimeError, match=r"src_block_ids\[0\] = 5 is not a block"):
        copy(k_cache, v_cache, jnp.array([5, 1], jnp.int32), jnp.array([3, 4], jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match=r"dst_block_ids\[1\] = -2 must be -1"):
        copy(k_cache, v_cache, jnp.array([1, 2], jnp.int32), jnp.array([3, -2], jnp.int32))


# ------------------------------------------------------------------ head_dim not 2**k

HEAD_DIM_CASES = [
    pytest.param(80, "bfloat16", id="d80-bf16"),
    pytest.param(96, "bfloat16", id="d96-bf16"),
    pytest.param(80, "float8_e4m3fn", id="d80-fp8"),
    pytest.param(96, "float8_e4m3fn", id="d96-fp8"),
    pytest.param(16, "float32", id="d16-f32"),
    pytest.param(200, "float32", id="d200-f32"),
]


@pytest.mark.parametrize("head_dim,dtype", HEAD_DIM_CASES)
def test_write_kv_serves_any_head_dim(head_dim, dtype):
    shape = (NUM_BLOCKS, KV_HEADS, BS, head_dim)
    k_cache, v_cache = _caches(4, dtype, shape)
    rng = np.random.default_rng(5)
    slots = jnp.asarray(np.array([7, -1, 33, 12, 2**30], np.int32))
    new_dtype = jnp.float32 if "float8" in dtype else dtype
    k, v = (jnp.asarray(rng.standard_normal((5, KV_HEADS, head_dim)), new_dtype) for _ in range(2))
    scales = dict(k_scale=jnp.float32(0.5), v_scale=jnp.float32(2.0)) if "float8" in dtype else {}
    got = pk.write_kv(k_cache, v_cache, k, v, slots, block_t=4, interpret=True, **scales)
    want = reference.write_kv(k_cache, v_cache, k, v, slots, **scales)
    for g, w in zip(got, want):
        assert _raw(g) == _raw(w)
    assert _raw(got[0]) != _raw(k_cache)


@pytest.mark.parametrize("head_dim,dtype", HEAD_DIM_CASES)
def test_copy_blocks_serves_any_head_dim(head_dim, dtype):
    k_cache, v_cache = _caches(6, dtype, (NUM_BLOCKS, KV_HEADS, BS, head_dim))
    src, dst = jnp.array([1, 2, 0], jnp.int32), jnp.array([3, 4, -1], jnp.int32)
    got = pk.copy_blocks(k_cache, v_cache, src, dst, interpret=True)
    want = reference.copy_blocks(k_cache, v_cache, src, dst)
    for g, w in zip(got, want):
        assert _raw(g) == _raw(w)
    assert _raw(got[0][3]) == _raw(k_cache[1])


def test_copy_blocks_serves_a_block_size_that_is_not_a_power_of_two():
    k_cache, v_cache = _caches(7, "bfloat16", (NUM_BLOCKS, KV_HEADS, 12, 80))
    src, dst = jnp.array([2], jnp.int32), jnp.array([1], jnp.int32)
    got = pk.copy_blocks(k_cache, v_cache, src, dst, interpret=True)
    want = reference.copy_blocks(k_cache, v_cache, src, dst)
    assert _raw(got[0]) == _raw(want[0]) and _raw(got[1]) == _raw(want[1])


# ------------------------------------------------------------------ the guard in the IR
# Interpret mode and XLA scatters drop an out-of-range index by themselves, so the CPU
# tests above would pass without a guard; Triton follows any address. The lowered
# Triton IR must compare the slot / block ids against the pool's size.


def _compares_against(asm: str, value: int) -> int:
    """How many ``arith.cmpi`` in the Triton IR text compare with the constant `value`
    (scalar or splat)."""
    names = set(re.findall(rf"(%c{value}_i32(?:_\d+)?) = arith\.constant {value} : i32", asm))
    for line in asm.splitlines():  # splats of those constants
        m = re.match(r"\s*(%\d+) = tt\.splat (%\S+) :", line)
        if m and m.group(2) in names:
            names.add(m.group(1))
    count = 0
    for line in asm.splitlines():
        m = re.search(r"arith\.cmpi \w+, (%\S+), (%\S+) :", line)
        if m and {m.group(1).rstrip(","), m.group(2)} & names:
            count += 1
    return count


def test_the_lowered_kernels_compare_ids_with_the_pool_size():
    num_blocks, block_size = 37, 16
    cache = jax.ShapeDtypeStruct((num_blocks, 2, block_size, 64), jnp.float8_e4m3fn)
    new = jax.ShapeDtypeStruct((8, 2, 64), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((3,), jnp.int32)
    with capture_triton_asm() as asm:
        lower_for_cuda(pk.write_kv, cache, cache, new, new, jax.ShapeDtypeStruct((8,), jnp.int32))
        lower_for_cuda(pk.copy_blocks, cache, cache, ids, ids)
    (write,), (copy,) = asm["paged_write_kv"], asm["paged_copy_blocks"]
    assert _compares_against(write, num_blocks * block_size) >= 1  # slot < num_slots
    assert _compares_against(copy, num_blocks) >= 2  # src < num_blocks, dst < num_blocks
