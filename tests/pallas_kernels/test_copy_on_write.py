"""Copy-on-write at the kernel level: copy_blocks, then write_kv, then attention, in one jit.

Two sequences (a parent and its fork) share a 19-token context whose last block is
partial. In one donated step, as the engine's runner does, the fork's partial block
is copied into a fresh block, each sequence writes its next token at the same offset
of its own block, and both attend. Each must see the shared context plus only its
own new token. Run for the Pallas kernels (interpret mode) and the references.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

BS, KV_HEADS, Q_HEADS, D = 8, 1, 2, 64
CONTEXT = 19  # blocks 1 and 2 full, 3 tokens in block 3
SCALE = D**-0.5


def _dense(q, ks, vs):  # q f[Hq, D]; ks, vs f[n, Hkv, D] -> f[Hq, D]
    out = np.zeros_like(q, dtype=np.float64)
    for h in range(q.shape[0]):
        s = ks[:, h // (Q_HEADS // KV_HEADS)] @ q[h] * SCALE
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ vs[:, h // (Q_HEADS // KV_HEADS)]
    return out


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    k_ctx = rng.standard_normal((CONTEXT, KV_HEADS, D)).astype(np.float32)
    v_ctx = rng.standard_normal((CONTEXT, KV_HEADS, D)).astype(np.float32)
    k_new = rng.standard_normal((2, KV_HEADS, D)).astype(np.float32)  # parent, child
    v_new = rng.standard_normal((2, KV_HEADS, D)).astype(np.float32)
    q = rng.standard_normal((2, Q_HEADS, D)).astype(np.float32)
    return k_ctx, v_ctx, k_new, v_new, q


def _context_cache(k_ctx, v_ctx):
    k_cache, v_cache = pk.init_kv_cache(6, BS, KV_HEADS, D, jnp.float32)
    slots = np.array([(1 + t // BS) * BS + t % BS for t in range(CONTEXT)], np.int32)
    return pk.reference.write_kv(k_cache, v_cache, k_ctx, v_ctx, jnp.asarray(slots))


@pytest.mark.parametrize("backend", ["pallas_interpret", "reference"])
def test_fork_copies_the_partial_block_before_the_steps_writes(case, backend):
    ops = pk.get_attention_ops(backend)
    k_ctx, v_ctx, k_new, v_new, q = case
    offset = CONTEXT % BS
    tables = jnp.array([[1, 2, 3], [1, 2, 4]], jnp.int32)  # the fork owns block 4 now
    slots = jnp.array([3 * BS + offset, 4 * BS + offset], jnp.int32)
    src = jnp.array([3, 0, 0], jnp.int32)
    dst = jnp.array([4, -1, -1], jnp.int32)  # two padding entries

    def step(k_cache, v_cache, copy_first: bool):
        if copy_first:
            k_cache, v_cache = ops.copy_blocks(k_cache, v_cache, src, dst)
        k_cache, v_cache = ops.write_kv(k_cache, v_cache, k_new, v_new, slots)
        if not copy_first:  # the wrong order, as a control
            k_cache, v_cache = ops.copy_blocks(k_cache, v_cache, src, dst)
        out = ops.ragged_paged_attention(
            q,
            k_cache,
            v_cache,
            tables,
            jnp.array([CONTEXT + 1, CONTEXT + 1], jnp.int32),
            jnp.array([0, 1, 2], jnp.int32),
            scale=SCALE,
        )
        return out, k_cache, v_cache

    run = jax.jit(step, donate_argnums=(0, 1), static_argnums=(2,))
    out, k_cache, _ = run(*_context_cache(k_ctx, v_ctx), True)
    k_cache = np.asarray(k_cache)
    # Both partial blocks hold the shared prefix, then their own new token.
    np.testing.assert_array_equal(k_cache[3, :, :offset], k_cache[4, :, :offset])
    np.testing.assert_array_equal(k_cache[3, :, offset], k_new[0])
    np.testing.assert_array_equal(k_cache[4, :, offset], k_new[1])
    for i in range(2):
        ks = np.concatenate([k_ctx, k_new[i : i + 1]]).astype(np.float64)
        vs = np.concatenate([v_ctx, v_new[i : i + 1]]).astype(np.float64)
        np.testing.assert_allclose(np.asarray(out[i]), _dense(q[i], ks, vs), rtol=1e-5, atol=1e-5)
    # Copying after the writes hands the fork its parent's token instead of its own.
    bad, _, _ = run(*_context_cache(k_ctx, v_ctx), False)
    ks = np.concatenate([k_ctx, k_new[1:2]]).astype(np.float64)
    vs = np.concatenate([v_ctx, v_new[1:2]]).astype(np.float64)
    assert not np.allclose(np.asarray(bad[1]), _dense(q[1], ks, vs), atol=1e-3)
