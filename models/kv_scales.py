"""Per-layer fp8 KV-cache scales: read from a checkpoint, or calibrated from prompts.

Both give f32[num_layers, 2] (k_scale, v_scale); the loader stores them on the model as
``model.kv_cache_scales`` (a tuple of (k, v) float pairs) and the engine's runner starts
from them when EngineConfig.kv_cache_dtype is fp8 (otherwise 1.0; see
docs/fp8_kv_cache.md). Stored fp8 value = x / scale, read value = fp8 * scale.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# llm-compressor / compressed-tensors: model.layers.N.self_attn.{k,v}_scale; older fp8
# checkpoints: one model.layers.N.self_attn.kv_scale for both.
KV_SCALE_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|attn)\.(k|v|kv)_scale$")
# vLLM's calibration constants: scale = max|x| / constant (headroom below e4m3's 448).
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


def read_kv_scales(
    keys: Iterable[str], read: Callable[[str], np.ndarray], num_layers: int
) -> np.ndarray | None:  # f32[num_layers, 2] or None when the checkpoint has no scales
    """Collects k_scale/v_scale (or kv_scale) tensors per layer from checkpoint keys.

    Raises:
        ValueError: some layers or one of K/V lack a scale, or a scale is not a positive
            scalar (naming the key).
    """
    found: dict[tuple[int, int], float] = {}
    for key in keys:
        match = KV_SCALE_KEY.search(key)
        if match is None:
            continue
        value = np.asarray(read(key), np.float32)
        if value.size != 1 or not np.isfinite(value).all() or float(value.reshape(())) <= 0:
            raise ValueError(f"checkpoint tensor {key}={value!r} must be one positive scale")
        layer, kind = int(match.group(1)), match.group(2)
        for col in {"k": (0,), "v": (1,), "kv": (0, 1)}[kind]:
            found[(layer, col)] = float(value.reshape(()))
    if not found:
        return None
    missing = [
        f"layer {i} {'kv'[c]}_scale"
        for i in range(num_layers)
        for c in (0, 1)
        if (i, c) not in found
    ]
    if missing:
        raise ValueError(f"checkpoint has fp8 KV scales for some layers only; missing {missing}")
    return np.asarray([[found[(i, 0)], found[(i, 1)]] for i in range(num_layers)], np.float32)


def calibrate_kv_scales(
    model, prompts: Sequence[Sequence[int]]
) -> np.ndarray:  # f32[num_layers, 2]
    """vLLM's one-shot calibration: per layer max|K| / 200 and max|V| / 100 over `prompts`.

    Runs the dense forward of a ``paged_jax.models`` CausalLM on each prompt and takes
    the absolute maximum of every layer's K and V (after rotary, as they are cached).
    Assign the result to ``model.kv_cache_scales`` before building the engine.
    """
    num_layers = len(model.layers)
    amax = np.zeros((num_layers, 2), np.float32)
    for prompt in prompts:
        ids = jnp.asarray([list(prompt)], jnp.int32)
        amax = np.maximum(amax, np.asarray(_kv_amax(model, ids)))
    amax = np.where(amax > 0, amax, 1.0)
    return (amax / np.asarray([K_SCALE_CONSTANT, V_SCALE_CONSTANT], np.float32)).astype(np.float32)


def _kv_amax(model, input_ids):  # i32[1, L] -> f32[num_layers, 2]
    """The dense forward, recording each layer's max|K| and max|V| on the way."""
    seq = input_ids.shape[1]
    positions = jnp.arange(seq, dtype=jnp.int32)[None, :]
    x = model.embed(input_ids, positions)
    rows = []
    for layer in model.layers:

        def attend(h, layer=layer):
            _, k, v = layer.attn.qkv(h, positions)
            amax = jnp.stack([jnp.max(jnp.abs(k)), jnp.max(jnp.abs(v))]).astype(jnp.float32)
            return layer.attn(h, positions), amax

        x, amax = layer.apply(x, attend)
        rows.append(amax)
    return jax.device_get(jnp.stack(rows))


def as_scale_pairs(scales: np.ndarray) -> tuple[tuple[float, float], ...]:
    """f32[num_layers, 2] -> ((k, v), ...): a hashable form an NNX module can hold."""
    return tuple((float(k), float(v)) for k, v in np.asarray(scales, np.float32))
