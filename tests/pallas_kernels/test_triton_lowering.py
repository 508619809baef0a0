"""Cross-lower every kernel for CUDA on the CPU machine: proves the Triton lowering rules
accept each kernel (shapes, indexing, loops, masks) without a GPU. Compiling the Triton IR
to PTX still needs a GPU (see test_gpu_kernels.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import export

import pallas_kernels as pk

TRITON_CALL = "__gpu$xla.gpu.triton"


def _lower_for_cuda(fn, *shapes) -> str:
    exported = export.export(
        jax.jit(fn),
        platforms=("cuda",),
        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
    )(*shapes)
    return exported.mlir_module()


def _spec(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize(
    "kind,block_size,kv_heads,group,kw",
    [
        pytest.param("decode", 16, 8, 4, {}, id="decode-gqa4-bs16"),
        pytest.param(
            "decode", 8, 4, 1, dict(sliding_window=64, soft_cap=30.0), id="decode-mha-win-cap"
        ),
        pytest.param("ragged", 16, 8, 4, {}, id="ragged-gqa4-bs16"),
        pytest.param(
            "ragged", 32, 2, 8, dict(sliding_window=100, num_splits=2), id="ragged-gqa8-win-split"
        ),
    ],
)
def test_attention_lowers_to_triton(kind, block_size, kv_heads, group, kw):
    head_dim, rows, num_seqs = 128, 40, 4
    cache = _spec((64, kv_heads, block_size, head_dim), jnp.bfloat16)
    tables, lens = _spec((num_seqs, 8)), _spec((num_seqs,))
    if kind == "decode":
        q = _spec((num_seqs, kv_heads * group, head_dim), jnp.bfloat16)
        fn = functools.partial(pk.paged_attention, scale=0.1, **kw)
        text = _lower_for_cuda(fn, q, cache, cache, tables, lens)
    else:
        q = _spec((rows, kv_heads * group, head_dim), jnp.bfloat16)
        fn = functools.partial(pk.ragged_paged_attention, scale=0.1, **kw)
        text = _lower_for_cuda(fn, q, cache, cache, tables, lens, _spec((num_seqs + 1,)))
    assert TRITON_CALL in text


def test_kv_ops_lower_to_triton():
    cache = _spec((64, 8, 16, 128), jnp.bfloat16)
    new = _spec((40, 8, 128), jnp.bfloat16)
    assert TRITON_CALL in _lower_for_cuda(pk.write_kv, cache, cache, new, new, _spec((40,)))
    ids = _spec((3,))
    assert TRITON_CALL in _lower_for_cuda(pk.copy_blocks, cache, cache, ids, ids)
