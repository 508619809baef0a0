"""PagedModel: what the engine needs from a model, stated as a typing.Protocol.

Pure Python (no jax import): research code can check its own model against it. Every
``paged_jax.models`` model satisfies it; so can a Flax NNX module written elsewhere
(see docs/research_integration.md and examples/).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from paged_jax.core.kv_cache_spec import KVCacheGroupSpec

# (k_cache, v_cache) of one layer, each f[num_blocks, num_kv_heads, block_size, head_dim]
# (the kernels' layout: pallas_kernels.init_kv_cache).
KVCache = tuple[Any, Any]

PAGED_MODEL_METHODS = ("init_kv_caches", "kv_bytes_per_block", "forward_paged")
PAGED_MODEL_CONFIG_FIELDS = (
    "vocab_size",
    "max_position_embeddings",
    "eos_token_ids",
    "num_hidden_layers",
    "dtype",
)


@runtime_checkable
class PagedModelConfig(Protocol):
    """The model config fields the engine reads.

    Attributes:
        vocab_size: logits width; sampled ids are in [0, vocab_size).
        max_position_embeddings: upper bound for EngineConfig.max_model_len.
        eos_token_ids: ids that end a request (unless SamplingParams.ignore_eos).
        num_hidden_layers: number of per-layer KV caches.
        dtype: the model's compute dtype name ("float32", "bfloat16", ...); the KV
            cache's default dtype.
    """

    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: Sequence[int]
    num_hidden_layers: int
    dtype: Any


@runtime_checkable
class PagedModel(Protocol):
    """The engine's contract with a model (``Engine``, ``LLM`` and ``Runner`` need only this).

    A Flax NNX module is jitted by splitting it into (graphdef, state) so its weights are
    arguments of the step; any other object is closed over (its arrays become constants).

    Optional: ``kv_cache_groups() -> tuple[paged_jax.core.kv_cache_spec.KVCacheGroupSpec,
    ...]`` declares one KV-cache group per attention type (full, sliding window W). The
    engine then keeps one block table per group, frees out-of-window blocks, and passes
    every group's slot mapping and table in ``attn_metadata`` (a layer of group g reads
    ``attn_metadata.for_group(g)``). Without it the engine uses one full-attention group,
    ``for_group(0)`` (windows, if any, keep every block).

    Optional: ``forward_paged_hidden(...)`` (forward_paged's arguments) -> (f[T, hidden]
    last-layer output at every token, caches) and ``logits(hidden) -> f32[..., vocab]``,
    with forward_paged equal to ``logits(hidden[logits_indices])``: the engine then serves
    ``SamplingParams.prompt_logprobs`` (every paged_jax.models model has both).
    """

    config: PagedModelConfig

    def init_kv_caches(self, num_blocks: int, block_size: int, dtype: Any = None) -> list[KVCache]:
        """Zeroed paged caches: one (k_cache, v_cache) per layer (or per shared KV tensor).

        Args:
            num_blocks: pool size, null block 0 included.
            block_size: tokens per block.
            dtype: cache dtype; None means ``config.dtype``.

        Returns:
            ``num_hidden_layers`` pairs of f[num_blocks, num_kv_heads, block_size, head_dim]
            (fewer when groups share tensors, as paged_jax.models' hybrid models do).
        """
        ...

    def kv_bytes_per_block(self, block_size: int, dtype: Any = None) -> int:
        """Device bytes of one block over all layers, K and V (sizes the pool)."""
        ...

    def forward_paged(
        self,
        token_ids: Any,  # i32[T]
        positions: Any,  # i32[T]
        kv_caches: Sequence[KVCache],
        attn_metadata: Any,  # paged_jax.models.AttentionMetadata
        *,
        attention_backend: str | None = None,
        kv_scales: Any = None,  # f32[num_layers, 2]; passed only for fp8 caches
    ) -> tuple[Any, list[KVCache]]:
        """One engine step: write the new tokens' K/V by slot, attend through the pages.

        Args:
            token_ids: i32[T] new tokens of all sequences, back to back, padded.
            positions: i32[T] position of each token in its sequence.
            kv_caches: the caches from ``init_kv_caches`` (donated by the engine).
            attn_metadata: per KV-cache group slot_mappings i32[T] (-1 = drop) and
                block_tables i32[S, W] (0 = null block), as tuples; ``for_group(g)``
                gives one group's pair. Then seq_lens i32[S], query_start_loc i32[S+1],
                logits_indices i32[S]. (Contract v2; v1's single-group
                ``attn_metadata.slot_mapping`` still reads group 0's for a one-group
                model, deprecated: docs/research_integration.md, "Model contract
                versions".)
            attention_backend: "reference" | "pallas" | "pallas_interpret" |
                "mosaic_gpu" | "mosaic_gpu_interpret" | None (the model's default);
                static under jit.
            kv_scales: per-layer (k_scale, v_scale) of an fp8 KV cache, handed to the
                kernels' k_scale/v_scale; the engine passes it only when
                EngineConfig.kv_cache_dtype is fp8, so a model that never serves an
                fp8 cache may omit the parameter.

        Returns:
            (logits f32[S, vocab_size] at logits_indices, updated caches).
        """
        ...


def check_paged_model(model: Any, *, name: str = "model") -> None:
    """Raises TypeError naming the first member ``model`` lacks for the PagedModel contract."""
    for method in PAGED_MODEL_METHODS:
        if not callable(getattr(model, method, None)):
            raise TypeError(
                f"{name}={type(model).__name__} must implement PagedModel: missing method "
                f"{method!r} (see paged_jax.PagedModel)"
            )
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(
            f"{name}={type(model).__name__} must implement PagedModel: missing attribute "
            "'config' (see paged_jax.PagedModel)"
        )
    for field in PAGED_MODEL_CONFIG_FIELDS:
        if not hasattr(config, field):
            raise TypeError(
                f"{name}.config={type(config).__name__} must implement PagedModelConfig: "
                f"missing field {field!r} (see paged_jax.PagedModel)"
            )


def model_kv_cache_groups(model: PagedModel) -> tuple[KVCacheGroupSpec, ...]:
    """The model's KV-cache groups, or one full-attention group over all its layers.

    A model declares groups (full attention, sliding windows) with the optional
    ``kv_cache_groups()`` method; without one its window layers (if any) still attend
    through their window but keep every block.
    """
    method = getattr(model, "kv_cache_groups", None)
    if callable(method):
        return tuple(method())
    return (KVCacheGroupSpec(None, tuple(range(int(model.config.num_hidden_layers)))),)
