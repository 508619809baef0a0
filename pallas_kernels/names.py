"""The names and ids callers share with the kernels package, importable without jax.

Configs and command lines validate against these tuples before any device code loads,
and the host block manager hands out block ids around the null block, so this module
holds only plain values: ``Literal`` types, their tuples, the null block's id, the
decode work list's two sizes, ceiling division (blocks of a length, on static ints; the
host side's ``paged_jax.constants.cdiv`` is this one), and the jax version the Mosaic GPU
kernels need (with the pure-string check of it, so a backend check loads no kernel module).
"""

from __future__ import annotations

from typing import Literal, get_args

# "auto": Pallas kernels on GPU, the pure-JAX reference elsewhere (backend.py).
# "mosaic_gpu": the Mosaic GPU attention kernels (Hopper or newer, jax >= 0.11.2);
# "mosaic_gpu_interpret": the same in GPU interpret mode on CPU (tests).
AttentionBackend = Literal[
    "auto", "pallas", "pallas_interpret", "reference", "mosaic_gpu", "mosaic_gpu_interpret"
]
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

# Oldest jax the Mosaic kernels are tested on: plgpu.kernel(out_type=, scratch_types=)
# and GPU interpret mode (plgpu.InterpretGPUParams; jax 0.10.2 has the first, not the
# second, so nothing could test the kernels there). jax 0.11.2 is the GPU machine's;
# what it lacks beside 0.12 is bridged in mosaic_compat.py.
MOSAIC_MIN_JAX_VERSION = (0, 11, 2)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of Python ints: blocks needed for `a` tokens of `b` per block."""
    return -(-a // b)


def version_tuple(version: str) -> tuple[int, ...]:
    """A version string's first three numeric parts, e.g. "0.12.0.1" -> (0, 12, 0)."""
    parts = []
    for p in version.split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def mosaic_jax_reason(jax_version: str) -> str | None:
    """None when this jax version runs the Mosaic GPU kernels, else a one-line reason."""
    if version_tuple(jax_version) < MOSAIC_MIN_JAX_VERSION:
        need = ".".join(map(str, MOSAIC_MIN_JAX_VERSION))
        return f"the Mosaic GPU kernels need jax >= {need}, found jax {jax_version}"
    return None


__all__ = [
    "MOSAIC_MIN_JAX_VERSION",
    "mosaic_jax_reason",
    "version_tuple",
    "cdiv",
    "DECODE_TARGET_PROGRAMS",
    "MIN_CHUNK_TOKENS",
    "NULL_BLOCK_ID",
    "BACKEND_NAMES",
    "FP8_KV_CACHE_DTYPE_NAMES",
    "AttentionBackend",
    "Fp8KVCacheDtype",
]
