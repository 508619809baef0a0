"""Tensor-parallel partition rules: each family declares once how its params split over heads.

A rule maps a regex over a param path ("layers/0/attn/q_proj/kernel") to one logical axis
name per array dimension. Logical axes, and what they mean on a 1-D mesh of N devices:

    "heads"     query heads (q columns, o rows): split N ways, whole heads per device
    "kv_heads"  key/value heads (k/v columns): split N ways; when num_kv_heads < N the
                heads are first repeated at load time so every device owns whole heads
    "mlp"       MLP hidden units (gate/up/fc_in columns, down/fc_out rows)
    "vocab"     vocabulary rows of the embedding, columns of the LM head
    "experts"   the leading axis of a MoE layer's stacked expert weights f[E, ...]:
                each device owns E/N whole experts (expert parallelism, models/moe.py)
    None        replicated

Megatron style: q/k/v and gate/up (fc_in) are column-parallel, o and down (fc_out)
row-parallel, so each attention block and each MLP needs one all-reduce, which XLA's
SPMD partitioner inserts. Biases of column-parallel matrices are split with them; biases
of row-parallel ones are replicated (added once, after the reduction). Norms replicated.

This module computes specs and shapes only; the mesh itself lives in
paged_jax.worker.sharding.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paged_jax.models.config import ModelConfig
from paged_jax.models.weights import WeightRule

TP_AXIS = "tp"  # the name of the one mesh axis tensor parallelism splits over
LOGICAL_AXES = ("heads", "kv_heads", "mlp", "vocab", "experts")

# (regex searched in "a/b/0/c", logical axis per dimension); the first match wins.
PartitionRules = tuple[tuple[str, tuple[str | None, ...]], ...]

# The attention and norm rules every family shares (param names are the decoder's).
ATTENTION_RULES: PartitionRules = (
    (r"attn/q_proj/kernel$", (None, "heads")),
    (r"attn/q_proj/bias$", ("heads",)),
    (r"attn/[kv]_proj/kernel$", (None, "kv_heads")),
    (r"attn/[kv]_proj/bias$", ("kv_heads",)),
    (r"attn/o_proj/kernel$", ("heads", None)),
    (r"attn/o_proj/bias$", (None,)),
    (r"norm/(scale|bias)$", (None,)),
)
# Vocab-parallel embedding and LM head (docs/scale_out.md has the measurements behind it).
VOCAB_RULES: PartitionRules = (
    (r"^embed_tokens/embedding$", ("vocab", None)),
    (r"^lm_head/kernel$", (None, "vocab")),
)
# The two MLP shapes: gated (Llama, Qwen2, Mistral) and plain (GPT-2, OPT).
GATED_MLP_RULES: PartitionRules = (
    (r"mlp/(gate|up)_proj/kernel$", (None, "mlp")),
    (r"mlp/(gate|up)_proj/bias$", ("mlp",)),
    (r"mlp/down_proj/kernel$", ("mlp", None)),
    (r"mlp/down_proj/bias$", (None,)),
)
# Mixture of experts: experts split whole over the devices, the router replicated, the
# shared expert (Qwen2-MoE) split like a dense gated MLP; dense layers keep GATED_MLP_RULES.
MOE_RULES: PartitionRules = (
    (r"mlp/router/kernel$", (None, None)),
    (r"mlp/experts/(gate|up|down)_proj$", ("experts", None, None)),
    (r"shared_expert/(gate|up)_proj/kernel$", (None, "mlp")),
    (r"shared_expert/down_proj/kernel$", ("mlp", None)),
    (r"shared_expert_gate/kernel$", (None, None)),
)
PLAIN_MLP_RULES: PartitionRules = (
    (r"mlp/fc_in/kernel$", (None, "mlp")),
    (r"mlp/fc_in/bias$", ("mlp",)),
    (r"mlp/fc_out/kernel$", ("mlp", None)),
    (r"mlp/fc_out/bias$", (None,)),
)


def _path_str(path: Sequence[Any]) -> str:
    return "/".join(str(p) for p in path)


def logical_axes(rules: PartitionRules, path: Sequence[Any]) -> tuple[str | None, ...]:
    """The logical axes of the param at `path` under `rules`.

    Raises:
        ValueError: no rule matches (a family's table must cover every param).
    """
    name = _path_str(path)
    for pattern, axes in rules:
        if re.search(pattern, name):
            return axes
    raise ValueError(f"param {name!r} matches no partition rule; add one to the family's rules")


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """Raises ValueError unless `tp` devices can each own whole query and KV heads."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size={tp!r} must be an int >= 1")
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide num_attention_heads={heads} "
            f"({config.model_type}): every device owns whole query heads"
        )
    if kv % tp and tp % kv:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide num_key_value_heads={kv} or be a "
            f"multiple of it ({config.model_type}): KV heads are split whole or replicated"
        )
    if config.moe is not None and config.moe.num_experts % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide num_experts={config.moe.num_experts} "
            f"({config.model_type}): every device owns whole experts"
        )


def kv_head_replication(config: ModelConfig, tp: int) -> int:
    """How many copies of each KV head the tp-sharded model holds (1 when kv >= tp)."""
    check_tensor_parallel(config, tp)
    return max(1, tp // config.num_key_value_heads)


def tensor_parallel_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config of the sharded model: KV heads repeated up to `tp` when fewer.

    Query head h attends KV head h // (num_heads / num_kv_heads); after repeating each KV
    head r times in place (head j becomes heads j*r .. j*r+r-1) the same query head maps to
    copy h // (num_heads / (num_kv_heads * r)) of the same original head, so outputs are
    unchanged and device d holds the KV heads its query heads read.
    """
    r = kv_head_replication(config, tp)
    if r == 1:
        return config
    return dataclasses.replace(config, num_key_value_heads=config.num_key_value_heads * r)


def repeat_kv_heads(array: Any, axis: int, head_dim: int, repeats: int) -> Any:
    """Repeats each head's `head_dim` block along `axis` `repeats` times, in place order.

    Works on numpy and jax arrays: f[..., kv*head_dim, ...] -> f[..., kv*repeats*head_dim, ...].
    """
    if repeats == 1:
        return array
    axis = axis % array.ndim
    shape = array.shape
    heads = shape[axis] // head_dim
    split = (*shape[:axis], heads, head_dim, *shape[axis + 1 :])
    xp = np if isinstance(array, np.ndarray) else jnp
    out = xp.repeat(array.reshape(split), repeats, axis=axis)
    return out.reshape(*shape[:axis], heads * repeats * head_dim, *shape[axis + 1 :])


def kv_repeat_transform(
    rules: PartitionRules, path: Sequence[Any], config: ModelConfig, tp: int
) -> Callable[[Any], Any] | None:
    """A function that repeats the KV heads of the param at `path`, or None if none needed."""
    r = kv_head_replication(config, tp)
    axes = logical_axes(rules, path)
    if r == 1 or "kv_heads" not in axes:
        return None
    axis = axes.index("kv_heads")
    return lambda a: repeat_kv_heads(a, axis, config.head_dim, r)


def partition_spec(
    axes: tuple[str | None, ...], shape: tuple[int, ...], tp: int
) -> tuple[tuple[str | None, ...], bool]:
    """(mesh axis per dim, replicated-instead flag) for a param of `shape`.

    A logically split dim that `tp` does not divide (a vocabulary of 50257 rows on 2
    devices) is replicated instead, and the flag says so; heads were checked up front.
    """
    if len(axes) != len(shape):
        raise ValueError(f"rule axes {axes} do not fit a param of shape {shape}")
    spec, fallback = [], False
    for ax, size in zip(axes, shape):
        if ax is None or tp == 1:
            spec.append(None)
        elif ax not in LOGICAL_AXES:
            raise ValueError(f"logical axis {ax!r} must be one of {LOGICAL_AXES} or None")
        elif size % tp:
            assert ax not in ("heads", "kv_heads", "experts"), (
                "a head or expert dim that tp does not divide reached partition_spec: "
                "check_tensor_parallel should have refused this config"
            )
            spec.append(None)
            fallback = True
        else:
            spec.append(TP_AXIS)
    return tuple(spec), fallback


def shard_shape(shape: tuple[int, ...], spec: tuple[str | None, ...], tp: int) -> tuple[int, ...]:
    """The per-device shape of an array of `shape` split by `spec` over `tp` devices."""
    return tuple(s // tp if ax is not None else s for s, ax in zip(shape, spec))


def per_device_param_bytes(
    shapes: Sequence[tuple[Sequence[Any], tuple[int, ...], int]], rules: PartitionRules, tp: int
) -> int:
    """Per-device bytes of params given as (path, global shape, itemsize) under `rules`."""
    total = 0
    for path, shape, itemsize in shapes:
        spec, _ = partition_spec(logical_axes(rules, path), tuple(shape), tp)
        total += math.prod(shard_shape(tuple(shape), spec, tp)) * itemsize
    return total


def tensor_parallel_weight_rules(
    rules: Sequence[WeightRule], partition_rules: PartitionRules, config: ModelConfig, tp: int
) -> list[WeightRule]:
    """The checkpoint table of the tp-sharded model: KV-head params gain a head repeat.

    `rules` are the family's table for the original `config` (so checkpoint shapes are
    still checked as stored); the repeat runs on the host, before any device sees it.
    """
    out = []
    for rule in rules:
        repeat = kv_repeat_transform(partition_rules, rule.param_path, config, tp)
        if repeat is not None:
            rule = dataclasses.replace(rule, transform=_compose(rule.transform, repeat))
        out.append(rule)
    return out


def _compose(first: Callable[[Any], Any], second: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda a: second(first(a))


def param_shardings(
    partition_rules: PartitionRules, state: Any, mesh: Mesh
) -> tuple[dict[tuple[Any, ...], NamedSharding], list[str]]:
    """(param path -> NamedSharding on `mesh`, names of params replicated by fallback).

    Args:
        partition_rules: the family's rules.
        state: an nnx.State (arrays or ShapeDtypeStructs) of the tp-sharded model.
        mesh: a 1-D mesh whose axis is named TP_AXIS.
    """
    from flax import nnx

    if tuple(mesh.axis_names) != (TP_AXIS,):
        raise ValueError(f"mesh.axis_names={mesh.axis_names!r} must be ({TP_AXIS!r},)")
    tp = mesh.size
    shardings, fallbacks = {}, []
    for path, var in nnx.to_flat_state(state):
        shape = tuple(var.get_value().shape)
        spec, fallback = partition_spec(logical_axes(partition_rules, path), shape, tp)
        shardings[tuple(path)] = NamedSharding(mesh, PartitionSpec(*spec))
        if fallback:
            fallbacks.append(_path_str(path))
    return shardings, fallbacks
