"""Version shims for the Pallas Triton lowering (jax 0.10 - 0.12)."""

from __future__ import annotations

from jax.experimental import pallas as pl

try:  # jax >= 0.4.3x spells it CompilerParams; older releases TritonCompilerParams.
    from jax.experimental.pallas.triton import CompilerParams as _TritonParams
except ImportError:  # pragma: no cover - depends on the installed jax
    from jax.experimental.pallas.triton import TritonCompilerParams as _TritonParams

from jax.experimental.pallas import triton as plgpu

# A squeezed block dimension: pl.squeezed on jax >= 0.7, None before.
SQUEEZED = getattr(pl, "squeezed", None)

masked_load = plgpu.load
masked_store = plgpu.store


def triton_params(num_warps: int, num_stages: int):
    """Explicit Triton compiler params: since jax 0.9 these select the Triton lowering
    on GPU (the default otherwise is Mosaic GPU, which these kernels do not target)."""
    return _TritonParams(num_warps=num_warps, num_stages=num_stages)
