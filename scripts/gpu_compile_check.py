"""Compile every Pallas kernel, and whole engine steps, for an H200 with no GPU present.

XLA runs its whole GPU pipeline (HLO passes, Triton -> PTX -> cubin) against a GPU
*target config* when it has no device client: a deviceless compile. Per case this script
lowers the kernel for a compile-only H200 device, compiles it (dumping each kernel's
PTX), reads the launch (grid, threads, dynamic shared memory) from XLA's thunk list,
and assembles the PTX with both nvJitLink and ptxas for sm_90a (a real machine may take
either path; their register counts differ) to read registers and spills.

One JSON row per (case, kernel). The run fails on any compile error, any shape the
kernels' own validation rejects, any spill in a kernel of any dtype (f32 included), or
dynamic shared memory over the per-block limit; the only exceptions are the probes in
KNOWN_EXPECTED_FAILURES (tiles a GPU rejects too), which fail if they ever pass.
Each row also says how the kernel's tiles reach shared memory (cp.async copies, the
deepest wait_group, K/V buffers in flight in its main loop: `ptx_buffering`).

Mosaic GPU cases (names "mosaic-...": pallas_kernels.mosaic_decode / mosaic_ragged,
obtained through ``get_attention_ops("mosaic_gpu", target=<the compile-only H200>)``)
compile to a ``mosaic_gpu_v2`` custom call. With jax 0.11.2 + jax-cuda13-plugin the
custom call runs Mosaic's whole pipeline during XLA's compile, deviceless too: MLIR ->
PTX -> ptxas -> cubin (Mosaic runs ptxas itself; its -v report, asked for with
MOSAIC_GPU_DUMP_PTXAS=1, gives registers and spills: ``mosaic_compile_report``), and
Mosaic's own SMEM scratch size (MOSAIC_GPU_DUMP_RESOURCES=1) is the row's smem_bytes.
Where no report comes back (a jax whose custom call builds the cubin only when the
executable is loaded on a device; the first Mosaic rows, jax 0.12 + CUDA 12.9, were
recorded as such without asking for the report), registers and spills read "deferred to
load time" (``deferred``, not a failure) and smem_bytes is the kernel's own estimate
(``mosaic_decode.smem_bytes``). Rows also check that the custom call is in the optimized
HLO and give the grid as the kernel passes it to ``plgpu.kernel``.

Mixture-of-experts steps ("step-mixtral-tiny-...", "step-qwen3moe-...": a tiny Mixtral and
two layers at Qwen3-30B-A3B's shape; each grouped matmul of paged_jax.models.moe, and
experts split over two devices) add ``moe_lowering`` to their rows: the matrix-multiply
ops XLA made of the experts' grouped matmul (the ops under moe.EXPERT_MATMUL_SCOPE in the
optimized HLO: fusion kind or custom-call target, shape, and the rows x contraction of
each), which shows whether ``jax.lax.ragged_dot`` became a grouped GEMM or a dense
product over every expert.

Step rows also carry the compiled step's memory analysis (per device): the KV pool's
bytes, one layer's K + V, and the argument, output, aliased and temporary bytes. A step
whose KV pool is not aliased input-to-output (not donated: copied into a new output)
fails, and so does a full-depth step (the deployment's whole pool) whose temporaries
reach 5% of the pool.

Needs a jax CUDA plugin and the NVIDIA assemblers of the same CUDA major in the venv
(find_toolchain: jax-cuda12-plugin + the -cu12 wheels, or jax-cuda13-plugin + the CUDA 13
wheels; scripts/gpu_compile_check.sh installs either) and JAX_PLATFORMS=cpu, so no CUDA
client is ever created. The report's header and every row name the toolchain.

    python scripts/gpu_compile_check.py --grid ci
    python scripts/gpu_compile_check.py --grid smoke     # CI's cuda12 grid: 7 of ci's cases
    python scripts/gpu_compile_check.py --grid full      # writes docs/gpu_compile_h200.json
                                                         # (CUDA 13: ..._cuda13.json)
    python scripts/gpu_compile_check.py --toolchains A.json B.json   # side by side
    python scripts/gpu_compile_check.py --memory A.json B.json       # the steps' memory
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import importlib.util
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from pallas_kernels import roofline
from pallas_kernels.names import cdiv

FULL_OUTPUT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "gpu_compile_h200.json"
CI_OUTPUT = FULL_OUTPUT.parents[1] / "bench_results" / "gpu_compile_ci.json"


def default_output(grid: str, cuda: str) -> pathlib.Path:
    """Where a run writes without --output: the cuda12 paths above, "_cuda13" added for the
    CUDA 13 toolchain (docs/gpu_compile_h200_cuda13.json for --grid full)."""
    path = FULL_OUTPUT if grid == "full" else CI_OUTPUT
    return path if cuda == "cuda12" else path.with_name(f"{path.stem}_{cuda}{path.suffix}")


# A minimal stream_executor.GpuTargetConfigProto of an H200 (sm_90, 132 SMs). The device
# string becomes the device kind, from which Pallas picks compute capability 9.0.
TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 151397597184
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 patch: 0 }
runtime_version { major: 12 minor: 8 patch: 0 }
device_description_str: "NVIDIA H200"
"""
# The CUDA runtime each toolchain's target config names (CUDA 13: the GPU machine's 13.0).
RUNTIME_VERSION = {"cuda12": (12, 8), "cuda13": (13, 0)}


def target_config(cuda: str = "cuda12") -> str:
    """TARGET_CONFIG with the runtime version of the `cuda` toolchain."""
    major, minor = RUNTIME_VERSION[cuda]
    return TARGET_CONFIG.replace(
        "runtime_version { major: 12 minor: 8 patch: 0 }",
        f"runtime_version {{ major: {major} minor: {minor} patch: 0 }}",
    )


SMEM_LIMIT_BYTES = 232448  # shared_memory_per_block_optin above
ARCH = "sm_90a"
# Cases that must fail, each for a reason a GPU would reject it too: deliberately
# oversized tiles that prove the rule catches what it should. A listed case that passes
# fails the run. No case users run belongs here.
KNOWN_EXPECTED_FAILURES = {
    "probe-decode-f32-d256-g4-bs16-b8x32k-bk1024": (
        "block_k 1024 x head_dim 256 x f32 is 1 MiB per K tile, over the 232,448 B "
        "shared memory an H200 block may use"
    ),
}
# Every cache dtype the kernels accept (pallas_kernels.validation.CACHE_DTYPES), by name.
GRID_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2")
HEAD_DIMS = (64, 128, 256, 80, 96)
KERNEL_NAMES = (
    "paged_decode_attention",
    "ragged_paged_attention",
    "paged_write_kv",
    "paged_copy_blocks",
)
MOSAIC_KERNEL_NAMES = {
    "decode": "paged_decode_attention_mosaic",
    "ragged": "ragged_paged_attention_mosaic",
}
MOSAIC_CUSTOM_CALL = "mosaic_gpu_v2"
MOSAIC_DEFERRED = (
    "registers, spills: deferred to load time (Mosaic's compile gave no ptxas report "
    "deviceless); smem_bytes: the kernel's own estimate (mosaic_decode.smem_bytes)"
)
NUM_KV_HEADS = 8
POOL_BYTES = 100 * 2**30  # at most this much K + V per kernel case (an H200 holds 141 GB)


@dataclass(frozen=True)
class Case:
    """One compile: a kernel at one shape, or a whole engine step of one model.

    Attributes:
        kernel: "decode", "ragged", "write_kv", "copy_blocks" or "step".
        dtype: KV cache dtype; q/new K/V are bf16 for an fp8 cache, else the same.
        group: q heads per KV head (GQA group).
        batch: Sequences (decode, ragged, step), copies (copy_blocks) or tokens (write_kv).
        context: Tokens of context per sequence (decode, ragged: the longest).
        prefill: Ragged: new-token counts of the prefill chunks; the other
            ``batch - len(prefill)`` sequences are decodes (one new token each).
        model: Step cases: "llama8b" or "gemma2" (two layers each unless num_layers).
        block_k: Attention: keys per step, when not the kernels' default (probes).
        decode_only: Step cases: the decode-only bucket (decode kernel), else mixed.
        tp: Step cases: tensor-parallel devices (compile-only H200s of one host).
        backend: Attention cases: "triton" (pallas_kernels' Triton kernels) or "mosaic"
            (the Mosaic GPU kernels).
        num_layers: Step cases: the model's depth (0: the model's two layers).
        scan_layers: Step cases: EngineConfig.scan_layers (False: layers unrolled).
        expert_matmul: MoE step cases: the grouped matmul (moe.EXPERT_MATMULS).
        quantization: Step cases: "int8" / "fp8" 8-bit weights (EngineConfig.quantization;
            "": the model dtype's).
        weight_block: Step cases with fp8 weights: b of block-wise fp8 weights (scales per
            b x b tile, as a fine-grained fp8 checkpoint loads); 0: per channel.
    """

    name: str
    kernel: str
    dtype: str = "bfloat16"
    head_dim: int = 128
    group: int = 4
    block_size: int = 16
    batch: int = 64
    context: int = 8192
    prefill: tuple[int, ...] = ()
    sliding_window: int | None = None
    soft_cap: float | None = None
    num_splits: int | None = None
    block_k: int | None = None
    model: str = ""
    decode_only: bool = False
    tp: int = 1
    backend: str = "triton"
    num_layers: int = 0
    scan_layers: bool = True
    expert_matmul: str = ""
    quantization: str = ""
    weight_block: int = 0

    @property
    def q_dtype(self) -> str:
        return "bfloat16" if self.dtype.startswith("float8") else self.dtype

    @property
    def num_tokens(self) -> int:
        """Ragged/step: q rows (prefill chunks + one per decode)."""
        return sum(self.prefill) + self.batch - len(self.prefill)


_SHORT = {
    "bfloat16": "bf16",
    "float16": "f16",
    "float32": "f32",
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
}


def _case(kernel: str, **kw) -> Case:
    """A Case named from its fields that differ from the defaults."""
    c = Case(name="", kernel=kernel, **kw)
    parts = [kernel, _SHORT[c.dtype], f"d{c.head_dim}", f"g{c.group}", f"bs{c.block_size}"]
    if kernel in ("decode", "ragged"):
        parts.append(f"b{c.batch}x{c.context // 1024}k" if c.context >= 1024 else f"b{c.batch}")
    else:
        parts.append(f"n{c.batch}")
    if c.prefill:
        parts.append("pf" + "+".join(map(str, c.prefill)))
    if c.sliding_window:
        parts.append(f"win{c.sliding_window}")
    if c.soft_cap:
        parts.append(f"cap{c.soft_cap:g}")
    if c.num_splits:
        parts.append(f"split{c.num_splits}")
    if c.block_k:
        parts.append(f"bk{c.block_k}")
    return dataclasses.replace(c, name="-".join(parts))


def mosaic(kernel: str, **kw) -> Case:
    """A Mosaic GPU attention case (named "mosaic-...")."""
    c = _case(kernel, backend="mosaic", **kw)
    return dataclasses.replace(c, name=f"mosaic-{c.name}")


# The Mosaic kernels at the shapes they lower for (head_dim 64/128, block_size 16/32; the
# default tiling at head_dim 80/96/256 fails Mosaic's layout inference, so those are left
# out). The first is --grid ci's.
def mosaic_cases() -> list[Case]:
    """The Mosaic GPU decode and ragged kernels, bf16 and fp8, at Llama-3-8B heads."""
    pf = dict(batch=64, context=4096, prefill=(256,))  # a 256-token chunk and 63 decodes
    return [
        mosaic("decode", batch=64, context=2048),
        mosaic("decode", dtype="float8_e4m3fn", batch=64, context=2048),
        mosaic("ragged", **pf),
        mosaic("ragged", dtype="float8_e4m3fn", **pf),
        mosaic("decode", head_dim=64, group=1, block_size=32, batch=64, context=2048),
        mosaic("decode", group=8, batch=64, context=2048),
        mosaic("decode", batch=8, context=32768, sliding_window=4096, soft_cap=50.0),
        mosaic("decode", batch=8, context=32768, num_splits=4),
        mosaic("ragged", sliding_window=4096, soft_cap=50.0, **pf),
    ]


def probe(kernel: str, **kw) -> Case:
    """A deliberately oversized case (named "probe-..."); see KNOWN_EXPECTED_FAILURES."""
    c = _case(kernel, **kw)
    return dataclasses.replace(c, name=f"probe-{c.name}")


# The ragged mix of a typical chunked-prefill step: two prefill chunks and 62 decodes.
MIX = dict(batch=64, context=4096, prefill=(256, 194))


def grid_full() -> list[Case]:
    """Every dtype x head_dim x GQA group x block size for the four kernels, then shape,
    feature and ragged-mix sweeps at the Llama-3-8B heads, then whole engine steps."""
    cases = []
    for dtype in GRID_DTYPES:
        for d in HEAD_DIMS:
            for bs in (16, 32):
                for g in (1, 4, 8):
                    cases.append(_case("decode", dtype=dtype, head_dim=d, group=g, block_size=bs))
                    cases.append(
                        _case("ragged", dtype=dtype, head_dim=d, group=g, block_size=bs, **MIX)
                    )
                cases.append(_case("write_kv", dtype=dtype, head_dim=d, block_size=bs, batch=512))
                cases.append(_case("copy_blocks", dtype=dtype, head_dim=d, block_size=bs, batch=64))
    for dtype in ("bfloat16", "float8_e4m3fn", "float32"):
        for batch, context in ((1, 2048), (1, 32768), (8, 8192), (64, 2048), (256, 2048),
                               (256, 8192), (16, 32768)):  # fmt: skip
            cases.append(_case("decode", dtype=dtype, batch=batch, context=context))
    for dtype in ("bfloat16", "float8_e4m3fn"):
        for d in (80, 96):  # the masked lanes beside the window and cap masks
            kw = dict(head_dim=d, sliding_window=4096, soft_cap=50.0)
            cases.append(_case("decode", dtype=dtype, batch=8, context=32768, **kw))
            cases.append(_case("ragged", dtype=dtype, **dict(MIX, **kw)))
        for kw in (dict(sliding_window=4096), dict(soft_cap=50.0), dict(num_splits=4),
                   dict(num_splits=16), dict(sliding_window=4096, soft_cap=50.0)):  # fmt: skip
            cases.append(_case("decode", dtype=dtype, batch=8, context=32768, **kw))
            cases.append(_case("ragged", dtype=dtype, **dict(MIX, **kw)))
        for mix in (dict(batch=256, context=8192),  # decode tokens only, through ragged
                    dict(batch=1, context=32768, prefill=(8192,)),  # one long prefill chunk
                    dict(batch=256, context=32768, prefill=(2048,)),  # chunk + 255 decodes
                    dict(batch=8, context=2048, prefill=(512,) * 8)):  # fmt: skip
            cases.append(_case("ragged", dtype=dtype, **mix))
        cases.append(_case("write_kv", dtype=dtype, batch=1))
        cases.append(_case("write_kv", dtype=dtype, batch=8192))
        cases.append(_case("copy_blocks", dtype=dtype, batch=256))
    cases += steps()
    return cases + mosaic_cases() + probes()


def probes() -> list[Case]:
    """The KNOWN_EXPECTED_FAILURES cases."""
    return [probe("decode", dtype="float32", head_dim=256, batch=8, context=32768, block_k=1024)]


def steps() -> list[Case]:
    """Whole jitted engine steps: mixed and decode-only buckets of the two-layer models."""
    return [
        Case("step-llama8b-mixed-t512-s64", "step", model="llama8b", batch=64, context=32768,
             prefill=(449,)),
        Case("step-llama8b-decode-s256", "step", model="llama8b", batch=256, context=32768,
             decode_only=True),
        Case("step-gemma2-mixed-t512-s64", "step", model="gemma2", head_dim=256, group=2,
             batch=64, context=8192, prefill=(449,), sliding_window=4096, soft_cap=50.0),
        Case("step-gemma2-decode-s64", "step", model="gemma2", head_dim=256, group=2,
             batch=64, context=8192, decode_only=True, sliding_window=4096, soft_cap=50.0),
        Case("step-llama8b-mixed-t512-s64-tp2", "step", model="llama8b", batch=64,
             context=32768, prefill=(449,), tp=2),
        Case("step-llama8b-decode-s256-tp2", "step", model="llama8b", batch=256,
             context=32768, decode_only=True, tp=2),
    ] + depth_steps() + moe_steps()  # fmt: skip


def moe_steps() -> list[Case]:
    """Mixture-of-experts steps, mixed bucket: a tiny Mixtral (8 experts, top 2) and two
    layers at Qwen3-30B-A3B's shape (128 experts of width 768, top 8), each with the tiled
    grouped matmul and with jax.lax.ragged_dot, and the tiny Mixtral's experts split over
    two devices. The first is --grid ci's. Last, the Qwen3-30B-A3B-shaped decode step with
    block-wise fp8 weights (128 x 128 tiles, as Qwen3-30B-A3B-FP8 loads): its experts'
    block scales vary along the contraction, so each row tile's expert is dequantized in
    turn; temporaries are judged against the 8-bit weights as the int8 Llama step's."""
    tiny = dict(model="mixtral-tiny", head_dim=64, group=2, batch=64, context=4096, prefill=(449,))
    qwen = dict(model="qwen3moe", group=8, batch=64, context=32768, prefill=(449,))
    return [
        Case("step-mixtral-tiny-mixed-t512-s64-tiled", "step", expert_matmul="tiled", **tiny),
        Case("step-mixtral-tiny-mixed-t512-s64-ragged_dot", "step",
             expert_matmul="ragged_dot", **tiny),
        Case("step-mixtral-tiny-mixed-t512-s64-tiled-ep2", "step", expert_matmul="tiled",
             tp=2, **tiny),
        Case("step-mixtral-tiny-mixed-t512-s64-ragged_dot-ep2", "step",
             expert_matmul="ragged_dot", tp=2, **tiny),
        Case("step-qwen3moe-mixed-t512-s64-tiled", "step", expert_matmul="tiled", **qwen),
        Case("step-qwen3moe-mixed-t512-s64-ragged_dot", "step", expert_matmul="ragged_dot",
             **qwen),
        Case("step-qwen3moe-fp8block128-decode-s64", "step", model="qwen3moe", group=8,
             batch=64, context=32768, decode_only=True, expert_matmul="tiled",
             quantization="fp8", weight_block=128),
        Case("step-qwen3moe-fp8block128-unrolled-decode-s64", "step", model="qwen3moe",
             group=8, batch=64, context=32768, decode_only=True, expert_matmul="tiled",
             quantization="fp8", weight_block=128, scan_layers=False),
    ]  # fmt: skip


def depth_steps() -> list[Case]:
    """The Llama mixed step at the 8B model's full depth (32 layers), scanned and unrolled:
    with the scan over layers its compile time stays near the two-layer step's; and the
    decode step at batch 64 with int8 weights (W8A16, docs/quantization.md), whose
    temporaries must stay under MAX_QUANT_TEMP_FRACTION of its 8-bit weights (no step
    holds a dequantized copy of more than one weight matrix)."""
    return [
        Case("step-llama8b-32l-mixed-t512-s64", "step", model="llama8b", batch=64,
             context=32768, prefill=(449,), num_layers=32),
        Case("step-llama8b-32l-unrolled-mixed-t512-s64", "step", model="llama8b", batch=64,
             context=32768, prefill=(449,), num_layers=32, scan_layers=False),
        Case("step-llama8b-32l-int8-decode-s64", "step", model="llama8b", batch=64,
             context=32768, decode_only=True, num_layers=32, quantization="int8"),
    ]  # fmt: skip


def grid_ci() -> list[Case]:
    """A few minutes' subset for CI: each dtype, head_dim and GQA group of the attention
    kernels at least once, both block sizes, window/cap/splits, each kernel at head_dim 80
    and with an fp8 cache, the Llama decode and mixed steps, the TP=2 decode step, one
    Mosaic decode case and the oversized probe."""
    cases = [_case("decode", dtype=dt) for dt in GRID_DTYPES]
    cases += [
        _case("decode", head_dim=64, group=1, block_size=32),
        _case("decode", head_dim=256, group=8),
        _case("decode", head_dim=80),
        _case("decode", batch=8, context=32768, sliding_window=4096, soft_cap=50.0),
        _case("decode", batch=1, context=32768),
        _case("ragged", **MIX),
        _case("ragged", dtype="float8_e4m3fn", **MIX),
        _case("ragged", dtype="float32", **MIX),
        _case("ragged", head_dim=64, group=1, block_size=32, **MIX),
        _case("ragged", head_dim=256, group=8, **MIX),
        _case("ragged", sliding_window=4096, soft_cap=50.0, **MIX),
        _case("ragged", head_dim=80, **MIX),
        _case("write_kv", batch=512),
        _case("write_kv", dtype="float8_e4m3fn", batch=512),
        _case("write_kv", head_dim=80, batch=512),
        _case("copy_blocks", batch=64),
        _case("copy_blocks", dtype="float8_e4m3fn", batch=64),
        _case("copy_blocks", head_dim=80, batch=64),
    ]
    llama = [
        c
        for c in steps()
        if c.model == "llama8b" and (c.tp == 1 or c.decode_only) and c.scan_layers
    ]
    return cases + llama + moe_steps()[:1] + mosaic_cases()[:1] + probes()


# --grid smoke: the second toolchain's CI grid, a few of --grid ci's cases (CI's 35-minute
# budget; the GPU machine's toolchain, CUDA 13, compiles --grid ci whole). One case of each
# kernel at the Llama-3-8B heads, the fp8 ragged mix, the two-layer Llama-3-8B mixed step
# (ragged attention and write_kv inside one jitted step, the KV pool aliased; the 32-layer
# step's deployment fit is judged under CUDA 13, where it is 45 s of one core more) and
# the oversized probe. Under
# the same venv the newest-jax test stage also compiles tests/pallas_kernels/
# test_gpu_compile_check.py's toolchain cases (head_dim 64 and 80 decode, copy_blocks, the
# Mosaic decode, the tiny MoE step).
SMOKE_CASES = (
    "decode-bf16-d128-g4-bs16-b64x8k",
    "ragged-bf16-d128-g4-bs16-b64x4k-pf256+194",
    "ragged-e4m3-d128-g4-bs16-b64x4k-pf256+194",
    "write_kv-bf16-d128-g4-bs16-n512",
    "copy_blocks-bf16-d128-g4-bs16-n64",
    "step-llama8b-mixed-t512-s64",
    "probe-decode-f32-d256-g4-bs16-b8x32k-bk1024",
)


def grid_smoke() -> list[Case]:
    """SMOKE_CASES, taken from --grid ci in its order."""
    return [c for c in grid_ci() if c.name in SMOKE_CASES]


GRIDS = {"ci": grid_ci, "full": grid_full, "smoke": grid_smoke}


# ------------------------------------------------------------------------ failure rule


def verdict(row: dict) -> str:
    """ "pass", "expected: <why>" (recorded, not a failure) or "fail: <why>" for one row.

    A KNOWN_EXPECTED_FAILURES case reads "expected: ..." when it fails and "fail: ..."
    when it passes (the probe no longer proves the rule). A row whose status starts with
    "unsupported" (no second compile-only device for a TP case) is recorded, expected.
    """
    why = _failure(row)
    reason = KNOWN_EXPECTED_FAILURES.get(row["case"])
    if reason is not None:
        if why is None:
            return f"fail: expected to fail ({reason}) but passed"
        return f"expected: {reason} ({why})"
    if row["status"].startswith("unsupported"):
        return f"expected: {row['status']}"
    return "pass" if why is None else f"fail: {why}"


def _failure(row: dict) -> str | None:
    """Why the row breaks the rule, or None."""
    status = row["status"]
    if status.startswith("rejected"):
        return f"the kernels' validation rejects this shape: {status[len('rejected: ') :]}"
    if status.startswith("unsupported"):
        return None
    if status != "ok":
        return status
    pool = row.get("kv_pool_bytes")
    if pool:
        alias, temp = row.get("alias_bytes"), row.get("temp_bytes")
        if alias is None or temp is None:
            return "no compiled memory analysis to show the KV pool is updated in place"
        if alias < pool:
            return (
                f"KV pool not aliased input-to-output: {alias} B aliased < {pool} B of "
                "pool (the step copies it)"
            )
        limit = row.get("temp_limit_bytes")
        if limit is not None and temp >= limit:
            return (
                f"temporaries {temp} B >= {limit} B ({MAX_TEMP_FRACTION:.0%} of the {pool} B "
                "KV pool): room for a copy of the pool's caches"
            )
        quant_limit = row.get("quant_temp_limit_bytes")
        if quant_limit is not None and temp >= quant_limit:
            return (
                f"temporaries {temp} B >= {quant_limit} B ({MAX_QUANT_TEMP_FRACTION:.0%} of "
                f"the {row['weight_bytes']} B of 8-bit weights): room for dequantized copies "
                "of more than one weight matrix"
            )
    if (row.get("smem_bytes") or 0) > SMEM_LIMIT_BYTES:
        return f"dynamic shared memory {row['smem_bytes']} B > {SMEM_LIMIT_BYTES} B"
    spill = max(row.get("spill_bytes_nvjitlink") or 0, row.get("spill_bytes_ptxas") or 0)
    if spill:
        return f"spills {spill} B in a {row['dtype']} kernel"
    return None


def failures(rows: list[dict]) -> list[str]:
    """The rows that fail the check, as "case / kernel: why" lines."""
    out = []
    for row in rows:
        v = verdict(row)
        if v.startswith("fail"):
            out.append(f"{row['case']} / {row['kernel']}: {v[len('fail: ') :]}")
    return out


ROW_KEYS = (
    "case",
    "kernel",
    "dtype",
    "head_dim",
    "group",
    "block_size",
    "batch",
    "context",
    "status",
    "verdict",
    "grid",
    "warps",
    "regs_nvjitlink",
    "regs_ptxas",
    "spill_bytes_nvjitlink",
    "spill_bytes_ptxas",
    "smem_bytes",
    "compile_s",
    "roofline_bytes",
    "roofline_us",
    "cp_async",
    "cp_async_bulk",
    "max_wait_group",
    "loop_commit_groups",
    "loop_ld_global",
    "loop_ld_global_vector",
    "loop_ld_global_prefetched",
    "kv_buffers_in_flight",
    "tp",
    "collectives",
    "deferred",
    "moe_lowering",
    "toolchain",
    "kv_pool_bytes",
    "kv_layer_bytes",
    "temp_limit_bytes",
    "weight_bytes",
    "quant_temp_limit_bytes",
    "argument_bytes",
    "output_bytes",
    "alias_bytes",
    "temp_bytes",
)
# Step rows: the compiled step's memory analysis (per device) must show the KV pool
# aliased input-to-output (donated, updated in place: a copy of the pool would be an
# output of its own). Full-depth steps (num_layers: the deployment's whole pool, ~100 GiB)
# must also keep their temporaries under MAX_TEMP_FRACTION of the pool
# (temp_limit_bytes); two-layer steps hold 2/32 of that pool beside a whole step's
# activations and sampler (a Qwen3-MoE layer's experts alone take more than its KV
# share), so there the temporaries are recorded, not judged.
MAX_TEMP_FRACTION = 0.05
# Quantized steps (Case.quantization): temporaries under this share of the (per-device)
# 8-bit weights, so no step materializes a dequantized copy of its weights.
MAX_QUANT_TEMP_FRACTION = 0.10
MEMORY_KEYS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")


def base_row(case: Case, kernel: str) -> dict:
    """A row with the case's fields and every measured field None."""
    row = dict.fromkeys(ROW_KEYS)
    row.update(
        case=case.name,
        kernel=kernel,
        dtype=case.dtype,
        head_dim=case.head_dim,
        group=case.group,
        block_size=case.block_size,
        batch=case.batch,
        context=case.context,
        tp=case.tp,
    )
    return row


# --------------------------------------------------------------------------- roofline


def traffic(case: Case) -> roofline.Traffic | None:
    """Bytes the case's kernel must move (None for whole steps)."""
    import numpy as np

    cache = np.dtype(np_dtype(case.dtype)).itemsize
    q = np.dtype(np_dtype(case.q_dtype)).itemsize
    heads = dict(num_kv_heads=NUM_KV_HEADS, head_dim=case.head_dim)
    if case.kernel in ("decode", "ragged"):
        q_lens = list(case.prefill) + [1] * (case.batch - len(case.prefill))
        return roofline.attention_traffic(
            [case.context] * case.batch,
            q_lens,
            num_q_heads=NUM_KV_HEADS * case.group,
            block_size=case.block_size,
            cache_itemsize=cache,
            q_itemsize=q,
            sliding_window=case.sliding_window,
            **heads,
        )
    if case.kernel == "write_kv":
        return roofline.write_kv_traffic(case.batch, in_itemsize=q, cache_itemsize=cache, **heads)
    if case.kernel == "copy_blocks":
        return roofline.copy_blocks_traffic(
            case.batch, block_size=case.block_size, itemsize=cache, **heads
        )
    return None


def np_dtype(name: str):
    """The numpy dtype of a dtype name, bf16 and fp8 included."""
    import ml_dtypes  # jax's dependency; numpy itself has no bf16/fp8
    import numpy as np

    return np.dtype(getattr(ml_dtypes, name, None) or name)


# ------------------------------------------------------------------------- toolchain


# The CUDA plugins a venv may hold, newest first: (label, plugin module, its package).
CUDA_PLUGINS = (
    ("cuda13", "jax_plugins.xla_cuda13", "jax-cuda13-plugin"),
    ("cuda12", "jax_plugins.xla_cuda12", "jax-cuda12-plugin"),
)


@dataclass(frozen=True)
class Toolchain:
    """The CUDA plugin XLA compiles with and the assemblers that read its PTX.

    Attributes:
        ptxas: Path of the ptxas binary (nvidia-cuda-nvcc).
        nvjitlink: Path of libnvJitLink (nvidia-nvjitlink).
        cuda: "cuda12" or "cuda13": which jax CUDA plugin the venv holds.
        plugin: That plugin's package and version ("jax-cuda13-plugin 0.11.2").
    """

    ptxas: str
    nvjitlink: str
    cuda: str = "cuda12"
    plugin: str = ""

    def describe(self, jax_version: str) -> dict:
        """The header's record of the toolchain (jax, plugin, both assemblers' versions)."""
        major, minor = ctypes.c_int(), ctypes.c_int()
        _jitlink(self.nvjitlink)["Version"](ctypes.byref(major), ctypes.byref(minor))
        return dict(
            cuda=self.cuda,
            label=self.label(jax_version),
            jax=jax_version,
            plugin=self.plugin,
            ptxas=self.ptxas_version(),
            nvjitlink=f"{major.value}.{minor.value}",
        )

    def label(self, jax_version: str) -> str:
        """Every row's short name of the toolchain: "jax 0.11.2 + cuda13 (ptxas 13.0)"."""
        m = re.search(r"cuda_(\d+\.\d+)", self.ptxas_version())
        return f"jax {jax_version} + {self.cuda} (ptxas {m.group(1) if m else '?'})"

    def ptxas_version(self) -> str:
        return _ptxas_version(self.ptxas)


@functools.cache
def _ptxas_version(ptxas: str) -> str:
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def installed_cuda() -> str:
    """The CUDA plugin's label ("cuda13", "cuda12") the venv holds; "cuda12" when none."""
    return next((p[0] for p in CUDA_PLUGINS if _find_spec(p[1]) is not None), "cuda12")


def find_toolchain() -> Toolchain | str:
    """The venv's CUDA plugin (cuda13 or cuda12) and the assemblers of the same CUDA major,
    or a sentence saying what is missing.

    The CUDA 12 wheels (nvidia-cuda-nvcc-cu12, nvidia-nvjitlink-cu12) install under
    nvidia/cuda_nvcc and nvidia/nvjitlink; the CUDA 13 ones (nvidia-cuda-nvcc,
    nvidia-nvjitlink: no suffix) under nvidia/cu13. Both layouts are searched."""
    import importlib.metadata as md

    found_plugin = next((p for p in CUDA_PLUGINS if _find_spec(p[1]) is not None), None)
    if found_plugin is None:
        return (
            "no jax CUDA plugin (jax-cuda13-plugin or jax-cuda12-plugin) is installed "
            "(scripts/gpu_compile_check.sh installs one)"
        )
    cuda, _, package = found_plugin
    major = cuda.removeprefix("cuda")
    spec = _find_spec("nvidia")
    roots = [pathlib.Path(r) for r in ((spec.submodule_search_locations or []) if spec else [])]
    found = {}
    for key, patterns in (
        ("ptxas", ("cuda_nvcc/bin/ptxas", f"cu{major}/bin/ptxas")),
        (
            "nvjitlink",
            (f"nvjitlink/lib/libnvJitLink.so.{major}", f"cu{major}/lib/libnvJitLink.so.{major}"),
        ),
    ):
        hits = [r / p for r in roots for p in patterns if (r / p).exists()]
        if key == "ptxas":  # the cuda12 layout's ptxas is CUDA 12 only if its version says so
            hits = [h for h in hits if f"cuda_{major}." in _ptxas_version(str(h))]
        if not hits:
            return (
                f"{package} is installed but no CUDA {major} {key} ({' or '.join(patterns)} "
                "under nvidia/) is (scripts/gpu_compile_check.sh installs it)"
            )
        found[key] = str(hits[0])
    try:
        version = md.version(package)
    except md.PackageNotFoundError:
        version = "?"
    return Toolchain(**found, cuda=cuda, plugin=f"{package} {version}")


def _find_spec(name: str):
    """importlib's spec of `name`, or None (also when its parent package is missing)."""
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


_PTXAS_REGS = re.compile(r"[Uu]sed (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_assembler_log(text: str) -> tuple[int | None, int]:
    """(registers, spill-store bytes) from a ptxas/nvJitLink verbose log."""
    regs = [int(m) for m in _PTXAS_REGS.findall(text)]
    spills = [int(stores) for stores, _ in _PTXAS_SPILL.findall(text)]
    return (max(regs) if regs else None), (max(spills) if spills else 0)


# ------------------------------------------------------------------- buffers in flight

_LABEL = re.compile(r"^(\$?[\w$]+):")
_BRANCH = re.compile(r"^(?:@!?%\w+\s+)?bra(?:\.uni)?\s+(\$?[\w$]+);")
_PRED = re.compile(r"^@!?%\w+\s+")
# Where a loaded tile is consumed: a shared-memory read, or math on what was read.
_CONSUME = re.compile(r"^(?:ld\S*\.shared|wgmma\.mma_async|mma\.|ex2\.|fma\.rn)")
BUFFERING_KEYS = (
    "cp_async",
    "cp_async_bulk",
    "max_wait_group",
    "loop_commit_groups",
    "loop_ld_global",
    "loop_ld_global_vector",
    "loop_ld_global_prefetched",
    "kv_buffers_in_flight",
)


def _instructions(ptx: str) -> list[str]:
    """The PTX's labels and instructions, one per line, comments and predicates removed."""
    out = []
    for line in ptx.splitlines():
        line = _PRED.sub("", line.split("//")[0].strip())
        if line:
            out.append(line)
    return out


def _outstanding(lines: list[str], start: int) -> tuple[int, list[int]]:
    """Walks straight-line code counting cp.async groups not yet waited for: (the count at
    the end, the count at each point where a tile is consumed)."""
    pending, at_consume = start, []
    for ins in lines:
        if ins.startswith("cp.async.commit_group"):
            pending += 1
        elif ins.startswith("cp.async.wait_group"):
            pending = min(pending, int(ins.split()[1].rstrip(";")))
        elif ins.startswith("cp.async.wait_all"):
            pending = 0
        elif _CONSUME.match(ins):
            at_consume.append(pending)
    return pending, at_consume


_REGISTER = re.compile(r"%[A-Za-z_]\w*")
# Instructions whose first operand is read, not written.
_NO_DEST = ("st.", "bar", "bra", "cp.", "ret", "red.", "fence", "wgmma.fence", "wgmma.commit",
            "wgmma.wait", "mbarrier.arrive", "membar", "prefetch")  # fmt: skip
# Where a value becomes data (math, type conversions to or from floats, smem stores).
_DATA = re.compile(
    r"^(?:st\.|mma|wgmma|fma|ex2|cvt\.\S*(?:f16|f32|bf16|e4m3|e5m2)|\S*\.f(?:16|32))"
)


def _operands(ins: str) -> tuple[str, set[str], set[str]]:
    """(opcode, registers written, registers read as values: not inside [addresses])."""
    op, _, rest = ins.partition(" ")
    rest = rest.strip().rstrip(";")
    if op.startswith(_NO_DEST):
        dest, src = "", rest
    else:
        depth, cut = 0, len(rest)
        for i, ch in enumerate(rest):
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
            elif ch == "," and depth == 0:
                cut = i
                break
        dest, src = rest[:cut], rest[cut + 1 :]
    values = re.sub(r"\[[^\]]*\]", "", src)
    return op, set(_REGISTER.findall(dest)), set(_REGISTER.findall(values))


def _feeds_data(ops: list, regs: set[str]) -> bool:
    """Whether values in `regs` reach math or a store along `ops` (in that order).

    Values flow through every instruction except compares (a mask built from a page id
    does not make the page id data) and load addresses (not value operands)."""
    live = set(regs)
    for op, dest, values in ops:
        if live & values:
            if _DATA.match(op):
                return True
            if not op.startswith("setp"):
                live |= dest
    return False


def _prefetched_loads(body: list[str]) -> tuple[int, int]:
    """(data loads in the body, those whose values are first used by a later iteration:
    loaded into registers one tile ahead)."""
    ops = [_operands(ins) for ins in body]
    data = prefetched = 0
    for i, (op, dest, _) in enumerate(ops):
        if not op.startswith("ld.global"):
            continue
        after, wrapped = ops[i + 1 :], ops[i + 1 :] + ops[: i + 1]
        if not _feeds_data(wrapped, dest):
            continue  # page ids, lengths: addresses and masks only
        data += 1
        prefetched += not _feeds_data(after, dest)
    return data, prefetched


def ptx_buffering(ptx: str) -> dict:
    """How a kernel's tiles reach shared memory, from its PTX.

    The main loop is the backward branch whose body holds the most async copies and
    shared-memory reads. Walking the prologue and then the body twice (the second pass is
    the steady state) counts the cp.async groups still in flight wherever the body consumes
    a tile; each iteration commits ``loop_commit_groups`` groups, so that many groups are
    one tile. A global load whose value feeds data (math or a store, not only addresses
    and masks) but is first used by the next iteration is a tile prefetched into
    registers (``loop_ld_global_prefetched``): one more tile in flight.
    ``kv_buffers_in_flight`` = 1 + tiles still loading while one is consumed: 1 =
    single-buffered (every load completes before compute), 2 = double-buffered, ...;
    1 for a loop whose loads are synchronous and used at once, None without a loop.
    TMA (``cp.async.bulk``) copies are counted; they complete on mbarriers, which this
    count does not follow.

    Args:
        ptx: One kernel's PTX text.

    Returns:
        A dict keyed by BUFFERING_KEYS.
    """
    lines = _instructions(ptx)
    labels = {m.group(1): i for i, ins in enumerate(lines) if (m := _LABEL.match(ins))}
    loops = []
    for end, ins in enumerate(lines):
        m = _BRANCH.match(ins)
        if m and labels.get(m.group(1), end) < end:
            body = lines[labels[m.group(1)] + 1 : end]
            weight = sum(1 for b in body if b.startswith("cp.async") or _CONSUME.match(b))
            loops.append((weight, len(body), labels[m.group(1)], end))
    waits = [int(ins.split()[1].rstrip(";")) for ins in lines
             if ins.startswith("cp.async.wait_group")]  # fmt: skip
    out = dict.fromkeys(BUFFERING_KEYS)
    out.update(
        cp_async=sum(1 for ins in lines if re.match(r"cp\.async\.c[ag]\.", ins)),
        cp_async_bulk=sum(
            1 for ins in lines if ins.startswith("cp.async.bulk") and ".global" in ins
        ),
        max_wait_group=max(waits) if waits else None,
        loop_commit_groups=0,
        loop_ld_global=0,
        loop_ld_global_vector=0,
        loop_ld_global_prefetched=0,
    )
    if not loops:
        return out
    _, _, first, end = max(loops)
    body = lines[first + 1 : end]
    commits = sum(1 for ins in body if ins.startswith("cp.async.commit_group"))
    loads = [ins for ins in body if ins.startswith("ld.global")]
    pending, _ = _outstanding(lines[:first], 0)
    pending, _ = _outstanding(body, pending)
    _, at_consume = _outstanding(body, pending)
    in_flight = max(at_consume, default=0)
    async_tiles = cdiv(in_flight, commits) if commits else 0
    _, prefetched = _prefetched_loads(body)
    out.update(
        loop_commit_groups=commits,
        loop_ld_global=len(loads),
        loop_ld_global_vector=sum(1 for ins in loads if re.search(r"\.v[248]\.", ins)),
        loop_ld_global_prefetched=prefetched,
        kv_buffers_in_flight=1 + max(async_tiles, 1 if prefetched else 0),
    )
    return out


def ptxas_stats(tools: Toolchain, ptx: pathlib.Path) -> tuple[int | None, int]:
    out = subprocess.run(
        [tools.ptxas, f"-arch={ARCH}", "--warn-on-spills", "-v", str(ptx), "-o", os.devnull],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return parse_assembler_log(out.stdout + out.stderr)


@functools.cache
def _jitlink(path: str):
    lib = ctypes.CDLL(path)
    return {
        n: getattr(lib, f"nvJitLink{n}")
        for n in ("Create", "AddData", "Complete", "GetInfoLogSize", "GetInfoLog",
                  "GetErrorLogSize", "GetErrorLog", "Destroy", "Version")
    }  # fmt: skip


def nvjitlink_stats(tools: Toolchain, ptx: pathlib.Path) -> tuple[int | None, int]:
    """Links the PTX to a cubin with libnvJitLink (XLA's default path) and reads its log."""
    f = _jitlink(tools.nvjitlink)
    data = ptx.read_bytes()
    handle = ctypes.c_void_p()
    opts = [f"-arch={ARCH}".encode(), b"-verbose", b"-Xptxas=--warn-on-spills"]
    if f["Create"](ctypes.byref(handle), len(opts), (ctypes.c_char_p * len(opts))(*opts)):
        raise RuntimeError("nvJitLinkCreate failed")
    try:
        input_ptx = 2  # NVJITLINK_INPUT_PTX
        rc = f["AddData"](handle, input_ptx, data, len(data), ptx.name.encode())
        rc = rc or f["Complete"](handle)
        logs = []
        for size_fn, log_fn in (
            ("GetInfoLogSize", "GetInfoLog"),
            ("GetErrorLogSize", "GetErrorLog"),
        ):
            n = ctypes.c_size_t()
            f[size_fn](handle, ctypes.byref(n))
            buf = ctypes.create_string_buffer(n.value + 1)
            f[log_fn](handle, buf)
            logs.append(buf.value.decode(errors="replace"))
        if rc:
            raise RuntimeError(f"nvJitLink failed ({rc}): {logs[1][:500]}")
        return parse_assembler_log("\n".join(logs))
    finally:
        f["Destroy"](ctypes.byref(handle))


# ----------------------------------------------------------------------- compile a case

_THUNK = re.compile(
    r"\s(\w+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+"
    r"shared_memory: (\d+) bytes"
)


def kernel_launches(dump: pathlib.Path) -> dict[str, dict]:
    """Our kernels' launches in XLA's thunk list: name -> grid, threads, dynamic smem."""
    out = {}
    for path in dump.glob("*.thunk_sequence.txt"):
        for m in _THUNK.finditer(path.read_text()):
            name = m.group(1)
            if not name.startswith(KERNEL_NAMES):
                continue
            nums = [int(x) for x in m.groups()[1:]]
            out[name] = dict(grid=nums[:3], threads=nums[3] * nums[4] * nums[5], smem=nums[6])
    return out


_COLLECTIVE = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(")


def collectives(dump: pathlib.Path) -> dict[str, int]:
    """Cross-device ops in the optimized HLO (kind -> count): how a sharded step talks."""
    out: dict[str, int] = {}
    for path in dump.glob("*gpu_after_optimizations.txt"):
        for kind in _COLLECTIVE.findall(path.read_text()):
            out[kind] = out.get(kind, 0) + 1
    return out


_HLO_OP = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][\w-]*)\(([^)]*)\)")
_DIMS = re.compile(r"\[([\d,]*)\]")
_BACKEND_KIND = re.compile(r'"kind":"(__\w+)"|custom_call_target="([^"]+)"')


def moe_lowering(dump: pathlib.Path, scope: str, matmul: str) -> dict:
    """The matrix multiplies XLA made of the ops under `scope` in the optimized HLO.

    Each op reads "<op> <fusion kind or custom-call target> <output shape>" (distinct
    ones, in order), e.g. a Triton GEMM fusion or a cuBLAS custom call; a dot adds its
    contraction length K and multiply-adds (output elements x K), which tell a grouped
    GEMM (K = D) from a dense product over every expert (K = E x D).
    """
    ops: list[str] = []
    for path in sorted(dump.glob("*gpu_after_optimizations.txt")):
        text = path.read_text()
        shapes = {m.group(1): m.group(2) for m in map(_HLO_OP.match, text.splitlines()) if m}
        for line in text.splitlines():
            if f"/{scope}/" not in line and f"{scope}/" not in line:
                continue
            m = _HLO_OP.match(line)
            if not m:
                continue
            shape, op = m.group(2), m.group(3)
            kinds = [a or b for a, b in _BACKEND_KIND.findall(line)]
            kind = next((k for k in kinds if "gemm" in k or "dot" in k or "matmul" in k), "")
            if op not in ("dot", "custom-call") and not kind:
                continue
            entry = f"{op} {kind or '-'} {re.sub(r'[{][^}]*[}]', '', shape)}"
            contracting = re.search(r"lhs_contracting_dims=[{]([\d,]*)[}]", line)
            lhs = shapes.get(m.group(4).split(",")[0].strip().lstrip("%"), "")
            if op == "dot" and contracting and _DIMS.search(lhs):
                dims = [int(x) for x in _DIMS.search(lhs).group(1).split(",") if x]
                k = 1
                for i in contracting.group(1).split(","):
                    k *= dims[int(i)]
                out = 1
                for x in _DIMS.search(shape).group(1).split(","):
                    out *= int(x) if x else 1
                entry += f" K={k} macs={out * k:.3g}"
            if entry not in ops:
                ops.append(entry)
    return dict(matmul=matmul, ops=ops[:16], num_ops=len(ops))


def kernel_ptx(dump: pathlib.Path) -> dict[str, pathlib.Path]:
    """Entry name -> the dumped PTX file that defines it, for our kernels."""
    out = {}
    for path in dump.glob("*.ptx"):
        for name in re.findall(r"\.entry (\w+)\(", path.read_text()):
            if name.startswith(KERNEL_NAMES):
                out[name] = path
    return out


def entry_ptx(text: str, name: str) -> str:
    """The part of a PTX module from `name`'s .entry to the next entry (or the end)."""
    start = text.find(f".entry {name}(")
    if start < 0:
        return text
    end = text.find(".entry ", start + 1)
    return text[start : end if end > 0 else len(text)]


def topology(num_devices: int) -> list:
    """`num_devices` compile-only H200s of one host ("1x1xN": partitions x hosts x devices)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        platform="cuda",
        target_config=target_config(installed_cuda()),
        topology=f"1x1x{num_devices}",
    )
    return list(topo.devices)


class Target:
    """The compile-only H200 devices and the sharding every argument carries."""

    def __init__(self):
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        self.device = topology(1)[0]
        self.sharding = NamedSharding(Mesh([self.device], ("x",)), PartitionSpec())
        self.jax = jax

    def spec(self, shape, dtype="int32", sharding=None):
        return self.jax.ShapeDtypeStruct(
            tuple(shape), np_dtype(dtype), sharding=sharding or self.sharding
        )


def kernel_pool_blocks(case: Case) -> int:
    """Blocks of a kernel case's K and V caches: the whole batch's pages (at least 64)
    plus the null block, within POOL_BYTES of K + V, and capped as the engine caps its
    pool where 32-bit Triton offsets would wrap (1-byte caches of 2-4 GiB, which the
    kernels refuse)."""
    from pallas_kernels.layout import max_offset_safe_blocks

    block_elems = NUM_KV_HEADS * case.block_size * case.head_dim
    itemsize = np_dtype(case.dtype).itemsize
    pages = cdiv(case.context, case.block_size)
    blocks = min(max(case.batch * pages, 64), POOL_BYTES // (2 * block_elems * itemsize)) + 1
    return max_offset_safe_blocks(block_elems, itemsize, blocks)


def kernel_fn_and_args(case: Case, t: Target):
    """The jitted callable and ShapeDtypeStruct arguments of a kernel case."""
    import pallas_kernels as pk

    bs, d, kv = case.block_size, case.head_dim, NUM_KV_HEADS
    pages = cdiv(case.context, bs)
    cache = t.spec((kernel_pool_blocks(case), kv, bs, d), case.dtype)
    kw = dict(scale=d**-0.5, sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    if case.num_splits:
        kw["num_splits"] = case.num_splits
    if case.block_k:
        kw["block_k"] = case.block_k
    decode_fn, ragged_fn = pk.paged_attention, pk.ragged_paged_attention
    if case.backend == "mosaic":  # the ops for the GPU target, with no GPU client here
        ops = pk.get_attention_ops("mosaic_gpu", target=t.device)
        decode_fn, ragged_fn = ops.paged_attention, ops.ragged_paged_attention
    if case.kernel == "decode":
        q = t.spec((case.batch, kv * case.group, d), case.q_dtype)
        args = (q, cache, cache, t.spec((case.batch, pages)), t.spec((case.batch,)))
        return functools.partial(decode_fn, **kw), args
    if case.kernel == "ragged":
        q = t.spec((case.num_tokens, kv * case.group, d), case.q_dtype)
        tables, lens, qsl = (
            t.spec((case.batch, pages)),
            t.spec((case.batch,)),
            t.spec((case.batch + 1,)),
        )
        return functools.partial(ragged_fn, **kw), (
            q, cache, cache, tables, lens, qsl,
        )  # fmt: skip
    if case.kernel == "write_kv":
        new = t.spec((case.batch, kv, d), case.q_dtype)
        return pk.write_kv, (cache, cache, new, new, t.spec((case.batch,)))
    if case.kernel == "copy_blocks":
        ids = t.spec((case.batch,))
        return pk.copy_blocks, (cache, cache, ids, ids)
    raise ValueError(f"kernel={case.kernel!r} is not a kernel case")


MODEL_HF = {
    "llama8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                    intermediate_size=14336, vocab_size=128256, num_hidden_layers=2,
                    max_position_embeddings=32768, rope_theta=500000.0, rms_norm_eps=1e-5,
                    hidden_act="silu"),
    "gemma2": dict(hidden_size=3584, num_attention_heads=16, num_key_value_heads=8,
                   head_dim=256, intermediate_size=14336, vocab_size=256000,
                   num_hidden_layers=2),
    "mixtral-tiny": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                         intermediate_size=1024, vocab_size=1024, num_hidden_layers=2,
                         num_local_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=4096),
    # Qwen3-30B-A3B's config.json at two layers
    "qwen3moe": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     vocab_size=151936, num_hidden_layers=2, max_position_embeddings=40960),
}  # fmt: skip


def step_fn_and_args(case: Case, t: Target):
    """The engine's jitted step of a two-layer model, with abstract weights (nothing of
    the 8B-shaped weights is allocated) and a pool sized like a real 32-layer deployment.
    With ``case.tp > 1`` the Runner builds its tensor-parallel step (weights split by the
    family's partition rules, caches by KV head, kernels per shard) over compile-only
    devices; `compile_only_tensor_parallel` stands in for what needs real arrays."""
    import jax
    from flax import nnx

    from paged_jax.config import EngineConfig
    from paged_jax.model_api import model_kv_cache_groups
    from paged_jax.models import LlamaForCausalLM
    from paged_jax.models.gemma import Gemma2ForCausalLM
    from paged_jax.models.mixtral import MixtralForCausalLM
    from paged_jax.models.moe import set_expert_matmul
    from paged_jax.models.qwen3_moe import Qwen3MoeForCausalLM
    from paged_jax.worker.input_batch import InputBatch
    from paged_jax.worker.runner import Runner

    cls = {
        "llama8b": LlamaForCausalLM,
        "gemma2": Gemma2ForCausalLM,
        "mixtral-tiny": MixtralForCausalLM,
        "qwen3moe": Qwen3MoeForCausalLM,
    }[case.model]
    hf = dict(MODEL_HF[case.model])
    if case.num_layers:
        hf["num_hidden_layers"] = case.num_layers
    config = cls.config_from_hf(hf, {}, "bfloat16")
    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), attention_backend="pallas"))
    if case.quantization:  # 8-bit weights, as load_model(quantization=...) builds them
        from paged_jax.models.quantized_model import replace_linears

        replace_linears(model, case.quantization, block_size=case.weight_block or None)
    if case.expert_matmul:
        set_expert_matmul(model, case.expert_matmul)
    engine_config = EngineConfig(
        block_size=case.block_size,
        num_kv_blocks=64,  # the runner's own (concrete) caches; replaced by specs below
        max_num_seqs=case.batch,
        max_num_batched_tokens=max(case.num_tokens, case.batch),
        max_model_len=case.context,
        attention_backend="pallas",
        dtype="bfloat16",
        tensor_parallel_size=case.tp,
        scan_layers=case.scan_layers,
        quantization=case.quantization or None,
    )
    if case.tp == 1:
        runner = Runner(model, engine_config)
        rep = kv = t.sharding
        weight_specs = None
    else:
        tp = compile_only_tensor_parallel(model, case.tp)
        with tp.patch_runner():
            runner = Runner(model, engine_config)
        rep, kv = tp.replicated, tp.kv_sharding
        weight_specs = runner.weights  # specs carrying the partition rules' shardings
    groups = model_kv_cache_groups(model)  # Gemma 2: a full and a sliding-window group
    step = InputBatch(engine_config, kv_cache_groups=groups).dummy_step_input(
        case.num_tokens, case.batch, decode_only=case.decode_only
    )
    # ~100 GB of KV over 32 layers: the per-layer pool an 8B model gets on an H200.
    pool_blocks = POOL_BYTES // 32 // (2 * NUM_KV_HEADS * case.block_size * case.head_dim * 2)

    def spec(x):
        shape = tuple(getattr(x, "shape", ()))
        return t.spec(shape, str(x.dtype), sharding=rep)

    args = list(jax.tree.map(spec, runner.step_args(step)))
    if weight_specs is not None:
        args[0] = weight_specs
    pool_blocks *= runner.num_kv_tensors  # a scanned model stacks its KV tensors
    args[1] = [
        tuple(t.spec((pool_blocks, *k.shape[1:]), str(k.dtype), sharding=kv) for k in pair)
        for pair in runner.kv_caches
    ]
    return runner.jitted_step, tuple(args)


def compile_only_tensor_parallel(model, tp: int):
    """The Runner's TensorParallel on a mesh of `tp` compile-only H200s.

    The real one places weights and zeroed caches on its devices, which compile-only
    devices cannot hold; this one keeps the model abstract (its weights become
    ShapeDtypeStructs carrying the partition rules' shardings) and its caches specs.
    The mesh, the per-shard ops and the logits gather are TensorParallel's own.
    """
    import contextlib
    from unittest import mock

    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding

    from paged_jax.models.moe import set_expert_mesh
    from paged_jax.models.partitioning import TP_AXIS, param_shardings, tensor_parallel_config
    from paged_jax.worker import runner as runner_module
    from paged_jax.worker.sharding import KV_CACHE_SPEC, REPLICATED, TensorParallel

    if tensor_parallel_config(model.config, tp) != model.config:
        raise ValueError(f"tp={tp}: the compile check does not repeat KV heads")

    class CompileOnlyTensorParallel(TensorParallel):
        def __init__(self):  # noqa: D107 - TensorParallel's fields, no device transfers
            self.mesh = Mesh(np.array(topology(tp)), (TP_AXIS,))
            self.size = tp
            self.model = self.with_weight_specs(model)
            set_expert_mesh(self.model, self.mesh)  # as shard_model: experts per device
            self.replicated_fallbacks = []
            self.kv_sharding = NamedSharding(self.mesh, KV_CACHE_SPEC)
            self.replicated = NamedSharding(self.mesh, REPLICATED)

        def init_kv_caches(self, num_blocks: int, block_size: int, init=None) -> list:
            init = init or (lambda: self.model.init_kv_caches(num_blocks, block_size))
            return jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.kv_sharding),
                jax.eval_shape(init),
            )

        def with_weight_specs(self, abstract):
            """The abstract model with each weight a spec carrying its rule's sharding (the
            Runner then stacks them for the scan with the shardings kept)."""
            graphdef, state = nnx.split(abstract)
            shardings, _ = param_shardings(type(abstract).partition_rules, state, self.mesh)
            for path, var in nnx.to_flat_state(state):
                value = var.get_value()
                var.set_value(
                    jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=shardings[tuple(path)])
                )
            return nnx.merge(graphdef, state)

        @contextlib.contextmanager
        def patch_runner(self):
            # The Runner builds TensorParallel(model, tp) and device_puts its row tokens
            # replicated; here the step's arguments are specs, so both are stood in for.
            with (
                mock.patch.object(runner_module, "TensorParallel", lambda *_: self),
                mock.patch.object(jax, "device_put", lambda x, *_, **__: x),
            ):
                yield

    return CompileOnlyTensorParallel()


def tensor_parallel_unsupported(tp: int) -> str | None:
    """Why `tp` compile-only devices cannot be had here, or None when they can."""
    try:
        found = len(topology(tp))
    except Exception as e:  # noqa: BLE001 - the reason is the row's status
        return f"get_topology_desc(topology='1x1x{tp}') failed: {type(e).__name__}: {e}"[:400]
    if found < tp:
        return f"get_topology_desc(topology='1x1x{tp}') gave {found} devices, not {tp}"
    return None


def mosaic_smem_bytes(case: Case) -> int:
    """The Mosaic kernel's own SMEM estimate at its default tiling for the case."""
    from pallas_kernels.mosaic_decode import default_tiling, smem_bytes

    tiling = default_tiling(case.q_dtype, case.dtype, case.block_size, case.head_dim)
    block_k = tiling["pages_per_step"] * case.block_size
    return smem_bytes(case.q_dtype, case.dtype, case.head_dim, block_k, tiling["num_stages"])


_MOSAIC_SMEM = re.compile(r"smem_scratch_bytes=(\d+)")


@contextlib.contextmanager
def mosaic_compile_report():
    """Captures what Mosaic GPU reports while kernels lower and compile inside the block:
    yields a dict that gets "text" (the captured output) when the block exits.

    MOSAIC_GPU_DUMP_PTXAS=1 makes the custom call print ptxas's -v report (registers,
    spills) of each kernel it assembles to the process's stdout (fd 1, redirected here to
    a file), MOSAIC_GPU_DUMP_RESOURCES=1 the Python lowering its
    ``Resources(smem_scratch_bytes=...)`` to sys.stdout (redirected too).
    MOSAIC_GPU_DUMP_TO is unset meanwhile (it would send these, and every other dump, to
    files)."""
    keys = ("MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_RESOURCES", "MOSAIC_GPU_DUMP_TO")
    saved_env = {k: os.environ.get(k) for k in keys}
    os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_RESOURCES="1")
    os.environ.pop("MOSAIC_GPU_DUMP_TO", None)
    report: dict = {}
    python_out = io.StringIO()  # Python's prints, wherever sys.stdout points (pytest's)
    with tempfile.TemporaryFile() as out:
        sys.stdout.flush()
        saved_fd = os.dup(1)
        os.dup2(out.fileno(), 1)
        try:
            with contextlib.redirect_stdout(python_out):
                yield report
        finally:
            os.dup2(saved_fd, 1)
            os.close(saved_fd)
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            out.seek(0)
            report["text"] = out.read().decode(errors="replace") + python_out.getvalue()


def compile_mosaic_case(case: Case, t: Target) -> list[dict]:
    """The row of a Mosaic case: lowering + XLA compile, the ``mosaic_gpu_v2`` custom call
    in the optimized HLO, the grid and warps given to ``plgpu.kernel``, registers and
    spills from the ptxas report of Mosaic's own compile and Mosaic's SMEM scratch size
    (``mosaic_compile_report``). Where the compile gives no ptxas report (the cubin built
    only at load time on a device), registers and spills are None, smem_bytes is the
    kernel's estimate and ``deferred`` says why."""
    from unittest import mock

    import jax

    from pallas_kernels.mosaic_decode import plgpu_module

    row = base_row(case, MOSAIC_KERNEL_NAMES[case.kernel])
    start = time.perf_counter()
    plgpu = plgpu_module()
    launches = []
    real_kernel = plgpu.kernel

    def recording_kernel(body, **kw):  # the launch shape the kernel asks for
        launches.append(kw)
        return real_kernel(body, **kw)

    try:
        fn, args = kernel_fn_and_args(case, t)
        jitted = jax.jit(fn)
        jax.eval_shape(jitted, *args)
    except ValueError as e:
        row["status"] = f"rejected: {e}"
        row["verdict"] = verdict(row)
        return [row]
    with tempfile.TemporaryDirectory() as tmp, mosaic_compile_report() as report:
        dump = pathlib.Path(tmp)
        try:
            with mock.patch.object(plgpu, "kernel", recording_kernel), jax.default_device(t.device):
                lowered = jitted.lower(*args)
            lowered.compile(compiler_options={"xla_dump_to": str(dump)})
        except Exception as e:  # noqa: BLE001 - a lowering/compile error is a recorded failure
            row["status"] = f"error: {type(e).__name__}: {str(e)[:400]}"
            row["verdict"] = verdict(row)
            return [row]
        hlo = "".join(p.read_text() for p in dump.glob("*gpu_after_optimizations.txt"))
    row["compile_s"] = round(time.perf_counter() - start, 2)
    if f'custom_call_target="{MOSAIC_CUSTOM_CALL}"' not in hlo or not launches:
        row["status"] = f"error: no {MOSAIC_CUSTOM_CALL} custom call in the compiled module"
        row["verdict"] = verdict(row)
        return [row]
    launch = launches[-1]
    tr = traffic(case)
    row.update(
        status="ok",
        grid=list(launch["grid"]),
        warps=4 * (launch.get("num_threads") or 1),  # warpgroups of 128 threads
        smem_bytes=mosaic_smem_bytes(case),
        roofline_bytes=tr.total_bytes,
        roofline_us=round(tr.seconds() * 1e6, 3),
        deferred=MOSAIC_DEFERRED,
    )
    regs, spills = parse_assembler_log(report["text"])
    if regs is not None:  # Mosaic assembled the kernel during the compile
        row.update(regs_ptxas=regs, spill_bytes_ptxas=spills, deferred=None)
        smem = _MOSAIC_SMEM.findall(report["text"])
        if smem:  # Mosaic's own allocation, beside the kernel's estimate
            row.update(smem_bytes=max(map(int, smem)), smem_bytes_estimate=row["smem_bytes"])
    row["verdict"] = verdict(row)
    return [row]


def compile_case(case: Case, t: Target, tools: Toolchain) -> list[dict]:
    """Rows for one case: one per Pallas kernel in its compiled module."""
    import jax

    if case.backend == "mosaic":
        return compile_mosaic_case(case, t)

    is_step = case.kernel == "step"
    first_kernel = {
        "decode": "paged_decode_attention",
        "ragged": "ragged_paged_attention",
        "write_kv": "paged_write_kv",
        "copy_blocks": "paged_copy_blocks",
    }.get(case.kernel, "step")
    start = time.perf_counter()
    if case.tp > 1:
        missing = tensor_parallel_unsupported(case.tp)
        if missing:
            row = base_row(case, first_kernel)
            row["status"] = f"unsupported: {missing}"
            row["verdict"] = verdict(row)
            return [row]
    try:
        fn, args = (step_fn_and_args if is_step else kernel_fn_and_args)(case, t)
        jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
        jax.eval_shape(jitted, *args)  # trace-time validation, on no device
    except ValueError as e:
        row = base_row(case, first_kernel)
        row["status"] = f"rejected: {e}"
        row["verdict"] = verdict(row)
        return [row]
    with tempfile.TemporaryDirectory() as tmp:
        dump = pathlib.Path(tmp)
        try:
            with jax.default_device(t.device):
                lowered = jitted.lower(*args)
            compiled = lowered.compile(
                compiler_options={"xla_dump_to": str(dump), "xla_dump_emitter_re": "ptx"}
            )
        except Exception as e:  # noqa: BLE001 - a compile error is a recorded failure
            row = base_row(case, first_kernel)
            row["status"] = f"error: {type(e).__name__}: {str(e)[:400]}"
            row["verdict"] = verdict(row)
            return [row]
        compile_s = time.perf_counter() - start
        launches, ptx = kernel_launches(dump), kernel_ptx(dump)
        comms = collectives(dump) if is_step else None
        memory = step_memory(compiled, args[1], case_layers(case)) if is_step else {}
        if is_step and case.num_layers:  # the deployment's whole pool: temporaries judged
            memory["temp_limit_bytes"] = int(MAX_TEMP_FRACTION * memory["kv_pool_bytes"])
        if is_step and case.quantization:  # 8-bit weights: at most one matrix dequantized
            memory["weight_bytes"] = tree_bytes(args[0])
            memory["quant_temp_limit_bytes"] = int(MAX_QUANT_TEMP_FRACTION * memory["weight_bytes"])
        lowering = None
        if case.expert_matmul:
            from paged_jax.models.moe import EXPERT_MATMUL_SCOPE

            lowering = moe_lowering(dump, EXPERT_MATMUL_SCOPE, case.expert_matmul)
        rows = []
        for name in sorted(launches):
            row = base_row(case, name)
            launch = launches[name]
            row.update(
                status="ok",
                grid=launch["grid"],
                warps=launch["threads"] // 32,
                smem_bytes=launch["smem"],
                compile_s=round(compile_s, 2),
                collectives=comms,
                moe_lowering=lowering,
                **memory,
            )
            if name in ptx:
                row["regs_nvjitlink"], row["spill_bytes_nvjitlink"] = nvjitlink_stats(
                    tools, ptx[name]
                )
                row["regs_ptxas"], row["spill_bytes_ptxas"] = ptxas_stats(tools, ptx[name])
                row.update(ptx_buffering(entry_ptx(ptx[name].read_text(), name)))
            else:
                row["status"] = "error: no PTX dumped for this kernel"
            if not is_step:
                tr = traffic(case)
                row["roofline_bytes"] = tr.total_bytes
                row["roofline_us"] = round(tr.seconds() * 1e6, 3)
            row["verdict"] = verdict(row)
            rows.append(row)
        if not rows:
            row = base_row(case, first_kernel)
            row["status"] = "error: no Pallas kernel launch found in the compiled module"
            row["verdict"] = verdict(row)
            rows.append(row)
        return rows


def case_layers(case: Case) -> int:
    """The step case's model depth (each layer keeps its own K and V)."""
    return case.num_layers or MODEL_HF[case.model]["num_hidden_layers"]


def tree_bytes(tree) -> int:
    """Per-device bytes of the arrays (or specs) in `tree` (a sharded leaf: one shard)."""
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        total += int(np.prod(shape)) * np.dtype(x.dtype).itemsize
    return total


def step_memory(compiled, kv_caches, num_layers: int) -> dict:
    """A compiled step's memory analysis beside its KV pool, per device (a sharded step's
    analysis is one device's): kv_pool_bytes, kv_layer_bytes (one layer's K + V) and
    MEMORY_KEYS, None where jax gives none."""
    import jax
    import numpy as np

    pool = 0
    for x in jax.tree.leaves(kv_caches):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        pool += int(np.prod(shape)) * np.dtype(x.dtype).itemsize
    out = dict(dict.fromkeys(MEMORY_KEYS), kv_pool_bytes=pool, kv_layer_bytes=pool // num_layers)
    stats = compiled.memory_analysis()
    if stats is not None:
        for key in MEMORY_KEYS:
            out[key] = int(getattr(stats, key.replace("_bytes", "_size_in_bytes")))
    return out


# ------------------------------------------------------------------------------ main


def kernels_revision() -> str:
    """The git commit of the tree the kernels are imported from, "+dirty" when its
    kernel or model sources differ from it (a report says what it measured)."""
    import pallas_kernels

    root = pathlib.Path(pallas_kernels.__file__).resolve().parents[1]

    def git(*cmd: str) -> str:
        out = subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "pallas_kernels", "paged_jax", "models")
    return f"{root}@{commit}" + ("+dirty" if dirty else "")


def write_report(path: pathlib.Path, header: dict, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(header, failures=failures(rows), rows=rows)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def print_row(row: dict) -> None:
    regs = f"{row['regs_nvjitlink']}/{row['regs_ptxas']}" if row["regs_ptxas"] else "-"
    spill = f"{row['spill_bytes_nvjitlink'] or 0}/{row['spill_bytes_ptxas'] or 0}"
    grid = "x".join(map(str, row["grid"])) if row["grid"] else "-"
    print(
        f"{row['case'][:52]:52s} {row['kernel'][:22]:22s} grid {grid:>11s} w{row['warps'] or '-'}"
        f" regs {regs:>7s} spill {spill:>7s} smem {row['smem_bytes'] or 0:>6} "
        f"kv-buf {row.get('kv_buffers_in_flight') or '-'} "
        f"{row['compile_s'] or 0:5.1f}s  {row['verdict'][:60]}",
        flush=True,
    )


def print_memory(row: dict) -> None:
    """A step's memory analysis, once per case."""
    if row.get("kv_pool_bytes") and row.get("temp_bytes") is not None:
        print(
            f"{row['case'][:52]:52s} memory: KV pool {row['kv_pool_bytes'] / 2**30:.2f} GiB, aliased "
            f"{row['alias_bytes'] / 2**30:.2f} GiB, temporaries {row['temp_bytes'] / 2**20:.1f}"
            f" MiB ({row['temp_bytes'] / row['kv_pool_bytes']:.2%} of the pool, "
            f"{row['temp_bytes'] / row['kv_layer_bytes']:.1%} of one layer's K + V)",
            flush=True,
        )


def buffering_cell(row: dict) -> str:
    """ "2 (96, wait 2)": buffers in flight, cp.async count, deepest wait_group; "-" if unknown."""
    buffers = row.get("kv_buffers_in_flight")
    if buffers is None:
        return "-"
    wait = row.get("max_wait_group")
    return f"{buffers} ({row.get('cp_async') or 0}, wait {'-' if wait is None else wait})"


def markdown_table(rows: list[dict], pattern: str = "") -> str:
    """The rows (those whose case matches `pattern`) as the table in docs/kernels.md."""
    lines = [
        "| case | kernel | grid | warps | regs nvJitLink / ptxas | spill B (stores) | smem B "
        "| K/V buffers in flight (cp.async, wait) | roofline us | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not re.search(pattern, r["case"]):
            continue
        grid = "x".join(map(str, r["grid"])) if r["grid"] else "-"
        regs = f"{r['regs_nvjitlink']} / {r['regs_ptxas']}" if r["regs_ptxas"] else "-"
        spill = f"{r['spill_bytes_nvjitlink'] or 0} / {r['spill_bytes_ptxas'] or 0}"
        if r.get("deferred"):  # Mosaic: no cubin deviceless
            regs = spill = "deferred to load time"
        smem = f"{r['smem_bytes']:,}" if r["smem_bytes"] is not None else "-"
        us = f"{r['roofline_us']:.1f}" if r["roofline_us"] is not None else "-"
        lines.append(
            f"| {r['case']} | {r['kernel']} | {grid} | {r['warps'] or '-'} | {regs} | {spill} "
            f"| {smem} | {buffering_cell(r)} | {us} | {r['verdict'].split(' (')[0]} |"
        )
    return "\n".join(lines)


def _cells(r: dict | None) -> dict[str, str]:
    """The compare table's columns of one row (all "-" for a missing row)."""
    if r is None or r["status"] != "ok":
        cells = dict.fromkeys(("grid", "nvjitlink", "ptxas", "spill", "smem", "buffers"), "-")
    else:
        cells = dict(
            grid="x".join(map(str, r["grid"])) if r["grid"] else "-",
            nvjitlink=str(r["regs_nvjitlink"] or "-"),
            ptxas=str(r["regs_ptxas"] or "-"),
            spill=f"{r['spill_bytes_nvjitlink'] or 0} / {r['spill_bytes_ptxas'] or 0}",
            smem=f"{r['smem_bytes']:,}" if r["smem_bytes"] is not None else "-",
            buffers=buffering_cell(r),
        )
    cells["verdict"] = "-" if r is None else r["verdict"].split(":")[0]
    return cells


def compare_table(before: list[dict], after: list[dict], pattern: str = "") -> str:
    """Before/after resources of the cases both reports hold, as markdown: "a → b" where
    a value changed. Kernels of a case are matched by name (a kernel only one side has
    shows "-" on the other)."""
    lines = [
        "| case | kernel | grid | regs nvJitLink | regs ptxas | spill B (nvJitLink / ptxas) "
        "| smem B | K/V buffers in flight (cp.async, wait) | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    after_cases = {r["case"] for r in after}
    for case in dict.fromkeys(r["case"] for r in before if r["case"] in after_cases):
        if not re.search(pattern, case):
            continue
        old = {r["kernel"]: r for r in before if r["case"] == case}
        new = {r["kernel"]: r for r in after if r["case"] == case}
        # A case that did not compile before has one placeholder row; pair it with the
        # after row of the same kernel name, or with the only one.
        if len(new) == 1 and len(old) == 1 and set(old) != set(new):
            new = {next(iter(old)): next(iter(new.values()))}
        for kernel in dict.fromkeys([*old, *new]):
            b, a = _cells(old.get(kernel)), _cells(new.get(kernel))
            cols = [b[k] if b[k] == a[k] else f"{b[k]} → {a[k]}" for k in b]
            lines.append(f"| {case} | {kernel} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def report_label(report: dict) -> str:
    """A report's toolchain label (reports written before the header had one: jax and
    ptxas versions from the header)."""
    if report.get("toolchain"):
        return report["toolchain"]["label"]
    m = re.search(r"cuda_(\d+)\.(\d+)", report.get("ptxas", ""))
    cuda = f"cuda{m.group(1)} (ptxas {m.group(1)}.{m.group(2)})" if m else "?"
    return f"jax {report.get('jax_version', '?')} + {cuda}"


def toolchain_table(reports: list[dict], pattern: str = "") -> str:
    """Registers, spills and dynamic shared memory of each (case, kernel) that every report
    holds, side by side ("a / b" in the reports' order, one value where all agree)."""
    keyed = [{(r["case"], r["kernel"]): r for r in rep["rows"]} for rep in reports]
    shown = [
        key for key in keyed[0] if re.search(pattern, key[0]) and all(key in k for k in keyed[1:])
    ]
    labels = []
    for rep, k in zip(reports, keyed):  # a merged report's rows may come from several runs
        found = dict.fromkeys(k[key].get("toolchain") or report_label(rep) for key in shown)
        labels.append("; ".join(found) if found else report_label(rep))
    lines = [
        "toolchains: " + " / ".join(labels),
        "",
        "| case | kernel | regs nvJitLink | regs ptxas | spill B (nvJitLink, ptxas) | smem B "
        "| verdict |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(rows: list[dict], fmt) -> str:
        values = [fmt(r) for r in rows]
        return values[0] if len(set(values)) == 1 else " / ".join(values)

    def regs(key: str):
        return lambda r: "deferred" if r.get("deferred") else str(r.get(key) or "-")

    def spill(r: dict) -> str:
        if r.get("deferred"):
            return "deferred"
        return f"{r.get('spill_bytes_nvjitlink') or 0}, {r.get('spill_bytes_ptxas') or 0}"

    def smem(r: dict) -> str:
        return "-" if r.get("smem_bytes") is None else f"{r['smem_bytes']:,}"

    for key in shown:
        rows = [k[key] for k in keyed]
        lines.append(
            f"| {key[0]} | {key[1]} | {cell(rows, regs('regs_nvjitlink'))} "
            f"| {cell(rows, regs('regs_ptxas'))} | {cell(rows, spill)} | {cell(rows, smem)} "
            f"| {cell(rows, lambda r: r['verdict'].split(':')[0])} |"
        )
    return "\n".join(lines)


def memory_table(reports: list[dict], pattern: str = "") -> str:
    """The step rows' compiled memory analysis (one line per case and toolchain): the KV
    pool, what the step aliases input-to-output, its temporaries and their share of the pool."""
    lines = [
        "| case | toolchain | KV pool (per device) | one layer's K + V | aliased in -> out "
        "| arguments | outputs | temporaries | temp / pool | temp / layer |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    mib = lambda b: "-" if b is None else f"{b / 2**20:,.1f} MiB"  # noqa: E731
    for rep in reports:
        seen = set()
        for r in rep["rows"]:
            if not r.get("kv_pool_bytes") or r["case"] in seen or not re.search(pattern, r["case"]):
                continue
            seen.add(r["case"])
            temp, pool = r.get("temp_bytes"), r["kv_pool_bytes"]
            layer = r.get("kv_layer_bytes") or pool
            share = "-" if temp is None else f"{temp / pool:.2%}"
            per_layer = "-" if temp is None else f"{temp / layer:.1%}"
            lines.append(
                f"| {r['case']} | {r.get('toolchain') or report_label(rep)} | {mib(pool)} "
                f"| {mib(layer)} | {mib(r.get('alias_bytes'))} | {mib(r.get('argument_bytes'))} "
                f"| {mib(r.get('output_bytes'))} | {mib(temp)} | {share} | {per_layer} |"
            )
    return "\n".join(lines)


def merge_rows(old: list[dict], new: list[dict], order: list[str]) -> list[dict]:
    """`old` with the rows of `new`'s cases replaced by `new`'s, in grid `order` (cases
    not in the grid last); every row gets all ROW_KEYS (absent ones None)."""
    fresh = {r["case"] for r in new}
    rows = [r for r in old if r["case"] not in fresh] + list(new)
    rank = {name: i for i, name in enumerate(order)}
    rows.sort(key=lambda r: rank.get(r["case"], len(rank)))  # stable: kernels keep order
    return [dict(dict.fromkeys(ROW_KEYS), **r) for r in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), default="ci")
    parser.add_argument("--output", default=None, help=f"JSON (default: full -> {FULL_OUTPUT})")
    parser.add_argument("--only", default=None, help="regex: compile only matching case names")
    parser.add_argument("--list", action="store_true", help="print the grid; compile nothing")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="replace only the compiled cases' rows in the existing --output report (the "
        "others are kept as they are, not recompiled)",
    )
    parser.add_argument(
        "--table", metavar="JSON", help="print a report's rows (--only filters) as markdown"
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("BEFORE", "AFTER"),
        help="print the before/after resource table of two reports (--only filters)",
    )
    parser.add_argument(
        "--toolchains",
        nargs="+",
        metavar="JSON",
        help="print registers, spills and smem of the (case, kernel) rows every report holds, "
        "side by side (one report per toolchain; --only filters)",
    )
    parser.add_argument(
        "--memory",
        nargs="+",
        metavar="JSON",
        help="print the step rows' compiled memory analysis: KV pool, aliased, temporaries",
    )
    args = parser.parse_args(argv)
    if args.toolchains or args.memory:
        reports = [json.loads(pathlib.Path(p).read_text()) for p in args.toolchains or args.memory]
        table = toolchain_table if args.toolchains else memory_table
        print(table(reports, args.only or ""))
        return 0
    if args.compare:
        before, after = (json.loads(pathlib.Path(p).read_text())["rows"] for p in args.compare)
        print(compare_table(before, after, args.only or ""))
        return 0
    if args.table:
        rows = json.loads(pathlib.Path(args.table).read_text())["rows"]
        print(markdown_table(rows, args.only or ""))
        return 0
    cases = GRIDS[args.grid]()
    if args.only:
        cases = [c for c in cases if re.search(args.only, c.name)]
    if args.list:
        for c in cases:
            print(c.name)
        print(f"{len(cases)} cases")
        return 0
    tools = find_toolchain()
    if isinstance(tools, str):
        print(f"gpu_compile_check: cannot run: {tools}", file=sys.stderr)
        return 2
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        print("gpu_compile_check: set JAX_PLATFORMS=cpu (no CUDA client)", file=sys.stderr)
        return 2
    import jax

    output = pathlib.Path(args.output or default_output(args.grid, tools.cuda))
    toolchain = tools.describe(jax.__version__)
    header = dict(
        target="NVIDIA H200 (sm_90a), deviceless compile",
        command=f"python scripts/gpu_compile_check.py --grid {args.grid}"
        + (f" --only '{args.only}'" if args.only else ""),
        kernels_revision=kernels_revision(),
        jax_version=jax.__version__,
        ptxas=toolchain["ptxas"],
        toolchain=toolchain,
        smem_limit_bytes=SMEM_LIMIT_BYTES,
        bandwidth_bytes_per_s=roofline.H200_BYTES_PER_S,
        rule=(
            "fail on a compile error, a validation rejection, a spill in any kernel (f32 "
            "included), or dynamic shared memory over the limit; known_expected_failures "
            "(oversized probes) must fail; Mosaic rows: a lowering/compile error, no "
            "mosaic_gpu_v2 call, or the kernel's SMEM estimate over the limit fails, the "
            "cubin (registers, spills) being deferred to load time does not"
        ),
        known_expected_failures=KNOWN_EXPECTED_FAILURES,
        num_kv_heads=NUM_KV_HEADS,
    )
    target = Target()
    rows: list[dict] = []
    start = time.perf_counter()
    for case in cases:
        for row in compile_case(case, target, tools):
            row["toolchain"] = toolchain["label"]
            rows.append(row)
            print_row(row)
        print_memory(rows[-1])
        if not args.merge:
            write_report(output, dict(header, wall_s=round(time.perf_counter() - start, 1)), rows)
    if args.merge:
        old = json.loads(output.read_text()) if output.exists() else dict(header, rows=[])
        run = dict(
            command=header["command"] + " --merge",
            kernels_revision=header["kernels_revision"],
            toolchain=toolchain["label"],
            cases=len(cases),
            wall_s=round(time.perf_counter() - start, 1),
        )
        old_header = {k: v for k, v in old.items() if k not in ("failures", "rows")}
        # In the full grid's order (--grid ci's cases are a subset of it).
        rows = merge_rows(old["rows"], rows, [c.name for c in grid_full()])
        merged = dict(
            old_header,
            rule=header["rule"],
            known_expected_failures=KNOWN_EXPECTED_FAILURES,
            merged_runs=[*old_header.get("merged_runs", []), run],
        )
        write_report(output, merged, rows)
    failed = failures(rows)
    print(f"gpu_compile_check: {len(cases)} cases, {len(rows)} rows in "
          f"{time.perf_counter() - start:.0f} s; wrote {output}")  # fmt: skip
    for line in failed:
        print(f"FAIL {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
