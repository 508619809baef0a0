"""Which layers of a model become 8-bit, and the loader's tables for them.

models/quantization.py holds the rule and the 8-bit layers; this module swaps them into a
model (abstract, before the loader fills it, or a loaded one: quantize_model), derives the
weight table (each kernel rule becomes a q rule and a scale rule over the same tensor)
and the partition rules (scales split with their weights), and guards live updates.

Quantized: every nnx.Linear under ``layers`` (attention q/k/v/o, dense MLPs, a shared
expert) and every MoE Experts block; with ``embeddings`` (EngineConfig.quantize_embeddings)
also the token embedding (a QuantizedEmbed, one scale per row, which a tied head shares)
and an untied LM head (a QuantizedLinear, one scale per vocab column), always per channel,
block-wise checkpoints included. Kept in the model dtype: routers, Qwen2-MoE's one-column
shared-expert gate (UNQUANTIZED_LINEARS) and, unless asked, embeddings and the LM head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.models.moe import Experts
from paged_jax.models.partitioning import PartitionRules
from paged_jax.models.quantization import (
    EXPERT_PROJECTIONS,
    QuantizedEmbed,
    QuantizedExperts,
    QuantizedLinear,
    check_quantization,
    quantize_columns,
    quantize_rows,
)
from paged_jax.models.weights import WeightRule

__all__ = [
    "EMBEDDING_PATHS",
    "UNQUANTIZED_LINEARS",
    "is_quantized",
    "model_partition_rules",
    "quantize_model",
    "quantized_linear_paths",
    "quantized_partition_rules",
    "quantized_weight_rules",
    "refuse_weight_updates",
    "replace_linears",
]

# Linear layers under a decoder layer that stay unquantized (small, and their outputs
# pick experts: routers; Qwen2-MoE's one-column shared-expert gate).
UNQUANTIZED_LINEARS = ("router", "shared_expert_gate")
# The token embedding and the untied LM head: quantized only when asked, always per channel.
EMBEDDING_PATHS = (("embed_tokens",), ("lm_head",))


def _parent_and_name(model: Any, path: tuple[Any, ...]) -> tuple[Any, Any]:
    node = model
    for part in path[:-1]:
        node = node[part] if isinstance(part, int) else getattr(node, part)
    return node, path[-1]


def _is_experts(node: Any) -> bool:
    return isinstance(node, Experts)


def quantized_linear_paths(model: Any, *, embeddings: bool = False) -> list[tuple[Any, ...]]:
    """Module paths of the layers a quantization replaces: every nnx.Linear under
    ``layers`` except routers and gates (UNQUANTIZED_LINEARS), and every MoE Experts
    block, in graph order; with `embeddings`, then the token embedding and an untied
    LM head (EMBEDDING_PATHS)."""
    paths = []
    for path, node in nnx.iter_graph(model):
        if not path or path[0] != "layers":
            continue
        linear = isinstance(node, nnx.Linear) and path[-1] not in UNQUANTIZED_LINEARS
        if linear or _is_experts(node):
            paths.append(tuple(path))
    if embeddings:
        paths += [p for p in EMBEDDING_PATHS if getattr(model, p[0], None) is not None]
    return paths


def _quantized_experts(old: Any, method: str, block_size: int | None) -> QuantizedExperts:
    e, d, f = old.gate_proj.get_value().shape
    return QuantizedExperts(e, d, f, method=method, block_size=block_size)


def replace_linears(
    model: Any,
    method: str,
    *,
    block_size: int | None = None,
    abstract: bool = True,
    embeddings: bool = False,
) -> list[tuple[Any, ...]]:
    """Replaces, in place, every quantized_linear_paths layer by an empty 8-bit one.

    Args:
        model: a CausalLM, usually abstract (nnx.eval_shape): its new params are then
            ShapeDtypeStructs too, filled by the loader.
        block_size: the decoder layers' block scales (block-wise fp8 checkpoints); the
            embedding and LM head are per channel whatever it is.
        abstract: build the new layers abstractly (nothing allocated).
        embeddings: also the token embedding and an untied LM head.

    Returns:
        The replaced module paths.
    """
    paths = quantized_linear_paths(model, embeddings=embeddings)
    dtype = model.config.dtype
    for path in paths:
        parent, name = _parent_and_name(model, path)
        old = parent[name] if isinstance(name, int) else getattr(parent, name)
        if _is_experts(old):
            experts = nnx.eval_shape(lambda o=old: _quantized_experts(o, method, block_size))
            setattr(parent, name, experts)
            continue
        if isinstance(old, nnx.Embed):

            def embed(v=old.num_embeddings, e=old.features):
                return QuantizedEmbed(v, e, method=method, dtype=dtype)

            setattr(parent, name, nnx.eval_shape(embed) if abstract else embed())
            continue
        in_features, out_features = old.in_features, old.out_features
        blocks = None if tuple(path) in EMBEDDING_PATHS else block_size

        def build(i=in_features, o=out_features, b=old.bias is not None, blocks=blocks):
            return QuantizedLinear(i, o, method=method, bias=b, dtype=dtype, block_size=blocks)

        setattr(parent, name, nnx.eval_shape(build) if abstract else build())
    return paths


def is_quantized(model: Any) -> bool:
    """Whether any layer of `model` holds 8-bit weights (QuantizedLinear, QuantizedEmbed)."""
    return isinstance(model, nnx.Module) and any(
        isinstance(node, QuantizedLinear | QuantizedEmbed) for _, node in nnx.iter_graph(model)
    )


def model_partition_rules(model: Any) -> PartitionRules | None:
    """The partition rules of a model instance: its family's ``partition_rules``, extended
    (quantized_partition_rules) when it holds 8-bit layers, block-wise scales when its
    linears or experts carry a ``block_size``; None when the family declares none."""
    rules = getattr(type(model), "partition_rules", None)
    if rules is None or not is_quantized(model):
        return rules
    block_scales = any(
        isinstance(node, QuantizedLinear | QuantizedExperts) and node.block_size is not None
        for _, node in nnx.iter_graph(model)
    )
    return quantized_partition_rules(rules, block_scales=block_scales)


def refuse_weight_updates(model: Any, what: str) -> None:
    """Raises for a model with 8-bit weights: update_weights / load_weights would hand
    float weights to 8-bit params (no requantization on update yet).

    Raises:
        ValueError: naming the quantization and what to do instead.
    """
    if not isinstance(model, nnx.Module):
        return
    for _, node in nnx.iter_graph(model):
        if isinstance(node, QuantizedLinear | QuantizedEmbed):
            raise ValueError(
                f"{what}: the engine serves 8-bit weights (quantization={node.method!r}"
                f"{', block-wise from the checkpoint' if getattr(node, 'block_size', None) else ''}"
                "); updating "
                "the weights of a quantized model is not supported: build a new LLM from "
                "the updated checkpoint instead"
            )


def quantize_model(model: Any, method: str, *, embeddings: bool = False) -> Any:
    """A copy of a loaded CausalLM with its linear layers (and, with `embeddings`, its
    token embedding and LM head) quantized by the rule, on device.

    The original model keeps its float weights (its arrays are not changed); the copy
    shares every unquantized array with it. Used for models built in memory (random
    weights, a model handed to LLM); load_model(quantization=...) quantizes while
    reading instead, never holding a float copy of a whole model.
    """
    check_quantization(method)
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)  # new module objects over the same arrays
    for path in quantized_linear_paths(copy, embeddings=embeddings):
        parent, name = _parent_and_name(copy, path)
        old = getattr(parent, name)
        if isinstance(old, nnx.Embed):
            table = old.embedding[...]
            q, scale = quantize_rows(np.asarray(table), method)
            new = QuantizedEmbed(
                old.num_embeddings, old.features, method=method, dtype=copy.config.dtype
            )
            new.qembedding[...] = jax.device_put(q, getattr(table, "sharding", None))
            new.scale[...] = jnp.asarray(scale)
            setattr(parent, name, new)
            continue
        if _is_experts(old):
            experts = _quantized_experts(old, method, None)
            for n in EXPERT_PROJECTIONS:
                stacked = getattr(old, n)[...]
                q, scale = quantize_columns(np.asarray(stacked), method)
                getattr(experts, n)[...] = jax.device_put(q, getattr(stacked, "sharding", None))
                getattr(experts, f"{n}_scale")[...] = jnp.asarray(scale)
            setattr(parent, name, experts)
            continue
        kernel = np.asarray(old.kernel[...])
        q, scale = quantize_columns(kernel, method)
        new = QuantizedLinear(
            old.in_features,
            old.out_features,
            method=method,
            bias=old.bias is not None,
            dtype=copy.config.dtype,
        )
        sharding = getattr(old.kernel[...], "sharding", None)
        new.qweight[...] = jax.device_put(q, sharding)
        new.scale[...] = jnp.asarray(scale)
        if old.bias is not None:
            new.bias[...] = old.bias[...]
        setattr(parent, name, new)
    return copy


class _OneQuantization:
    """Quantizes each tensor once though two rules (q and scale) read it back to back."""

    def __init__(self, method: str):
        self.method = method
        self._key: tuple[int, int] | None = None
        self._value: tuple[np.ndarray, np.ndarray] | None = None
        self._held: Any = None

    def __call__(
        self, kernel: np.ndarray, rule_id: int, rows: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        key = (id(kernel), rule_id)
        if self._key != key:
            self._held = kernel  # keeps id(kernel) from being reused while cached
            quantize = quantize_rows if rows else quantize_columns
            self._key, self._value = key, quantize(kernel, self.method)
        return self._value


def quantized_weight_rules(
    rules: Sequence[WeightRule], paths: Sequence[tuple[Any, ...]], method: str
) -> list[WeightRule]:
    """The loader's table for on-load quantization: each replaced layer's kernel rule
    (a replaced embedding's table rule) becomes a qweight (qembedding) rule and a scale
    rule over the same checkpoint tensor."""
    replaced = {tuple(p) for p in paths}
    cache = _OneQuantization(method)
    out: list[WeightRule] = []
    for rule_id, rule in enumerate(rules):
        path = tuple(rule.param_path)
        expert = path[:-1] in replaced and path[-1] in EXPERT_PROJECTIONS
        table = path[:-1] in replaced and path[-1] == "embedding"
        if path[:-1] not in replaced or (path[-1] != "kernel" and not expert and not table):
            out.append(rule)
            continue
        q_leaf = "qembedding" if table else "qweight"
        q_path = path if expert else (*path[:-1], q_leaf)
        scale_path = (*path[:-1], f"{path[-1]}_scale" if expert else "scale")

        def q_of(a, t=rule.transform, i=rule_id, rows=table):
            return cache(np.asarray(t(a)), i, rows)[0]

        def scale_of(a, t=rule.transform, i=rule_id, rows=table):
            return cache(np.asarray(t(a)), i, rows)[1]

        out.append(dataclasses.replace(rule, param_path=q_path, transform=q_of))
        out.append(dataclasses.replace(rule, param_path=scale_path, transform=scale_of))
    return out


def quantized_partition_rules(rules: PartitionRules, *, block_scales: bool) -> PartitionRules:
    """`rules` extended to quantized layers: qweight split as its kernel; a per-channel
    scale f32[out] as the kernel's output axis, a block scale f32[in/b, out/b] as the
    kernel (each device then holds the scales of its own rows and columns); an 8-bit
    embedding table split as the table, its per-row scales f32[vocab] with its rows. The
    LM head is per channel even in a block-wise checkpoint."""
    extra = []
    for pattern, axes in rules:
        if pattern.endswith("_proj$") and axes[:1] == ("experts",):  # stacked experts
            scale_axes = ("experts", None, None) if block_scales else ("experts", None)
            extra.append((pattern[:-1] + "_scale$", scale_axes))
        if pattern.endswith("kernel$") and len(axes) == 2:
            stem = pattern[: -len("kernel$")]
            per_channel = not block_scales or stem.lstrip("^") == "lm_head/"
            extra.append((stem + "qweight$", axes))
            extra.append((stem + "scale$", axes[-1:] if per_channel else axes))
        if pattern.endswith("/embedding$") and len(axes) == 2:
            stem = pattern[: -len("embedding$")]
            extra.append((stem + "qembedding$", axes))
            extra.append((stem + "scale$", axes[:1]))
    return tuple(extra) + tuple(rules)
