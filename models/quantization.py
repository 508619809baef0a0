"""8-bit weights (W8A16): the quantization rule, the quantized linear layer and its product.

The rule (``quantization="int8" | "fp8"``, quantized on load from a float checkpoint):
symmetric, one scale per output channel (a row of transformers' ``[out, in]`` weight, a
column of our ``[in, out]`` kernel), computed in float32 from the stored values:

    int8: scale = max|w| / 127,  q = clip(rint(w / scale), -127, 127)
    fp8:  scale = max|w| / 448,  q = float8_e4m3fn(w / scale)   (round to nearest even)
    a row of zeros gets scale 1

Pre-quantized block-wise fp8 checkpoints (transformers' fine-grained fp8) keep their own
scales, one per [block, block] tile (``weight_scale_inv``); they are read by
models/fp8_checkpoint.py into the same layer with a block scale.

The product keeps the weight 8-bit on the device. Per output channel the scale commutes
with the contraction, so it multiplies the product's output::

    y[t, o] = sum_i x[t, i] * (q[i, o] * s[o]) = (x @ q)[t, o] * s[o]

``x @ q.astype(compute dtype)``: the convert is exact (int8 and e4m3 fit in bf16) and is
the only dequantization; XLA fuses it into the dot's operand or, where it does not,
materializes one converted matrix at a time. A block scale varies along the contraction,
so the block-wise layer dequantizes its one matrix (q * s per tile) before the dot; a step
still holds at most one dequantized matrix at a time (scripts/bench_quantization.py reads
it from the compiled memory analysis).

Embeddings, the LM head, MoE routers and Qwen2-MoE's shared-expert gate stay in the model
dtype. qwix (Google's JAX quantization library) was read and not used: its symmetric int8
bound is 127.5 (not 127), its scales take the weight's dtype and its PTQ provider rewrites
the model's dot_generals by interception, which does not reach our scanned layer stacks
(docs/quantization.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from paged_jax.constants import QUANTIZATIONS, cdiv
from paged_jax.models.layers import matmul_precision
from paged_jax.models.partitioning import PartitionRules
from paged_jax.models.weights import WeightRule

__all__ = [
    "QUANTIZATIONS",
    "QUANTIZED_DTYPES",
    "QuantizedLinear",
    "dequantize",
    "is_quantized",
    "quantize_columns",
    "quantize_model",
    "quantized_linear_paths",
    "quantized_matmul",
    "quantized_partition_rules",
    "quantized_weight_rules",
    "replace_linears",
]

# The largest magnitude of each 8-bit format: the row maximum maps onto it.
QUANT_MAX = {"int8": 127.0, "fp8": 448.0}
QUANTIZED_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
# Linear layers under a decoder layer that stay unquantized (small, and their outputs
# pick experts: routers; Qwen2-MoE's one-column shared-expert gate).
UNQUANTIZED_LINEARS = ("router", "shared_expert_gate")


def check_quantization(quantization: Any) -> str | None:
    """``quantization`` if it is None or one of QUANTIZATIONS; else a ValueError."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} must be None or one of {QUANTIZATIONS}")
    return quantization


def quantize_columns(kernel: np.ndarray, method: str) -> tuple[np.ndarray, np.ndarray]:
    """The rule (module docstring) on a kernel f[..., in, out]: one scale per column.

    Returns:
        (q int8 / float8_e4m3fn [..., in, out], scale f32[..., out]).
    """
    check_quantization(method)
    w = np.asarray(kernel, dtype=np.float32)
    absmax = np.max(np.abs(w), axis=-2)  # f32[..., out]
    scale = np.where(absmax > 0, absmax / np.float32(QUANT_MAX[method]), np.float32(1.0))
    scale = scale.astype(np.float32)
    scaled = w / scale[..., None, :]
    if method == "int8":
        q = np.clip(np.rint(scaled), -127, 127).astype(np.int8)
    else:
        q = scaled.astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def dequantize(q: Any, scale: Any, block_size: int | None = None) -> Any:
    """f32[..., in, out]: the weight the quantized layer multiplies by (numpy or jax).

    ``scale`` is f32[..., out] per channel, or f32[ceil(in/b), ceil(out/b)] per b x b tile
    when ``block_size`` is b.
    """
    xp = np if isinstance(q, np.ndarray) else jnp
    w = q.astype(xp.float32)
    if block_size is None:
        return w * scale[..., None, :]
    rows, cols = q.shape[-2:]
    expanded = xp.repeat(xp.repeat(scale, block_size, axis=-2), block_size, axis=-1)
    return w * expanded[..., :rows, :cols]


def quantized_matmul(
    x: jax.Array,  # f[..., in]
    q: jax.Array,  # int8 / f8[in, out]
    scale: jax.Array,  # f32[out], or f32[ceil(in/b), ceil(out/b)] with block_size b
    *,
    block_size: int | None = None,
    precision: Any = None,
) -> jax.Array:  # f[..., out] in x's dtype
    """x @ dequantize(q, scale), without a dequantized weight beyond one matrix.

    Per channel: (x @ q) * scale, the convert of q the only dequantization (module
    docstring). The product accumulates in float32 and is scaled in float32.
    """
    if block_size is None:
        y = jnp.dot(x, q.astype(x.dtype), precision=precision, preferred_element_type=jnp.float32)
        return (y * scale).astype(x.dtype)
    w = dequantize(q, scale, block_size).astype(x.dtype)
    return jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32).astype(x.dtype)


class QuantizedLinear(nnx.Module):
    """A linear layer with an 8-bit kernel: y = x @ dequantize(qweight, scale) + bias.

    Params: qweight int8 / f8_e4m3fn[in, out], scale f32[out] (per channel) or
    f32[ceil(in/b), ceil(out/b)] (block-wise fp8 checkpoints, ``block_size`` b), bias
    f[out] in the model dtype (None without one).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        method: str,
        bias: bool,
        dtype: str,
        block_size: int | None = None,
    ):
        check_quantization(method)
        self.method = method
        self.block_size = block_size
        self.precision = matmul_precision(dtype)
        self.qweight = nnx.Param(jnp.zeros((in_features, out_features), QUANTIZED_DTYPES[method]))
        scale_shape = (
            (out_features,)
            if block_size is None
            else (cdiv(in_features, block_size), cdiv(out_features, block_size))
        )
        self.scale = nnx.Param(jnp.ones(scale_shape, jnp.float32))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:  # f[..., in] -> f[..., out]
        y = quantized_matmul(
            x,
            self.qweight[...],
            self.scale[...],
            block_size=self.block_size,
            precision=self.precision,
        )
        return y if self.bias is None else y + self.bias[...]


def _parent_and_name(model: Any, path: tuple[Any, ...]) -> tuple[Any, Any]:
    node = model
    for part in path[:-1]:
        node = node[part] if isinstance(part, int) else getattr(node, part)
    return node, path[-1]


def quantized_linear_paths(model: Any) -> list[tuple[Any, ...]]:
    """Module paths of the linear layers a quantization replaces: every nnx.Linear under
    ``layers`` except routers and gates (UNQUANTIZED_LINEARS), in graph order."""
    paths = []
    for path, node in nnx.iter_graph(model):
        if (
            isinstance(node, nnx.Linear)
            and path
            and path[0] == "layers"
            and path[-1] not in UNQUANTIZED_LINEARS
        ):
            paths.append(tuple(path))
    return paths


def replace_linears(
    model: Any, method: str, *, block_size: int | None = None, abstract: bool = True
) -> list[tuple[Any, ...]]:
    """Replaces, in place, every quantized_linear_paths layer by an empty QuantizedLinear.

    Args:
        model: a CausalLM, usually abstract (nnx.eval_shape): its new params are then
            ShapeDtypeStructs too, filled by the loader.
        abstract: build the new layers abstractly (nothing allocated).

    Returns:
        The replaced module paths.
    """
    paths = quantized_linear_paths(model)
    dtype = model.config.dtype
    for path in paths:
        parent, name = _parent_and_name(model, path)
        old = parent[name] if isinstance(name, int) else getattr(parent, name)
        in_features, out_features = old.in_features, old.out_features

        def build(i=in_features, o=out_features, b=old.bias is not None):
            return QuantizedLinear(i, o, method=method, bias=b, dtype=dtype, block_size=block_size)

        setattr(parent, name, nnx.eval_shape(build) if abstract else build())
    return paths


def is_quantized(model: Any) -> bool:
    """Whether any layer of `model` holds 8-bit weights (QuantizedLinear)."""
    return isinstance(model, nnx.Module) and any(
        isinstance(node, QuantizedLinear) for _, node in nnx.iter_graph(model)
    )


def refuse_weight_updates(model: Any, what: str) -> None:
    """Raises for a model with 8-bit weights: update_weights / load_weights would hand
    float weights to 8-bit params (no requantization on update yet).

    Raises:
        ValueError: naming the quantization and what to do instead.
    """
    if not isinstance(model, nnx.Module):
        return
    for _, node in nnx.iter_graph(model):
        if isinstance(node, QuantizedLinear):
            raise ValueError(
                f"{what}: the engine serves 8-bit weights (quantization={node.method!r}"
                f"{', block-wise from the checkpoint' if node.block_size else ''}); updating "
                "the weights of a quantized model is not supported: build a new LLM from "
                "the updated checkpoint instead"
            )


def quantize_model(model: Any, method: str) -> Any:
    """A copy of a loaded CausalLM with its linear layers quantized by the rule, on device.

    The original model keeps its float weights (its arrays are not changed); the copy
    shares every unquantized array with it. Used for models built in memory (random
    weights, a model handed to LLM); load_model(quantization=...) quantizes while
    reading instead, never holding a float copy of a whole model.
    """
    check_quantization(method)
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)  # new module objects over the same arrays
    for path in quantized_linear_paths(copy):
        parent, name = _parent_and_name(copy, path)
        old = getattr(parent, name)
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

    def __call__(self, kernel: np.ndarray, rule_id: int) -> tuple[np.ndarray, np.ndarray]:
        key = (id(kernel), rule_id)
        if self._key != key:
            self._held = kernel  # keeps id(kernel) from being reused while cached
            self._key, self._value = key, quantize_columns(kernel, self.method)
        return self._value


def quantized_weight_rules(
    rules: Sequence[WeightRule], paths: Sequence[tuple[Any, ...]], method: str
) -> list[WeightRule]:
    """The loader's table for on-load quantization: each replaced layer's kernel rule
    becomes a qweight rule and a scale rule over the same checkpoint tensor."""
    replaced = {tuple(p) for p in paths}
    cache = _OneQuantization(method)
    out: list[WeightRule] = []
    for rule_id, rule in enumerate(rules):
        path = tuple(rule.param_path)
        if path[:-1] not in replaced or path[-1] != "kernel":
            out.append(rule)
            continue

        def q_of(a, t=rule.transform, i=rule_id):
            return cache(np.asarray(t(a)), i)[0]

        def scale_of(a, t=rule.transform, i=rule_id):
            return cache(np.asarray(t(a)), i)[1]

        out.append(dataclasses.replace(rule, param_path=(*path[:-1], "qweight"), transform=q_of))
        out.append(dataclasses.replace(rule, param_path=(*path[:-1], "scale"), transform=scale_of))
    return out


def quantized_partition_rules(rules: PartitionRules, *, block_scales: bool) -> PartitionRules:
    """`rules` extended to quantized layers: qweight split as its kernel; a per-channel
    scale f32[out] as the kernel's output axis, a block scale f32[in/b, out/b] as the
    kernel (each device then holds the scales of its own rows and columns)."""
    extra = []
    for pattern, axes in rules:
        if pattern.endswith("kernel$") and len(axes) == 2:
            stem = pattern[: -len("kernel$")]
            extra.append((stem + "qweight$", axes))
            extra.append((stem + "scale$", axes if block_scales else axes[-1:]))
    return tuple(extra) + tuple(rules)

