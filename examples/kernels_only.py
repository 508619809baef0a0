"""Level (a): the paged kernels alone, with block tables built by hand.

Two sequences of 5 and 11 tokens live in a paged cache of 8 blocks of 4 tokens; their
blocks are scattered (and block 0, the null block, pads the tables). We write their K/V
by slot mapping, run ragged paged attention over both in one call, and check every row
against plain causal attention on the unpaged arrays.

    python examples/kernels_only.py        # Pallas on GPU; the Pallas interpreter on CPU
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels

BLOCK_SIZE, NUM_BLOCKS, NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM = 4, 8, 2, 4, 64


def dense_causal_attention(q, k, v, scale):  # f[L, Hq, D], f[L, Hkv, D] x2 -> f[L, Hq, D]
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    length = q.shape[0]
    scores = np.where(np.tril(np.ones((length, length), bool))[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v)


def main() -> None:
    interpret = jax.default_backend() != "gpu"  # Pallas kernels need a GPU or the interpreter
    rng = np.random.default_rng(0)
    seq_lens = [5, 11]
    # Hand-built block tables: sequence 0 owns blocks 6, 2; sequence 1 owns 3, 7, 1.
    block_tables = np.array([[6, 2, 0], [3, 7, 1]], np.int32)  # i32[S, W]; 0 = null block
    query_start_loc = np.array([0, 5, 16], np.int32)  # i32[S + 1]
    slot_mapping = np.concatenate(  # i32[T]: slot = block_id * block_size + offset
        [
            block_tables[s, np.arange(n) // BLOCK_SIZE] * BLOCK_SIZE + np.arange(n) % BLOCK_SIZE
            for s, n in enumerate(seq_lens)
        ]
    ).astype(np.int32)
    total = sum(seq_lens)
    q = rng.standard_normal((total, NUM_Q_HEADS, HEAD_DIM), np.float32)
    k = rng.standard_normal((total, NUM_KV_HEADS, HEAD_DIM), np.float32)
    v = rng.standard_normal((total, NUM_KV_HEADS, HEAD_DIM), np.float32)

    k_cache, v_cache = pallas_kernels.init_kv_cache(
        NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, jnp.float32
    )
    k_cache, v_cache = pallas_kernels.write_kv(
        k_cache,
        v_cache,
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(slot_mapping),
        interpret=interpret,
    )
    scale = HEAD_DIM**-0.5
    out = pallas_kernels.ragged_paged_attention(
        jnp.asarray(q),
        k_cache,
        v_cache,
        jnp.asarray(block_tables),
        jnp.asarray(seq_lens, dtype=jnp.int32),
        jnp.asarray(query_start_loc),
        scale=scale,
        interpret=interpret,
    )  # f32[T, Hq, D]
    out = np.asarray(out)
    worst = 0.0
    for s, n in enumerate(seq_lens):
        lo = query_start_loc[s]
        want = dense_causal_attention(q[lo : lo + n], k[lo : lo + n], v[lo : lo + n], scale)
        worst = max(worst, float(np.abs(out[lo : lo + n] - want).max()))
    print(f"ragged paged attention vs dense causal attention: max |diff| = {worst:.2e}")
    if worst > 1e-4:
        raise SystemExit(f"paged attention disagrees with dense attention by {worst}")


if __name__ == "__main__":
    main()
