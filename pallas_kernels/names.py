"""The names and ids callers share with the kernels package, importable without jax.

Configs and command lines validate against these tuples before any device code loads,
and the host block manager hands out block ids around the null block, so this module
holds only plain values: ``Literal`` types, their tuples and the null block's id.
"""

from __future__ import annotations

from typing import Literal, get_args

# "auto": Pallas kernels on GPU, the pure-JAX reference elsewhere (backend.py).
AttentionBackend = Literal["auto", "pallas", "pallas_interpret", "reference"]
BACKEND_NAMES: tuple[str, ...] = get_args(AttentionBackend)

# The fp8 KV-cache dtypes the kernels store and read (quantization.py maps them to dtypes).
Fp8KVCacheDtype = Literal["fp8_e4m3", "fp8_e5m2"]
FP8_KV_CACHE_DTYPE_NAMES: tuple[str, ...] = get_args(Fp8KVCacheDtype)

# Block 0 pads every block table; its contents never reach an output (layout.py).
NULL_BLOCK_ID = 0

__all__ = [
    "NULL_BLOCK_ID",
    "BACKEND_NAMES",
    "FP8_KV_CACHE_DTYPE_NAMES",
    "AttentionBackend",
    "Fp8KVCacheDtype",
]
