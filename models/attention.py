"""Multi-head (GQA) self-attention with a dense causal path and a paged-KV-cache path.

The dense path is the parity oracle (no cache, equal-length rows); the paged path writes
the new tokens' K/V by its KV-cache group's slot mapping and runs paged attention over
that group's block table (pallas_kernels: ragged, or the decode kernel on decode-only
steps). AttentionMetadata is defined jax-free in paged_jax.worker.step_input.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from paged_jax.models.config import ModelConfig
from paged_jax.models.layers import apply_rotary, linear, matmul_precision
from paged_jax.worker.step_input import AttentionMetadata

__all__ = ["Attention", "AttentionMetadata", "KVCache", "causal_attention"]

KVCache = tuple[jax.Array, jax.Array]  # (k_cache, v_cache) of one layer; layout is the kernels'


# The paged forwards are jitted with AttentionMetadata as an argument: a pytree whose
# decode_only/validate flags are static (its module is jax-free, so it registers here).
jax.tree_util.register_dataclass(AttentionMetadata)


def causal_attention(
    q: jax.Array,  # f[batch, seq, num_heads, head_dim]
    k: jax.Array,  # f[batch, seq, num_kv_heads, head_dim]
    v: jax.Array,  # f[batch, seq, num_kv_heads, head_dim]
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # f[batch, seq, num_heads, head_dim]
    """Dense causal attention over full rows, GQA by grouping query heads per KV head.

    Query i sees keys j with j <= i and, with a window, i - j < sliding_window. A soft
    cap maps scaled scores s to cap * tanh(s / cap) before masking (Gemma 2).
    """
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    q = q.reshape(batch, seq, num_kv_heads, group, head_dim)
    precision = matmul_precision(jnp.dtype(q.dtype).name)
    scores = jnp.einsum(
        "bqkgd,bskd->bkgqs", q, k, precision=precision, preferred_element_type=jnp.float32
    )  # f32[batch, kv_heads, group, seq_q, seq_k]
    q_pos = jnp.arange(seq)[:, None]
    k_pos = jnp.arange(seq)[None, :]
    visible = k_pos <= q_pos  # bool[seq_q, seq_k]
    if sliding_window is not None:
        visible &= q_pos - k_pos < sliding_window
    scores = scores * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum(
        "bkgqs,bskd->bqkgd", probs, v, precision=precision
    )  # f[batch, seq, kv_heads, group, head_dim]
    return out.reshape(batch, seq, num_heads, head_dim)


class Attention(nnx.Module):
    """q/k/v/o projections, optional q/k norms and rotary embedding, dense or paged core.

    Params: q_proj, k_proj, v_proj (kernel f[hidden, heads * head_dim]), o_proj; q_norm,
    k_norm (scale f[head_dim]) when qk_norm_cls is given (Qwen3, Gemma 3).

    Args:
        config: the model config (scale, window, soft cap and rope of this layer).
        layer_idx: this layer's index.
        use_rope: apply rotary embeddings.
        qk_norm_cls: per-head norm of q and k before the rotary embedding, or None.
        kv_cache_group: the KV-cache group whose block table this layer reads.
        rngs: parameter initialisation.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        *,
        use_rope: bool,
        rngs: nnx.Rngs,
        qk_norm_cls: type[nnx.Module] | None = None,
        kv_cache_group: int = 0,
    ):
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.soft_cap = config.attn_logit_softcapping
        self.sliding_window = config.layer_sliding_window(layer_idx)
        self.rope = config.layer_rope(layer_idx) if use_rope else None
        self.kv_cache_group = kv_cache_group
        self.q_norm = (
            qk_norm_cls(config.head_dim, eps=config.norm_eps, dtype=config.dtype)
            if qk_norm_cls
            else None
        )
        self.k_norm = (
            qk_norm_cls(config.head_dim, eps=config.norm_eps, dtype=config.dtype)
            if qk_norm_cls
            else None
        )
        hidden, q_dim = config.hidden_size, self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        self.q_proj = linear(hidden, q_dim, bias=config.qkv_bias, config=config, rngs=rngs)
        self.k_proj = linear(hidden, kv_dim, bias=config.qkv_bias, config=config, rngs=rngs)
        self.v_proj = linear(hidden, kv_dim, bias=config.qkv_bias, config=config, rngs=rngs)
        self.o_proj = linear(q_dim, hidden, bias=config.out_bias, config=config, rngs=rngs)

    def qkv(
        self,
        x: jax.Array,  # f[..., tokens, hidden]
        positions: jax.Array,  # i32[..., tokens]
    ) -> tuple[jax.Array, jax.Array, jax.Array]:  # f[..., tokens, heads, head_dim] each
        """q, k, v of `x` after the optional q/k norms and the rotary embedding (as cached)."""
        lead = x.shape[:-1]
        q = self.q_proj(x).reshape(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q = apply_rotary(q, positions, self.rope)
            k = apply_rotary(k, positions, self.rope)
        return q, k, v

    def __call__(
        self,
        x: jax.Array,  # f[batch, seq, hidden]
        positions: jax.Array,  # i32[batch, seq]
    ) -> jax.Array:  # f[batch, seq, hidden]
        """Dense causal self-attention over whole rows."""
        q, k, v = self.qkv(x, positions)
        out = causal_attention(
            q,
            k,
            v,
            scale=self.scale,
            sliding_window=self.sliding_window,
            soft_cap=self.soft_cap,
        )
        return self.o_proj(out.reshape(*x.shape[:-1], self.num_heads * self.head_dim))

    def forward_paged(
        self,
        x: jax.Array,  # f[num_tokens, hidden]
        positions: jax.Array,  # i32[num_tokens]
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        ops: Any,  # pallas_kernels.AttentionOps
        kv_scale: jax.Array | None = None,  # f32[2] (k_scale, v_scale) of an fp8 cache
    ) -> tuple[jax.Array, KVCache]:  # f[num_tokens, hidden], updated cache
        """Writes this step's K/V into the paged cache, then paged attention (the decode
        kernel on decode-only steps, else ragged).

        Reads and writes through its own KV-cache group's slot mapping and block table.
        """
        slot_mapping, block_table = attn_metadata.for_group(self.kv_cache_group)
        q, k, v = self.qkv(x, positions)
        scales = {} if kv_scale is None else {"k_scale": kv_scale[0], "v_scale": kv_scale[1]}
        k_cache, v_cache = ops.write_kv(kv_cache[0], kv_cache[1], k, v, slot_mapping, **scales)
        out = pallas_kernels.step_attention(
            ops,
            q,
            k_cache,
            v_cache,
            block_table,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            decode_only=attn_metadata.decode_only,
            ragged_only=attn_metadata.ragged_only,
            scale=self.scale,
            sliding_window=self.sliding_window,
            soft_cap=self.soft_cap,
            **scales,
        )  # f[num_tokens, num_heads, head_dim]
        out = self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))
        return out, (k_cache, v_cache)
