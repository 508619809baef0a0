"""The decoder-only transformer every family instantiates, with its dense and paged forwards.

Families differ in class attributes (norm, MLP, rotary vs learned positions) and in how
they read config.json and name their weights; the forwards live here, once.

    embed_tokens [-> project_in] [+ embed_positions]
      -> layers (pre-norm: x + attn(norm(x)), x + mlp(norm(x)); post-norm: norm(x + attn(x)) ...)
      -> [final_norm] [-> project_out] -> lm_head (or the tied embedding) -> f32 logits
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from paged_jax.core.kv_cache_spec import KVCacheGroupSpec
from paged_jax.models.attention import Attention, AttentionMetadata, KVCache
from paged_jax.models.config import ModelConfig
from paged_jax.models.kv_layout import KVCacheLayout, kv_cache_layout
from paged_jax.models.layers import GatedMLP, RMSNorm, linear, matmul_precision
from paged_jax.models.quantization import QuantizedEmbed


class DecoderLayer(nnx.Module):
    """Self-attention then MLP, each with a residual and a norm (pre- or post-)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        *,
        norm_cls: type[nnx.Module],
        mlp_cls: type[nnx.Module],
        use_rope: bool,
        rngs: nnx.Rngs,
        qk_norm_cls: type[nnx.Module] | None = None,
        kv_cache_group: int = 0,
    ):
        self.pre_norm = config.pre_norm
        self.attn_norm = norm_cls(config.hidden_size, eps=config.norm_eps, dtype=config.dtype)
        self.attn = Attention(
            config,
            layer_idx,
            use_rope=use_rope,
            rngs=rngs,
            qk_norm_cls=qk_norm_cls,
            kv_cache_group=kv_cache_group,
        )
        self.mlp_norm = norm_cls(config.hidden_size, eps=config.norm_eps, dtype=config.dtype)
        self.mlp = mlp_cls(config, rngs=rngs)

    def apply(
        self, x: jax.Array, attend: Callable[[jax.Array], tuple[jax.Array, Any]]
    ) -> tuple[jax.Array, Any]:  # f[..., hidden], whatever `attend` returns second
        """The layer around an attention function: norms, residuals and the MLP.

        `attend(h) -> (attention output, extra)` is the dense or the paged attention (or
        one that records K/V, as calibrate_kv_scales does); `extra` is passed through.
        """
        h, extra = attend(self.attn_norm(x) if self.pre_norm else x)
        x = x + h
        if not self.pre_norm:
            x = self.attn_norm(x)
        x = x + self.mlp(self.mlp_norm(x) if self.pre_norm else x)
        if not self.pre_norm:
            x = self.mlp_norm(x)
        return x, extra

    def __call__(
        self,
        x: jax.Array,  # f[batch, seq, hidden]
        positions: jax.Array,  # i32[batch, seq]
    ) -> jax.Array:  # f[batch, seq, hidden]
        """Dense causal forward."""
        x, _ = self.apply(x, lambda h: (self.attn(h, positions), None))
        return x

    def forward_paged(
        self,
        x: jax.Array,  # f[num_tokens, hidden]
        positions: jax.Array,  # i32[num_tokens]
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        ops: Any,
        kv_scale: jax.Array | None = None,  # f32[2]: this layer's fp8 (k_scale, v_scale)
    ) -> tuple[jax.Array, KVCache]:  # f[num_tokens, hidden], updated cache
        """Paged forward: attention reads and writes this layer's KV cache."""
        return self.apply(
            x,
            lambda h: self.attn.forward_paged(h, positions, kv_cache, attn_metadata, ops, kv_scale),
        )


class CausalLM(nnx.Module):
    """A decoder-only language model; subclasses fill in the family hooks.

    Attributes:
        config: the uniform ModelConfig.
        attention_backend: pallas_kernels backend name of the paged path ("auto",
            "pallas", "pallas_interpret", "reference"); static under jit.
    """

    model_type: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]
    norm_cls: ClassVar[type[nnx.Module]] = RMSNorm
    mlp_cls: ClassVar[type[nnx.Module]] = GatedMLP
    layer_cls: ClassVar[type[DecoderLayer]] = DecoderLayer
    # Per-head norm of q and k before rotary (Qwen3, Gemma 3); None: no q/k norm.
    qk_norm_cls: ClassVar[type[nnx.Module] | None] = None
    use_rope: ClassVar[bool] = True
    # Learned absolute positions are looked up at position + offset (OPT: 2); None: no table.
    position_offset: ClassVar[int | None] = None
    # Prefix of the base model's weights inside a *ForCausalLM checkpoint ("model.").
    hf_base_prefix: ClassVar[str] = "model."
    # Regexes of checkpoint keys that are buffers or duplicates, never parameters.
    hf_ignored_keys: ClassVar[tuple[str, ...]] = (r"rotary_emb\.inv_freq$",)
    # Tensor-parallel split of every param (paged_jax.models.partitioning); None: no TP.
    partition_rules: ClassVar[tuple[tuple[str, tuple[str | None, ...]], ...] | None] = None

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, attention_backend: str = "auto"):
        if config.model_type != self.model_type:
            raise ValueError(
                f"config.model_type={config.model_type!r} must be {self.model_type!r} "
                f"for {type(self).__name__}"
            )
        self.config = config
        self.attention_backend = attention_backend
        dtype, hidden = config.dtype, config.hidden_size
        embed_dim = config.word_embed_proj_dim or hidden
        self.embed_tokens = nnx.Embed(
            config.vocab_size, embed_dim, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        # Optional submodules are assigned once, as a module or None (NNX fixes an
        # attribute's data/static status at its first assignment).
        learned = self.position_offset is not None
        self.embed_positions = (
            nnx.Embed(
                config.max_position_embeddings + (self.position_offset or 0),
                hidden,
                dtype=dtype,
                param_dtype=dtype,
                rngs=rngs,
            )
            if learned
            else None
        )
        projected = embed_dim != hidden
        self.project_in = (
            linear(embed_dim, hidden, bias=False, config=config, rngs=rngs) if projected else None
        )
        self.project_out = (
            linear(hidden, embed_dim, bias=False, config=config, rngs=rngs) if projected else None
        )
        # Layers of one attention type share a KV-cache group (one block table); layer
        # k of every group shares device tensor k (block ids never overlap across groups).
        self.kv_layout: KVCacheLayout = kv_cache_layout(
            [config.layer_sliding_window(i) for i in range(config.num_hidden_layers)]
        )
        self.layers = nnx.List(
            [
                self.layer_cls(
                    config,
                    i,
                    norm_cls=self.norm_cls,
                    mlp_cls=self.mlp_cls,
                    use_rope=self.use_rope,
                    rngs=rngs,
                    qk_norm_cls=self.qk_norm_cls,
                    kv_cache_group=self.kv_layout.group_of_layer[i],
                )
                for i in range(config.num_hidden_layers)
            ]
        )
        self.final_norm = (
            self.norm_cls(hidden, eps=config.norm_eps, dtype=dtype) if config.final_norm else None
        )
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else linear(embed_dim, config.vocab_size, bias=False, config=config, rngs=rngs)
        )
        # The tied head's product (as nnx.Linear's dot_general): batch-invariant engines
        # swap in a row-tiled one (paged_jax.models.batch_invariant).
        self.head_dot_general = jax.lax.dot_general

    # -- family hooks -------------------------------------------------------------------

    @classmethod
    def config_from_hf(
        cls, hf: Mapping[str, Any], generation: Mapping[str, Any], dtype: str
    ) -> ModelConfig:
        """Translates config.json (and generation_config.json) into a ModelConfig."""
        raise NotImplementedError

    @classmethod
    def weight_rules(cls, config: ModelConfig) -> Sequence[Any]:
        """The HF-name -> param-path table (a list of weights.WeightRule) for `config`."""
        raise NotImplementedError

    # -- forwards -----------------------------------------------------------------------

    def lookup(self, token_ids: jax.Array) -> jax.Array:  # i32[...] -> f[..., embed]
        """What transformers' ``get_input_embeddings()`` returns for ``token_ids`` (its
        ``inputs_embeds``): the table's rows (scaled, for families whose embedding
        module scales)."""
        return self.embed_tokens(token_ids)

    def embed(
        self,
        token_ids: jax.Array,  # i32[...]
        positions: jax.Array,  # i32[...]
        replace: tuple[jax.Array, jax.Array] | None = None,  # f[..., embed], bool[...]
    ) -> jax.Array:  # f[..., hidden]
        """The input embedding: token (projected in) plus learned position, as the family has.

        Where ``replace``'s mask is set, its rows stand for ``lookup``'s (prompt
        embeddings, transformers' ``inputs_embeds``).
        """
        x = self.lookup(token_ids)
        if replace is not None:
            rows, mask = replace
            x = jnp.where(mask[..., None], rows.astype(x.dtype), x)
        if self.project_in is not None:
            x = self.project_in(x)
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions + self.position_offset)
        return x

    def logits(self, x: jax.Array) -> jax.Array:  # f[..., hidden] -> f32[..., vocab]
        """The head after the last layer: final norm, projection out, lm_head or tied."""
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        if self.lm_head is None and isinstance(self.embed_tokens, QuantizedEmbed):
            logits = self.embed_tokens.attend(x)  # the 8-bit table serves the head too
        elif self.lm_head is None:
            # "...e,ve->...v": x's last dim against the embedding's dim 1.
            logits = self.head_dot_general(
                x,
                self.embed_tokens.embedding[...],
                (((x.ndim - 1,), (1,)), ((), ())),
                precision=matmul_precision(self.config.dtype),
            )
        else:
            logits = self.lm_head(x)
        return logits.astype(jnp.float32)

    def __call__(self, input_ids: jax.Array) -> jax.Array:  # i32[batch, seq] -> f32[b, s, vocab]
        """Dense causal forward without a cache (every row starts at position 0)."""
        batch, seq = input_ids.shape
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        x = self.embed(input_ids, positions)
        for layer in self.layers:
            x = layer(x, positions)
        return self.logits(x)

    def forward_paged(
        self,
        token_ids: jax.Array,  # i32[num_tokens]
        positions: jax.Array,  # i32[num_tokens]
        kv_caches: Sequence[KVCache],  # one (k_cache, v_cache) per layer
        attn_metadata: AttentionMetadata,
        *,
        attention_backend: str | None = None,
        kv_scales: jax.Array | None = None,  # f32[num_layers, 2]; fp8 caches only
        layers: Any = None,  # a models.layer_scan.StackedLayers: run the layers as a scan
        lora: Any = None,  # a models.lora.LoRAStep: each token row's adapter
    ) -> tuple[jax.Array, list[KVCache]]:  # f32[num_seqs, vocab], updated caches
        """One engine step over a flat, padded batch of new tokens and a paged KV cache.

        Args:
            token_ids: new tokens of all sequences, back to back; padding rows past
                attn_metadata.query_start_loc[-1] may hold any id.
            positions: position of each token in its sequence; 0 for padding rows.
            kv_caches: per KV tensor (k_cache, v_cache) from `init_kv_caches`; donate them.
            attn_metadata: per KV-cache group slot mapping and block table, lengths
                and logits rows; each layer reads its group's (``for_group``).
            attention_backend: overrides `self.attention_backend`; must be static.
            kv_scales: per layer (k_scale, v_scale) of fp8 caches, a traced array (new
                values do not recompile); None = 1.0 (pallas_kernels/quantization.py).
            layers: the layers' weights stacked for a scan (StackedLayers.from_model);
                kv_caches is then its one stacked (K, V) pair. None runs ``self.layers``
                unrolled.
            lora: the step's LoRA stacks and per-row adapter slots (models.lora); None:
                the base model only.

        Returns:
            Logits at attn_metadata.logits_indices and the updated caches: exactly
            ``logits(hidden[attn_metadata.logits_indices])`` of forward_paged_hidden.
        """
        x, new_caches = self.forward_paged_hidden(
            token_ids,
            positions,
            kv_caches,
            attn_metadata,
            attention_backend=attention_backend,
            kv_scales=kv_scales,
            layers=layers,
            lora=lora,
        )
        return self.logits(x[attn_metadata.logits_indices]), new_caches

    def forward_paged_hidden(
        self,
        token_ids: jax.Array,  # i32[num_tokens]
        positions: jax.Array,  # i32[num_tokens]
        kv_caches: Sequence[KVCache],
        attn_metadata: AttentionMetadata,
        *,
        attention_backend: str | None = None,
        kv_scales: jax.Array | None = None,  # f32[num_layers, 2]; fp8 caches only
        layers: Any = None,
        lora: Any = None,
        hook: Any = None,
    ) -> tuple[Any, ...]:  # f[num_tokens, hidden], updated caches[, hook state]
        """forward_paged without the head: the last layer's output at every token.

        ``logits`` turns any rows of it into logits (the engine's prompt logprobs read
        every prompt position this way). Arguments as forward_paged, and ``hook``: an
        object with ``init(x) -> state`` and ``after_layer(state, layer, x) -> (state, x)``
        called after every decoder layer (models.activation_hooks); its final state is
        then returned third.
        """
        layout = self.kv_layout
        ops = pallas_kernels.get_attention_ops(
            attention_backend or self.attention_backend, validate=attn_metadata.validate
        )
        replace = getattr(hook, "input_rows", None)  # prompt embeddings, if the hook has them
        if replace is None:
            x = self.embed(token_ids, positions)
        else:
            x = self.embed(token_ids, positions, replace)
        if attn_metadata.ragged_only:
            # Batch-invariant steps: padding rows (past the step's tokens) are zeros, and
            # stay zeros through bias-free layers, so row-tiled matmuls skip their tiles
            # (paged_jax.models.batch_invariant); they are never read.
            real = jnp.arange(x.shape[0]) < attn_metadata.query_start_loc[-1]
            x = jnp.where(real[:, None], x, jnp.zeros((), x.dtype))
        state = None if hook is None else hook.init(x)
        if layers is not None:
            x, new_caches, state = layers.run(
                x, positions, kv_caches, attn_metadata, ops, kv_scales, lora, hook, state
            )
            return (x, new_caches) if hook is None else (x, new_caches, state)
        if len(self.layers) != self.config.num_hidden_layers:
            raise ValueError(
                f"this model holds {len(self.layers)} of its {self.config.num_hidden_layers} "
                "layers (their weights were moved into a StackedLayers): pass layers="
            )
        if len(kv_caches) != layout.num_tensors:
            raise ValueError(f"len(kv_caches)={len(kv_caches)} must be {layout.num_tensors}")
        ops = ops.for_step()  # one plan cache per traced step: every layer shares the plan
        new_caches = list(kv_caches)
        for i, (layer, t) in enumerate(zip(self.layers, layout.tensor_of_layer)):
            # Layers of different groups may share a tensor (in distinct blocks); the
            # fp8 scales stay per layer.
            kv_scale = None if kv_scales is None else kv_scales[i]
            if lora is not None:
                layer = lora.wrap(nnx.merge(*nnx.split(layer)), lora.layer_stacks(i))
            x, new_caches[t] = layer.forward_paged(
                x, positions, new_caches[t], attn_metadata, ops, kv_scale
            )
            if hook is not None:
                state, x = hook.after_layer(state, i, x)
        return (x, new_caches) if hook is None else (x, new_caches, state)

    # -- KV cache -----------------------------------------------------------------------

    def _init_layer_cache(self, num_blocks: int, block_size: int, dtype: Any) -> KVCache:
        config = self.config
        return pallas_kernels.init_kv_cache(
            num_blocks, block_size, config.num_key_value_heads, config.head_dim, dtype
        )

    def kv_cache_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        """One KV-cache group per attention type: full attention, then each window."""
        return self.kv_layout.groups

    def init_kv_caches(self, num_blocks: int, block_size: int, dtype: Any = None) -> list[KVCache]:
        """Zeroed paged KV caches, one (k_cache, v_cache) per KV tensor (kernels' layout).

        One tensor per layer for single-group models; with several groups, the largest
        group's layer count (layer k of each group uses tensor k).
        """
        dtype = jnp.dtype(dtype or self.config.dtype)
        return [
            self._init_layer_cache(num_blocks, block_size, dtype)
            for _ in range(self.kv_layout.num_tensors)
        ]

    def kv_bytes_per_block(self, block_size: int, dtype: Any = None) -> int:
        """Device bytes one block id takes across all KV tensors (K and V)."""
        dtype = jnp.dtype(dtype or self.config.dtype)
        shapes = jax.eval_shape(lambda: self._init_layer_cache(1, block_size, dtype))
        per_layer = sum(math.prod(s.shape) * s.dtype.itemsize for s in shapes)
        return per_layer * self.kv_layout.num_tensors
