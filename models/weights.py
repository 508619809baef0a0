"""The HF-name -> param-path tables: one WeightRule per (checkpoint tensor, model param).

Families build their table from these helpers; the loader checks a checkpoint's key set
and every shape against the table before it converts anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

ParamPath = tuple[str | int, ...]


def _identity(array: np.ndarray) -> np.ndarray:
    return array


def _transpose(array: np.ndarray) -> np.ndarray:
    return array.T


@dataclasses.dataclass(frozen=True)
class WeightRule:
    """One checkpoint tensor feeding one model parameter.

    Several rules may read the same tensor (GPT-2's fused c_attn feeds q, k and v).

    Attributes:
        hf_name: key in the safetensors files, e.g. "model.layers.0.self_attn.q_proj.weight".
        hf_shape: shape the tensor must have in the checkpoint.
        param_path: path of the nnx.Param in the model, e.g. ("layers", 0, "attn", "q_proj",
            "kernel").
        transform: maps the checkpoint array to the param's layout (transpose, column slice).
        stack: (index, count): the tensor is slice `index` of a param stacked from `count`
            tensors along a new leading axis (one MoE expert of f[E, ...]); None: the
            tensor is the whole param.
    """

    hf_name: str
    hf_shape: tuple[int, ...]
    param_path: ParamPath
    transform: Callable[[np.ndarray], np.ndarray] = _identity
    stack: tuple[int, int] | None = None


def torch_linear(
    hf_prefix: str, path: ParamPath, in_dim: int, out_dim: int, *, bias: bool
) -> list[WeightRule]:
    """A torch nn.Linear (weight f[out, in]) -> nnx.Linear (kernel f[in, out], bias f[out])."""
    rules = [WeightRule(f"{hf_prefix}.weight", (out_dim, in_dim), (*path, "kernel"), _transpose)]
    if bias:
        rules.append(WeightRule(f"{hf_prefix}.bias", (out_dim,), (*path, "bias")))
    return rules


def conv1d_columns(
    hf_prefix: str, path: ParamPath, in_dim: int, total_out: int, start: int, stop: int
) -> list[WeightRule]:
    """Columns [start, stop) of a GPT-2 Conv1D (weight f[in, out], already x @ W) with bias."""

    def take_weight(w: np.ndarray) -> np.ndarray:
        return w[:, start:stop]

    def take_bias(b: np.ndarray) -> np.ndarray:
        return b[start:stop]

    return [
        WeightRule(f"{hf_prefix}.weight", (in_dim, total_out), (*path, "kernel"), take_weight),
        WeightRule(f"{hf_prefix}.bias", (total_out,), (*path, "bias"), take_bias),
    ]


def norm(hf_prefix: str, path: ParamPath, dim: int, *, bias: bool) -> list[WeightRule]:
    """RMSNorm / LayerNorm: weight -> scale, bias -> bias."""
    rules = [WeightRule(f"{hf_prefix}.weight", (dim,), (*path, "scale"))]
    if bias:
        rules.append(WeightRule(f"{hf_prefix}.bias", (dim,), (*path, "bias")))
    return rules


def embedding(hf_name: str, path: ParamPath, rows: int, dim: int) -> list[WeightRule]:
    """nn.Embedding weight f[rows, dim] -> nnx.Embed embedding f[rows, dim]."""
    return [WeightRule(hf_name, (rows, dim), (*path, "embedding"))]


def stacked_torch_linears(
    hf_prefixes: list[str], path: ParamPath, in_dim: int, out_dim: int
) -> list[WeightRule]:
    """One torch nn.Linear per expert (weight f[out, in], no bias) -> one param f[E, in, out].

    The experts' weights become a single stacked array, so a grouped matmul takes them
    as one operand and expert parallelism splits its leading axis.
    """
    count = len(hf_prefixes)
    return [
        WeightRule(f"{prefix}.weight", (out_dim, in_dim), path, _transpose, stack=(e, count))
        for e, prefix in enumerate(hf_prefixes)
    ]
