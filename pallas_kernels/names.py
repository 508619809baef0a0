"""The names callers pass to the kernels package, importable without jax.

Configs and command lines validate against these tuples before any device code loads,
so this module holds only strings: ``Literal`` types and their tuples.
"""

from __future__ import annotations

from typing import Literal, get_args

# "auto": Pallas kernels on GPU, the pure-JAX reference elsewhere (backend.py).
AttentionBackend = Literal["auto", "pallas", "pallas_interpret", "reference"]
BACKEND_NAMES: tuple[str, ...] = get_args(AttentionBackend)

# The fp8 KV-cache dtypes the kernels store and read (quantization.py maps them to dtypes).
Fp8KVCacheDtype = Literal["fp8_e4m3", "fp8_e5m2"]
FP8_KV_CACHE_DTYPE_NAMES: tuple[str, ...] = get_args(Fp8KVCacheDtype)

__all__ = ["BACKEND_NAMES", "FP8_KV_CACHE_DTYPE_NAMES", "AttentionBackend", "Fp8KVCacheDtype"]
