"""write_kv / copy_blocks kernels (interpret) vs references, and the shared validator's errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import reference


def _random_cache(seed, shape, dtype):
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    return k, jnp.asarray(rng.standard_normal(shape), dtype)


@pytest.mark.parametrize(
    "block_size,kv_heads,head_dim,dtype",
    [
        pytest.param(8, 2, 64, "float32", id="bs8-kv2-d64-f32"),
        pytest.param(16, 1, 128, "bfloat16", id="bs16-kv1-d128-bf16"),
        pytest.param(32, 4, 64, "bfloat16", id="bs32-kv4-d64-bf16"),
    ],
)
def test_write_kv_kernel_matches_reference(block_size, kv_heads, head_dim, dtype):
    num_blocks = 5
    k_cache, v_cache = _random_cache(0, (num_blocks, kv_heads, block_size, head_dim), dtype)
    rng = np.random.default_rng(1)
    slots = rng.permutation(num_blocks * block_size)[:7].astype(np.int32)
    slots[[1, 4]] = -1  # padding tokens
    k = jnp.asarray(rng.standard_normal((7, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((7, kv_heads, head_dim)), dtype)
    args = (k_cache, v_cache, k, v, jnp.asarray(slots))
    got = pk.write_kv(*args, block_t=4, interpret=True)
    want = reference.write_kv(*args)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(
            np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
        )
    assert not np.array_equal(
        np.asarray(got[0].astype(jnp.float32)), np.asarray(k_cache.astype(jnp.float32))
    )


def test_write_kv_donated_in_jit():
    k_cache, v_cache = pk.init_kv_cache(3, 8, 1, 64, jnp.float32)
    k = jnp.ones((2, 1, 64), jnp.float32)
    step = jax.jit(functools.partial(pk.write_kv, interpret=True), donate_argnums=(0, 1))
    new_k, new_v = step(k_cache, v_cache, k, -k, jnp.array([8, -1], jnp.int32))
    assert float(new_k[1, 0, 0, 0]) == 1.0 and float(new_v[1, 0, 0, 0]) == -1.0
    assert float(jnp.abs(new_k).sum()) == 64.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_copy_blocks_kernel_matches_reference(dtype):
    k_cache, v_cache = _random_cache(2, (7, 2, 16, 64), dtype)
    src = jnp.array([1, 2, 3, 0], jnp.int32)
    dst = jnp.array([5, 6, 4, -1], jnp.int32)  # last one is padding
    got = pk.copy_blocks(k_cache, v_cache, src, dst, interpret=True)
    want = reference.copy_blocks(k_cache, v_cache, src, dst)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(
            np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
        )
    np.testing.assert_array_equal(np.asarray(got[0][5]), np.asarray(k_cache[1]))


def _decode_inputs(**overrides):
    k_cache, v_cache = pk.init_kv_cache(4, 8, 2, 64, jnp.float32)
    args = dict(
        q=jnp.zeros((3, 4, 64), jnp.float32),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=jnp.zeros((3, 2), jnp.int32),
        seq_lens=jnp.zeros((3,), jnp.int32),
    )
    args.update(overrides)
    return args


BAD_ATTENTION = [
    pytest.param(
        dict(q=jnp.zeros((3, 4, 32))),
        r"q must have shape \[num_seqs, num_q_heads, 64\]",
        id="q-head-dim",
    ),
    pytest.param(
        dict(q=jnp.zeros((3, 3, 64))),
        r"num_q_heads=3, which must be a multiple of num_kv_heads=2",
        id="q-heads",
    ),
    pytest.param(
        dict(q=jnp.zeros((3, 4, 64), jnp.bfloat16)), r"q must have dtype float32", id="q-dtype"
    ),
    pytest.param(
        dict(block_tables=jnp.zeros((3, 2), jnp.float32)),
        r"block_tables must have dtype in \(int32\)",
        id="bt-dtype",
    ),
    pytest.param(
        dict(seq_lens=jnp.zeros((2,), jnp.int32)),
        r"seq_lens must have shape \[3\] \(num_seqs\)",
        id="seq-lens",
    ),
    pytest.param(
        dict(v_cache=jnp.zeros((4, 2, 8, 32))),
        r"v_cache must have shape \(4, 2, 8, 64\)",
        id="v-cache",
    ),
    pytest.param(
        dict(k_cache=jnp.zeros((4, 8, 64))),
        r"k_cache must have shape \[num_blocks, num_kv_heads",
        id="k-rank",
    ),
]


@pytest.mark.parametrize("impl", ["kernel", "reference"])
@pytest.mark.parametrize("overrides,message", BAD_ATTENTION)
def test_attention_validator_errors(impl, overrides, message):
    fn = pk.paged_attention if impl == "kernel" else reference.paged_attention
    kw = dict(interpret=True) if impl == "kernel" else {}
    with pytest.raises(ValueError, match=message):
        fn(**_decode_inputs(**overrides), scale=0.125, **kw)


def test_attention_option_errors():
    with pytest.raises(ValueError, match=r"sliding_window=0 must be None or an int >= 1"):
        reference.paged_attention(**_decode_inputs(), scale=0.1, sliding_window=0)
    with pytest.raises(ValueError, match=r"soft_cap=-1.0 must be None or a positive"):
        pk.paged_attention(**_decode_inputs(), scale=0.1, soft_cap=-1.0, interpret=True)
    with pytest.raises(ValueError, match=r"block_k=24 must be a power-of-two int"):
        pk.paged_attention(**_decode_inputs(), scale=0.1, block_k=24, interpret=True)
    args = _decode_inputs()
    with pytest.raises(
        ValueError, match=r"query_start_loc must have shape \[4\] \(num_seqs \+ 1\)"
    ):
        pk.ragged_paged_attention(
            *args.values(), jnp.zeros((3,), jnp.int32), scale=0.1, interpret=True
        )


def test_write_kv_and_copy_blocks_validator_errors():
    k_cache, v_cache = pk.init_kv_cache(4, 8, 2, 64, jnp.float32)
    k = jnp.zeros((3, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"slot_mapping must have dtype in \(int32\)"):
        reference.write_kv(k_cache, v_cache, k, k, jnp.zeros((3,), jnp.float32))
    with pytest.raises(ValueError, match=r"k must have shape \[num_tokens, 2, 64\]"):
        pk.write_kv(k_cache, v_cache, k[:, :1], k, jnp.zeros((3,), jnp.int32), interpret=True)
    ids = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"dst_block_ids must have shape \[2\] \(num_copies\)"):
        pk.copy_blocks(k_cache, v_cache, ids, jnp.zeros((3,), jnp.int32), interpret=True)
