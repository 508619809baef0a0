"""32-bit offsets: a Triton kernel must never address a cache whose offsets wrap.

JAX's Triton lowering indexes an array of at most 2**32 bytes with 32-bit signed element
offsets (64-bit above), so a 1-byte fp8 cache of more than 2**31 elements in at most
4 GiB would read and write out of bounds. The rule (layout.py), the kernels' refusal
(validation.check_offsets_fit) and the proof on the lowered Triton IR, all with
ShapeDtypeStructs: nothing is allocated.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from pk_testing import capture_triton_asm, lower_for_cuda

import pallas_kernels as pk
from pallas_kernels.layout import max_offset_safe_blocks, offsets_wrap
from pallas_kernels.validation import check_offsets_fit

KV_HEADS, BS, D = 8, 16, 128
BLOCK = KV_HEADS * BS * D  # 16384 elements: 2**17 fp8 blocks fill 2**31 elements
SAFE = 2**31 // BLOCK  # 131072
OVER_4GIB = 2**32 // BLOCK + 1  # 262145 blocks: over 2**32 bytes, 64-bit offsets


def _spec(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _cache(num_blocks, dtype=jnp.float8_e4m3fn):
    return _spec((num_blocks, KV_HEADS, BS, D), dtype)


@pytest.mark.parametrize(
    "num_blocks,itemsize,wraps,capped",
    [
        pytest.param(1000, 1, False, 1000, id="small"),
        pytest.param(SAFE, 1, False, SAFE, id="fp8-2**31-elements"),
        pytest.param(SAFE + 1, 1, True, SAFE, id="fp8-just-over"),
        pytest.param(2 * SAFE, 1, True, SAFE, id="fp8-4GiB-exactly"),
        pytest.param(OVER_4GIB, 1, False, OVER_4GIB, id="fp8-over-4GiB"),
        pytest.param(3 * SAFE, 2, False, 3 * SAFE, id="bf16-never"),
        pytest.param(2 * SAFE, 4, False, 2 * SAFE, id="f32-never"),
    ],
)
def test_the_wrap_window_and_the_cap(num_blocks, itemsize, wraps, capped):
    assert offsets_wrap((num_blocks, KV_HEADS, BS, D), itemsize) is wraps
    assert max_offset_safe_blocks(BLOCK, itemsize, num_blocks) == capped
    assert not offsets_wrap((capped, KV_HEADS, BS, D), itemsize)


def test_check_offsets_fit_names_the_array_and_the_fix():
    check_offsets_fit("k_cache", _cache(SAFE))
    check_offsets_fit("k_cache", _cache(OVER_4GIB))
    bad = _cache(SAFE + 1)
    nbytes = (SAFE + 1) * BLOCK
    with pytest.raises(
        ValueError,
        match=rf"v_cache of shape \({SAFE + 1}, 8, 16, 128\) dtype float8_e4m3fn "
        rf"\({nbytes} bytes\).*use at most {SAFE} blocks",
    ):
        check_offsets_fit("v_cache", bad)


@pytest.mark.parametrize("op", ["write_kv", "copy_blocks"])
def test_the_kernels_refuse_a_cache_in_the_wrap_window(op):
    cache = _cache(SAFE + 1)
    if op == "write_kv":
        new = _spec((8, KV_HEADS, D), jnp.bfloat16)
        args = (cache, cache, new, new, _spec((8,)))
    else:
        args = (cache, cache, _spec((3,)), _spec((3,)))
    with pytest.raises(ValueError, match=rf"k_cache of shape .*use at most {SAFE} blocks"):
        lower_for_cuda(getattr(pk, op), *args)
    # The XLA reference addresses any size (64-bit where needed): no refusal.
    jax.eval_shape(getattr(pk.reference, op), *args)


def _lower_kv_ops(num_blocks):
    """Triton IR of write_kv and copy_blocks on fp8 caches of num_blocks blocks."""
    cache = _cache(num_blocks)
    new = _spec((40, KV_HEADS, D), jnp.bfloat16)
    with capture_triton_asm() as asm:
        lower_for_cuda(pk.write_kv, cache, cache, new, new, _spec((40,)))
        lower_for_cuda(pk.copy_blocks, cache, cache, _spec((3,)), _spec((3,)))
    (write,), (copy,) = asm["paged_write_kv"], asm["paged_copy_blocks"]
    return {"paged_write_kv": write, "paged_copy_blocks": copy}


def _cache_offset_types(asm: str) -> set[str]:
    """Element types of the offsets added to the fp8 cache pointers (tt.addptr)."""
    found = re.findall(r"tt\.addptr .*x!tt\.ptr<f8E4M3FN>>, tensor<[\dx]+x(i\d+)>", asm)
    assert found, "no tt.addptr on the fp8 cache in the IR"
    return set(found)


def test_the_capped_fp8_cache_lowers_with_i32_offsets_that_cannot_wrap():
    shape = (SAFE, KV_HEADS, BS, D)
    strides = [math.prod(shape[i + 1 :]) for i in range(4)]  # elements: 16384, 2048, 128, 1
    for name, asm in _lower_kv_ops(SAFE).items():
        assert _cache_offset_types(asm) == {"i32"}, name
        # The cache's element strides are i32 constants of the IR; the largest offset
        # they can form, at the last element, fits a signed 32-bit int.
        for stride in strides[:-1]:
            assert re.search(rf"arith\.constant {stride} : i32", asm), (name, stride)
        largest = sum((n - 1) * s for n, s in zip(shape, strides))
        assert largest == 2**31 - 1 < 2**31


def test_an_fp8_cache_over_4gib_lowers_with_i64_offsets():
    for name, asm in _lower_kv_ops(OVER_4GIB).items():
        assert _cache_offset_types(asm) == {"i64"}, name
