"""FP8 KV cache: per-tensor scales, a saturating cast on write, dequantization on read.

    stored = fp8(clip(x / scale, -max, max))        (write_kv, round to nearest even)
    K, V   = f32(stored) * scale                    (attention, exact: fp8 fits in bf16)

The read side never materialises the dequantized cache: the kernels and the references
cast the fp8 tile to q's dtype (exact), take q . k with f32 accumulation and multiply the
scores by k_scale; they multiply the attention output by v_scale (softmax weights sum to
one, so p @ (v_scale V) = v_scale (p @ V)). Scales are f32 scalars passed as traced
values: changing them never recompiles. Unscaled casts would turn |x| > max into NaN
(e4m3fn has no inf) or inf (e5m2); the clip saturates instead.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from pallas_kernels.names import Fp8KVCacheDtype

# names.FP8_KV_CACHE_DTYPE_NAMES -> cache dtypes (EngineConfig.kv_cache_dtype's "auto" is
# the model dtype: no entry).
FP8_KV_CACHE_DTYPES: dict[Fp8KVCacheDtype, jnp.dtype] = {
    "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn),
    "fp8_e5m2": jnp.dtype(jnp.float8_e5m2),
}
FP8_DTYPES = tuple(FP8_KV_CACHE_DTYPES.values())


def is_fp8(dtype: Any) -> bool:
    """Whether `dtype` is one of the fp8 KV-cache dtypes (e4m3fn, e5m2)."""
    return jnp.dtype(dtype) in FP8_DTYPES


def quantize(x, scale, dtype):  # f[...] -> dtype[...]
    """Cast to the cache dtype; for fp8, divide by `scale` (f32 scalar) and saturate first.

    Traceable inside Pallas kernels (elementwise ops only). For a non-fp8 `dtype` it is a
    plain cast and `scale` is ignored.
    """
    if not is_fp8(dtype):
        return x.astype(dtype)
    limit = float(jnp.finfo(dtype).max)
    y = x.astype(jnp.float32) / scale
    return jnp.clip(y, -limit, limit).astype(dtype)


def kv_scales_array(k_scale, v_scale):  # -> f32[2]
    """[k_scale, v_scale] as one f32 array (None means 1.0), the kernels' scale operand."""
    one = jnp.ones((), jnp.float32)
    k = one if k_scale is None else jnp.asarray(k_scale, jnp.float32)
    v = one if v_scale is None else jnp.asarray(v_scale, jnp.float32)
    return jnp.stack([k, v])
