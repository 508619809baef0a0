"""The names and ids callers share with the kernels package, importable without jax.

Configs and command lines validate against these tuples before any device code loads,
and the host block manager hands out block ids around the null block, so this module
holds only plain values: ``Literal`` types, their tuples, the null block's id and the
decode work list's two sizes.
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

# Decode work lists (plan.py; also modelled by roofline.py without jax): the programs a
# decode call aims for (2 per SM of a 132-SM H200/H100), and the smallest key chunk of
# one program (below it, writing and merging a partial output costs more than it buys).
DECODE_TARGET_PROGRAMS = 264
MIN_CHUNK_TOKENS = 512

__all__ = [
    "DECODE_TARGET_PROGRAMS",
    "MIN_CHUNK_TOKENS",
    "NULL_BLOCK_ID",
    "BACKEND_NAMES",
    "FP8_KV_CACHE_DTYPE_NAMES",
    "AttentionBackend",
    "Fp8KVCacheDtype",
]
