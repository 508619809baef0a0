"""Level (b): paged-jax's host block manager under your own decode loop.

A one-layer attention model of our own (a few jax lines, not a paged_jax model) decodes
two prompts that share a 12-token prefix. `KVCacheManager` decides which blocks hold which
tokens (with prefix caching: the second prompt adopts the first one's full blocks and
computes only its tail); this loop turns its block ids into block tables and slot
mappings for `pallas_kernels` and checks every greedy token against the same model run
densely over the whole sequence.

    python examples/block_manager_loop.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from paged_jax import KVCacheManager, Request

VOCAB, HIDDEN, HEADS, HEAD_DIM = 64, 128, 2, 64
BLOCK_SIZE, NUM_BLOCKS, MAX_LEN = 4, 32, 64
MAX_BLOCKS = MAX_LEN // BLOCK_SIZE
OPS = pallas_kernels.get_attention_ops("auto")  # Pallas on GPU, the pure-JAX reference on CPU


def init_params(seed: int = 0) -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(seed), 6)
    shapes = {
        "embed": (VOCAB, HIDDEN),
        "pos": (MAX_LEN, HIDDEN),
        "wq": (HIDDEN, HEADS * HEAD_DIM),
        "wk": (HIDDEN, HEADS * HEAD_DIM),
        "wv": (HIDDEN, HEADS * HEAD_DIM),
        "wo": (HEADS * HEAD_DIM, VOCAB),
    }
    return {
        name: jax.random.normal(key, shape) / np.sqrt(shape[0])
        for key, (name, shape) in zip(keys, shapes.items())
    }


def qkv(params, token_ids, positions):  # i32[T] x2 -> 3 x f32[T, H, D]
    x = params["embed"][token_ids] + params["pos"][positions]
    return tuple((x @ params[w]).reshape(-1, HEADS, HEAD_DIM) for w in ("wq", "wk", "wv"))


@jax.jit
def paged_step(params, k_cache, v_cache, token_ids, positions, slot_mapping, block_table):
    """New tokens of ONE sequence -> (logits f32[VOCAB] of its last token, caches)."""
    q, k, v = qkv(params, token_ids, positions)
    k_cache, v_cache = OPS.write_kv(k_cache, v_cache, k, v, slot_mapping)
    seq_len = positions[-1:] + 1  # i32[1]
    query_start_loc = jnp.array([0, token_ids.shape[0]], jnp.int32)
    out = OPS.ragged_paged_attention(
        q, k_cache, v_cache, block_table[None], seq_len, query_start_loc, scale=HEAD_DIM**-0.5
    )
    return out[-1].reshape(-1) @ params["wo"], k_cache, v_cache


@jax.jit
def dense_logits(params, token_ids):  # i32[L] -> f32[VOCAB]: causal attention, no cache
    positions = jnp.arange(token_ids.shape[0])
    q, k, v = qkv(params, token_ids, positions)
    scores = jnp.einsum("qhd,khd->hqk", q, k) * HEAD_DIM**-0.5
    mask = positions[:, None] >= positions[None, :]
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("hqk,khd->qhd", probs, v)
    return out[-1].reshape(-1) @ params["wo"]


def run_one(manager, params, caches, request: Request, max_new: int):
    """Prefill (after any prefix hit), then greedy decode: (tokens, hit tokens, caches)."""
    hit_blocks, num_hit = manager.get_computed_blocks(request)
    new_tokens = request.num_tokens - num_hit
    assert manager.allocate_slots(request, new_tokens, num_hit, hit_blocks) is not None
    request.num_computed_tokens = num_hit
    generated = []
    for _ in range(max_new):
        start, end = request.num_computed_tokens, request.num_tokens
        ids = np.array(request.all_token_ids[start:end], np.int32)
        positions = np.arange(start, end, dtype=np.int32)
        block_ids = manager.get_block_ids(request)
        table = np.zeros(MAX_BLOCKS, np.int32)  # 0 = the null block pads the table
        table[: len(block_ids)] = block_ids
        slots = table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        logits, *caches = paged_step(params, *caches, ids, positions, slots, table)
        request.num_computed_tokens = end
        token = int(jnp.argmax(logits))
        generated.append(token)
        request.append_output_token_ids(token)
        # One more slot for the token just sampled (it is computed next iteration).
        assert manager.allocate_slots(request, 1) is not None
    manager.free(request)
    return generated, num_hit, caches


def main() -> None:
    params = init_params()
    manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, max_model_len=MAX_LEN)
    caches = list(
        pallas_kernels.init_kv_cache(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, jnp.float32)
    )
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, VOCAB, 12).tolist()
    prompts = [prefix + [5, 6, 7], prefix + [9]]
    for i, prompt in enumerate(prompts):
        request = Request(f"req-{i}", prompt)
        tokens, num_hit, caches = run_one(manager, params, caches, request, max_new=10)
        context = list(prompt)
        for tok in tokens:  # the same model, densely, one token at a time
            want = int(jnp.argmax(dense_logits(params, jnp.array(context, jnp.int32))))
            if tok != want:
                raise SystemExit(f"req-{i}: paged token {tok} != dense token {want}")
            context.append(tok)
        print(f"req-{i}: prefix hit {num_hit} tokens, generated {tokens} (== dense forward)")
    manager.check_invariants()
    if manager.num_free_blocks != manager.num_usable_blocks:
        raise SystemExit("blocks leaked")
    if manager.prefix_cache_stats.hits == 0:
        raise SystemExit("the shared prefix was not reused")


if __name__ == "__main__":
    main()
