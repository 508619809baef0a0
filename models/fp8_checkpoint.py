"""How a checkpoint's weights are quantized at load: on-load 8-bit, or block-wise fp8 as stored.

Two sources of 8-bit weights meet here, decided from config.json and the caller's
``quantization`` before any tensor is read:

    no quantization_config, quantization=None    float weights, as before
    no quantization_config, "int8" | "fp8"      quantized on load by the rule
                                                (models/quantization.py), per channel
    quantization_config quant_method "fp8"      transformers' fine-grained fp8:
      weight_block_size [b, b]                  float8_e4m3fn ``*.weight`` f8[out, in] with
                                                f32 ``*.weight_scale_inv`` [ceil(out/b),
                                                ceil(in/b)]; w = q * scale_inv[tile], kept
                                                8-bit with its block scales
    any other quantization_config               refused, naming quant_method

The block-wise checkpoint is read with safetensors' numpy API (models/safetensors_io.py:
F8_E4M3 as ml_dtypes.float8_e4m3fn), never torch. Its ``activation_scheme`` (dynamic
activation quantization in vLLM and transformers' kernels) is not applied: activations
stay in the model dtype (W8A16; docs/quantization.md).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from paged_jax.constants import QUANTIZATIONS, cdiv
from paged_jax.models.partitioning import PartitionRules, logical_axes
from paged_jax.models.quantization import EXPERT_PROJECTIONS
from paged_jax.models.quantized_model import (
    EMBEDDING_PATHS,
    quantized_partition_rules,
    quantized_weight_rules,
)
from paged_jax.models.weights import WeightRule

# What a fine-grained fp8 checkpoint's quantization_config may hold (transformers'
# FineGrainedFP8Config keys); its activation quantization is documented as not applied.
FP8_METHOD = "fp8"
SCALE_SUFFIX = ".weight_scale_inv"
# Per-tensor static activation scales some fp8 checkpoints carry: not used (W8A16).
ACTIVATION_SCALE_KEY = re.compile(r"\.(input_scale|activation_scale)$")


@dataclasses.dataclass(frozen=True)
class WeightQuantization:
    """The 8-bit form a load produces.

    Attributes:
        method: "int8" or "fp8" (the stored 8-bit format).
        block_size: b of a block-wise fp8 checkpoint (scales per b x b tile, read from
            the checkpoint); None: per-channel scales computed on load by the rule.
        embeddings: the token embedding and an untied LM head quantized on load too, per
            channel by the rule, whatever block_size is (EngineConfig.quantize_embeddings).
    """

    method: str
    block_size: int | None = None
    embeddings: bool = False

    @property
    def prequantized(self) -> bool:
        return self.block_size is not None

    def weight_rules(
        self, rules: Sequence[WeightRule], paths: Sequence[tuple[Any, ...]]
    ) -> list[WeightRule]:
        """The loader's table: quantized layers read q and scale (see module docstring)."""
        if not self.prequantized:
            return quantized_weight_rules(rules, paths, self.method)
        heads = [p for p in paths if tuple(p) in EMBEDDING_PATHS]  # per channel, on load
        layers = [p for p in paths if tuple(p) not in EMBEDDING_PATHS]
        rules = block_fp8_weight_rules(rules, layers, self.block_size)
        return quantized_weight_rules(rules, heads, self.method) if heads else rules

    def partition_rules(self, rules: PartitionRules) -> PartitionRules:
        return quantized_partition_rules(rules, block_scales=self.prequantized)

    def is_stored_quantized(self, key: str, array: Any) -> bool:
        """Whether checkpoint tensor `key` (read as `array`) keeps its own dtype (is not
        cast to the model's): a block-wise checkpoint's fp8 weights and float32 scales."""
        fp8 = array.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
        return self.prequantized and (key.endswith(SCALE_SUFFIX) or fp8)


def weight_quantization(
    hf: Mapping[str, Any],
    quantization: str | None,
    source: str,
    quantize_embeddings: bool = False,
) -> WeightQuantization | None:
    """The WeightQuantization of a load (module docstring), or None for float weights.

    Args:
        hf: the checkpoint's config.json.
        quantization: EngineConfig.quantization (None, "int8" or "fp8").
        source: the config file, for error messages.
        quantize_embeddings: EngineConfig.quantize_embeddings (needs `quantization`).

    Raises:
        ValueError: an unsupported quantization_config (naming quant_method and the
            methods served), a block shape other than [b, b], int8 asked of an fp8
            checkpoint, or quantize_embeddings without quantization.
    """
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} must be None or one of {QUANTIZATIONS}")
    if quantize_embeddings not in (False, True):
        raise ValueError(f"quantize_embeddings={quantize_embeddings!r} must be a bool")
    if quantize_embeddings and quantization is None:
        raise ValueError(
            "quantize_embeddings=True needs quantization='int8' | 'fp8' (the format of the "
            "8-bit embedding and LM head); got quantization=None"
        )
    qc = hf.get("quantization_config")
    if qc is None:
        return (
            None
            if quantization is None
            else WeightQuantization(quantization, embeddings=quantize_embeddings)
        )
    if not isinstance(qc, Mapping):
        raise ValueError(f"{source}: quantization_config={qc!r:.80} must be an object")
    method = qc.get("quant_method")
    if method != FP8_METHOD:
        raise ValueError(
            f"{source}: quantization_config.quant_method={method!r} is not supported: only "
            f"{FP8_METHOD!r} (transformers' fine-grained fp8, weight_block_size [b, b]) is "
            "served; or load an unquantized checkpoint with quantization='int8' | 'fp8'"
        )
    block = qc.get("weight_block_size")
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        or block[0] != block[1]
    ):
        raise ValueError(
            f"{source}: quantization_config.weight_block_size={block!r} must be [b, b] "
            "(square blocks of positive ints, e.g. [128, 128]; per-tensor fp8 is not served)"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{source}: quantization_config.fmt={fmt!r} must be 'e4m3'")
    if quantization == "int8":
        raise ValueError(
            f"quantization='int8' cannot apply to {source}: its weights are already fp8 "
            "(quant_method 'fp8'); pass quantization=None or 'fp8'"
        )
    return WeightQuantization(FP8_METHOD, block_size=int(block[0]), embeddings=quantize_embeddings)


def block_fp8_weight_rules(
    rules: Sequence[WeightRule], paths: Sequence[tuple[Any, ...]], block_size: int
) -> list[WeightRule]:
    """The table of a block-wise fp8 checkpoint: each quantized layer's ``X.weight``
    (f8[out, in], transposed to qweight f8[in, out] as a float kernel is) and its
    ``X.weight_scale_inv`` f32[ceil(out/b), ceil(in/b)] (transposed to scale)."""
    replaced = {tuple(p) for p in paths}
    out: list[WeightRule] = []
    for rule in rules:
        path = tuple(rule.param_path)
        expert = path[:-1] in replaced and path[-1] in EXPERT_PROJECTIONS
        if path[:-1] not in replaced or (path[-1] != "kernel" and not expert):
            out.append(rule)
            continue
        assert rule.hf_name.endswith(".weight") and len(rule.hf_shape) == 2, (
            f"a quantized layer's kernel rule reads {rule.hf_name} {rule.hf_shape}: block-wise "
            "fp8 expects a torch nn.Linear weight f[out, in] (a bug in the family's table)"
        )
        rows, cols = rule.hf_shape
        q_path = path if expert else (*path[:-1], "qweight")
        scale_path = (*path[:-1], f"{path[-1]}_scale" if expert else "scale")
        out.append(dataclasses.replace(rule, param_path=q_path))
        out.append(
            WeightRule(
                rule.hf_name[: -len(".weight")] + SCALE_SUFFIX,
                (cdiv(rows, block_size), cdiv(cols, block_size)),
                scale_path,
                _transpose,
                stack=rule.stack,  # an expert's scales stack with its weight
            )
        )
    return out


def _transpose(array: Any) -> Any:
    return array.T


def check_block_sharding(
    rules: Sequence[WeightRule], partition_rules: PartitionRules, block_size: int, tp: int
) -> None:
    """Every split dim of a block-wise layer must split on block edges over `tp` devices.

    Raises:
        ValueError: naming the tensor whose split dim is not a multiple of tp * b.
    """
    for rule in rules:
        if rule.param_path[-1] != "qweight" or tuple(rule.param_path[:-1]) in EMBEDDING_PATHS:
            continue  # the LM head's scales are per channel: any split keeps them whole
        axes = logical_axes(partition_rules, rule.param_path)
        kernel_shape = tuple(reversed(rule.hf_shape))  # f8[out, in] -> qweight [in, out]
        for axis, size in zip(axes, kernel_shape):
            if axis is not None and size % (tp * block_size):
                raise ValueError(
                    f"tensor_parallel_size={tp}: {rule.hf_name} {list(rule.hf_shape)} splits "
                    f"a dim of {size} that is not a multiple of {tp} x weight_block_size "
                    f"{block_size}: each device must hold whole scale blocks"
                )
