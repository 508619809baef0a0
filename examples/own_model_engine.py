"""Level (c): the whole engine around a model of your own.

`TinyLM` below is written here, not taken from paged_jax.models: a Flax NNX decoder with
learned positions. It implements `paged_jax.PagedModel` (a config with five fields plus
init_kv_caches, kv_bytes_per_block and forward_paged), so `Engine` and `LLM` serve it:
continuous batching, prefix caching and (with a pool this small) preemption. Every greedy
token is checked against the same model's dense forward.

    python examples/own_model_engine.py
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from paged_jax import LLM, Engine, EngineConfig, PagedModel, SamplingParams


@dataclasses.dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int = 96
    max_position_embeddings: int = 128
    eos_token_ids: tuple[int, ...] = ()
    num_hidden_layers: int = 2
    dtype: str = "float32"
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64


class Block(nnx.Module):
    def __init__(self, c: TinyLMConfig, rngs: nnx.Rngs):
        self.c = c
        self.norm1 = nnx.LayerNorm(c.hidden_size, rngs=rngs)
        self.q = nnx.Linear(c.hidden_size, c.num_heads * c.head_dim, rngs=rngs)
        self.k = nnx.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, rngs=rngs)
        self.v = nnx.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, rngs=rngs)
        self.o = nnx.Linear(c.num_heads * c.head_dim, c.hidden_size, rngs=rngs)
        self.norm2 = nnx.LayerNorm(c.hidden_size, rngs=rngs)
        self.up = nnx.Linear(c.hidden_size, 4 * c.hidden_size, rngs=rngs)
        self.down = nnx.Linear(4 * c.hidden_size, c.hidden_size, rngs=rngs)

    def qkv(self, x):  # f32[T, hidden] -> f32[T, H, D], f32[T, Hkv, D] x2
        c = self.c
        h = self.norm1(x)
        return (
            self.q(h).reshape(-1, c.num_heads, c.head_dim),
            self.k(h).reshape(-1, c.num_kv_heads, c.head_dim),
            self.v(h).reshape(-1, c.num_kv_heads, c.head_dim),
        )

    def finish(self, x, attn):  # residual + MLP around the attention output f32[T, H, D]
        x = x + self.o(attn.reshape(attn.shape[0], -1))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))

    def dense(self, x):  # one sequence, f32[L, hidden]: plain causal attention
        q, k, v = self.qkv(x)
        group = self.c.num_heads // self.c.num_kv_heads
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        scores = jnp.einsum("qhd,khd->hqk", q, k) * self.c.head_dim**-0.5
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        return self.finish(x, jnp.einsum("hqk,khd->qhd", probs, v))

    def paged(self, x, kv_cache, meta, ops):
        q, k, v = self.qkv(x)
        slot_mapping, block_table = meta.for_group(0)  # one KV-cache group: full attention
        k_cache, v_cache = ops.write_kv(*kv_cache, k, v, slot_mapping)
        attn = ops.ragged_paged_attention(
            q,
            k_cache,
            v_cache,
            block_table,
            meta.seq_lens,
            meta.query_start_loc,
            scale=self.c.head_dim**-0.5,
        )
        return self.finish(x, attn), (k_cache, v_cache)


class TinyLM(nnx.Module):
    """A decoder-only LM implementing paged_jax.PagedModel."""

    def __init__(self, config: TinyLMConfig, *, seed: int = 0, attention_backend: str = "auto"):
        rngs = nnx.Rngs(seed)
        self.config = config
        self.attention_backend = attention_backend
        self.embed = nnx.Embed(config.vocab_size, config.hidden_size, rngs=rngs)
        self.pos = nnx.Embed(config.max_position_embeddings, config.hidden_size, rngs=rngs)
        self.blocks = nnx.List([Block(config, rngs) for _ in range(config.num_hidden_layers)])
        self.head = nnx.Linear(config.hidden_size, config.vocab_size, rngs=rngs)

    def __call__(self, token_ids):  # i32[L] -> f32[L, vocab]: the dense reference
        x = self.embed(token_ids) + self.pos(jnp.arange(token_ids.shape[0]))
        for block in self.blocks:
            x = block.dense(x)
        return self.head(x)

    # -- the PagedModel contract ------------------------------------------------------
    def init_kv_caches(self, num_blocks, block_size, dtype=None):
        c = self.config
        return [
            pallas_kernels.init_kv_cache(
                num_blocks, block_size, c.num_kv_heads, c.head_dim, jnp.dtype(dtype or c.dtype)
            )
            for _ in range(c.num_hidden_layers)
        ]

    def kv_bytes_per_block(self, block_size, dtype=None):
        c = self.config
        itemsize = jnp.dtype(dtype or c.dtype).itemsize
        return 2 * block_size * c.num_kv_heads * c.head_dim * itemsize * c.num_hidden_layers

    def forward_paged(
        self, token_ids, positions, kv_caches, attn_metadata, *, attention_backend=None
    ):
        ops = pallas_kernels.get_attention_ops(attention_backend or self.attention_backend)
        x = self.embed(token_ids) + self.pos(positions)
        new_caches = []
        for block, kv_cache in zip(self.blocks, kv_caches):
            x, kv_cache = block.paged(x, kv_cache, attn_metadata, ops)
            new_caches.append(kv_cache)
        return self.head(x[attn_metadata.logits_indices]).astype(jnp.float32), new_caches


def dense_greedy(model: TinyLM, prompt: list[int], max_new: int) -> list[int]:
    # One padded length for every call, so the dense reference compiles once: causal
    # attention keeps the padding after position n - 1 out of that position's logits.
    length = model.config.max_position_embeddings
    forward = nnx.jit(lambda m, ids, n: m(ids)[n - 1].argmax())
    ids = list(prompt)
    for _ in range(max_new):
        padded = np.zeros(length, np.int32)
        padded[: len(ids)] = ids
        ids.append(int(forward(model, jnp.asarray(padded), len(ids))))
    return ids[len(prompt) :]


def main() -> None:
    model = TinyLM(TinyLMConfig())
    assert isinstance(model, PagedModel)
    rng = np.random.default_rng(0)
    system = rng.integers(0, 96, 16).tolist()  # a shared prefix: prefix-cache hits
    prompts = [system + rng.integers(0, 96, int(n)).tolist() for n in rng.integers(2, 12, 8)]
    max_new = 12
    want = [dense_greedy(model, p, max_new) for p in prompts]

    # A pool of 24 blocks x 4 tokens cannot hold 8 sequences of ~40 tokens: preemption.
    config = EngineConfig(block_size=4, num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=32)
    engine = Engine(model, config)
    params = SamplingParams(temperature=0.0, max_tokens=max_new)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[int(out.request_id)] = list(out.token_ids)
    stats = engine.get_stats()
    for i in range(len(prompts)):
        if got[i] != want[i]:
            raise SystemExit(f"Engine request {i}: {got[i]} != dense {want[i]}")
    print(
        f"Engine: {len(prompts)} requests == dense forward; preemptions "
        f"{stats['num_preemptions']}, prefix-cache hit rate {stats['prefix_cache_hit_rate']:.2f}"
    )
    if stats["num_preemptions"] == 0 or stats["prefix_cache_hits"] == 0:
        raise SystemExit(f"expected preemption and prefix hits, got {stats}")

    # warmup=False: compile buckets as they are met (the Engine run above showed the same
    # path); a served LLM keeps the default, which compiles every bucket up front.
    llm = LLM(
        model,
        warmup=False,
        block_size=4,
        num_kv_blocks=24,
        max_num_seqs=8,
        max_num_batched_tokens=32,
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(outs):
        if list(out.outputs[0].token_ids) != want[i]:
            raise SystemExit(f"LLM request {i}: {out.outputs[0].token_ids} != dense {want[i]}")
    print(f"LLM: {len(outs)} requests == dense forward")


if __name__ == "__main__":
    main()
