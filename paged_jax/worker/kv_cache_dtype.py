"""KV-cache dtype and per-layer fp8 scales for the runner (EngineConfig.kv_cache_dtype).

The scales are one f32[num_layers, 2] device array ([:, 0] = k_scale, [:, 1] = v_scale),
a step argument like the weights: new values never recompile the step. Where they come
from, in order: ``model.kv_cache_scales`` (set by the loader from a checkpoint's
k_scale/v_scale tensors, or by ``paged_jax.models.calibrate_kv_scales``), else 1.0.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from paged_jax.constants import KV_CACHE_DTYPE_ALIASES
from pallas_kernels.quantization import FP8_KV_CACHE_DTYPES


def kv_cache_jnp_dtype(name: str) -> jnp.dtype | None:
    """The cache dtype of an EngineConfig.kv_cache_dtype name; None for "auto" (model dtype)."""
    if name == "auto":
        return None
    name = KV_CACHE_DTYPE_ALIASES.get(name, name)
    if name not in FP8_KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={name!r} must be one of 'auto', 'fp8', {list(FP8_KV_CACHE_DTYPES)}"
        )
    return FP8_KV_CACHE_DTYPES[name]


def check_kv_scales(scales: Any, num_layers: int) -> np.ndarray:
    """Returns `scales` as f32[num_layers, 2]; ValueError unless finite and positive."""
    arr = np.asarray(scales, np.float32)
    if arr.shape != (num_layers, 2):
        raise ValueError(
            f"kv_cache_scales has shape {arr.shape}; expected ({num_layers}, 2) "
            "(per layer: k_scale, v_scale)"
        )
    if not (np.isfinite(arr).all() and (arr > 0).all()):
        raise ValueError(f"kv_cache_scales={arr.tolist()!r} must be finite and > 0")
    return arr


def initial_kv_scales(model: Any, num_layers: int) -> np.ndarray:  # f32[num_layers, 2]
    """The model's own scales (checkpoint or calibration) if it has them, else all 1.0."""
    scales = getattr(model, "kv_cache_scales", None)
    if scales is None:
        return np.ones((num_layers, 2), np.float32)
    return check_kv_scales(scales, num_layers)
