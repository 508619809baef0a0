"""SumModel: a weightless, hand-computable model for engine and scheduler tests.

Its next token after a context t_0..t_p is (t_0 + ... + t_p + p) % vocab_size, and it
computes that *through the paged KV cache*: each token's V holds its id, a zero query
attends uniformly over the visible keys, so the attention output is the mean id of the
context, which times (p + 1) is the sum. A scheduler, block-table or slot-mapping bug
that loses or corrupts a cached token changes the output, yet any test can predict
the right answer with a few lines of Python (`SumModel.reference_continuation`).
With `nonfinite_token_id` set, a sequence whose last token is that id gets one
non-finite logit (the engine's non-finite flag is tested with it).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

import pallas_kernels

HEAD_DIM = 64  # the Pallas kernels' smallest supported head_dim


@dataclasses.dataclass(frozen=True)
class SumModelConfig:
    vocab_size: int = 97
    max_position_embeddings: int = 256
    eos_token_ids: tuple[int, ...] = ()
    num_hidden_layers: int = 1
    dtype: str = "float32"
    # A sequence whose last scheduled token is this id gets the logit of its next token
    # set to float(nonfinite_logit): "nan", "inf" or "-inf" (a string, so the frozen
    # config stays equal to itself; NaN != NaN).
    nonfinite_token_id: int | None = None
    nonfinite_logit: str = "nan"


class SumModel(nnx.Module):
    """Next token = (sum of the context's token ids + position) % vocab_size."""

    def __init__(self, config: SumModelConfig | None = None, *, attention_backend: str = "auto"):
        self.config = config or SumModelConfig()
        self.attention_backend = attention_backend

    @staticmethod
    def reference_continuation(
        prompt: list[int], num_tokens: int, vocab_size: int, eos_token_ids=()
    ) -> list[int]:
        """The greedy continuation, computed in plain Python."""
        tokens = list(prompt)
        out: list[int] = []
        for _ in range(num_tokens):
            nxt = (sum(tokens) + len(tokens) - 1) % vocab_size
            tokens.append(nxt)
            out.append(nxt)
            if nxt in eos_token_ids:
                break
        return out

    def init_kv_caches(self, num_blocks: int, block_size: int, dtype=None):
        dtype = jnp.dtype(dtype or self.config.dtype)
        return [
            pallas_kernels.init_kv_cache(num_blocks, block_size, 1, HEAD_DIM, dtype)
            for _ in range(self.config.num_hidden_layers)
        ]

    def kv_bytes_per_block(self, block_size: int, dtype=None) -> int:
        itemsize = jnp.dtype(dtype or self.config.dtype).itemsize
        return 2 * block_size * HEAD_DIM * itemsize * self.config.num_hidden_layers

    def forward_paged(
        self, token_ids, positions, kv_caches, attn_metadata, *, attention_backend=None
    ):
        ops = pallas_kernels.get_attention_ops(
            attention_backend or self.attention_backend, validate=attn_metadata.validate
        ).for_step()
        num_tokens = token_ids.shape[0]
        vocab = self.config.vocab_size
        v = jnp.zeros((num_tokens, 1, HEAD_DIM), jnp.float32)
        v = v.at[:, 0, 0].set(token_ids.astype(jnp.float32)).at[:, 0, 1].set(1.0)
        k = jnp.zeros_like(v)
        q = jnp.zeros_like(v)
        slot_mapping, block_table = attn_metadata.for_group(0)  # one KV-cache group
        new_caches = []
        out = None
        for k_cache, v_cache in kv_caches:
            k_cache, v_cache = ops.write_kv(k_cache, v_cache, k, v, slot_mapping)
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
                scale=1.0,
            )  # f32[T, 1, HEAD_DIM]: mean id of the visible context, and 1.0
            new_caches.append((k_cache, v_cache))
        mean_id = out[attn_metadata.logits_indices, 0, 0]
        pos = positions[attn_metadata.logits_indices]
        total = jnp.round(mean_id * (pos + 1).astype(jnp.float32)).astype(jnp.int32) + pos
        target = jnp.mod(total, vocab)  # i32[S]
        # A peaked distribution: greedy picks target, sampling mostly does too.
        dist = jnp.abs(jnp.arange(vocab)[None, :] - target[:, None]).astype(jnp.float32)
        logits = -dist
        bad = self.config.nonfinite_token_id
        if bad is not None:
            hit = token_ids[attn_metadata.logits_indices] == bad  # bool[S]
            at_target = hit[:, None] & (dist == 0)
            logits = jnp.where(at_target, float(self.config.nonfinite_logit), logits)
        return logits, new_caches
