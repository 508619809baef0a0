"""Compile every Pallas kernel, and whole engine steps, for an H200 with no GPU present.

XLA runs its whole GPU pipeline (HLO passes, Triton -> PTX -> cubin) against a GPU
*target config* when it has no device client: a deviceless compile. Per case this script
lowers the kernel for a compile-only H200 device, compiles it (dumping each kernel's
PTX), reads the launch (grid, threads, dynamic shared memory) from XLA's thunk list,
and assembles the PTX with both nvJitLink and ptxas for sm_90a (a real machine may take
either path; their register counts differ) to read registers and spills.

One JSON row per (case, kernel). The run fails on any compile error, any spill in a
bf16/f16/fp8 kernel, or dynamic shared memory over the per-block limit. Cases the
kernels' own validation rejects (e.g. head_dim 80) are recorded with the reason and are
an expected outcome, as are f32 spills.

Needs the CUDA plugin and the NVIDIA assemblers in the venv (scripts/gpu_compile_check.sh
installs them) and JAX_PLATFORMS=cpu, so no CUDA client is ever created.

    python scripts/gpu_compile_check.py --grid ci
    python scripts/gpu_compile_check.py --grid full      # writes docs/gpu_compile_h200.json
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import importlib.util
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

REPO = pathlib.Path(__file__).resolve().parents[1]
FULL_OUTPUT = REPO / "docs" / "gpu_compile_h200.json"
CI_OUTPUT = REPO / "bench_results" / "gpu_compile_ci.json"

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
SMEM_LIMIT_BYTES = 232448  # shared_memory_per_block_optin above
ARCH = "sm_90a"
# Dtypes whose kernels must not spill (f32 decode is known to, and is recorded only).
NO_SPILL_DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2")
HEAD_DIMS = (64, 128, 256, 80, 96)
KERNEL_NAMES = (
    "paged_decode_attention",
    "ragged_paged_attention",
    "paged_write_kv",
    "paged_copy_blocks",
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
        model: Step cases: "llama8b" or "gemma2" (two layers each).
        decode_only: Step cases: the decode-only bucket (decode kernel), else mixed.
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
    model: str = ""
    decode_only: bool = False

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
    return dataclasses.replace(c, name="-".join(parts))


# The ragged mix of a typical chunked-prefill step: two prefill chunks and 62 decodes.
MIX = dict(batch=64, context=4096, prefill=(256, 194))


def grid_full() -> list[Case]:
    """Every dtype x head_dim x GQA group x block size for the four kernels, then shape,
    feature and ragged-mix sweeps at the Llama-3-8B heads, then whole engine steps."""
    cases = []
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            for bs in (16, 32):
                for g in (1, 4, 8):
                    cases.append(_case("decode", dtype=dtype, head_dim=d, group=g, block_size=bs))
                    cases.append(
                        _case("ragged", dtype=dtype, head_dim=d, group=g, block_size=bs, **MIX)
                    )
                cases.append(_case("write_kv", dtype=dtype, head_dim=d, block_size=bs, batch=512))
                cases.append(_case("copy_blocks", dtype=dtype, head_dim=d, block_size=bs, batch=64))
    for dtype in ("bfloat16", "float8_e4m3fn"):
        for batch, context in ((1, 2048), (1, 32768), (8, 8192), (64, 2048), (256, 2048),
                               (256, 8192), (16, 32768)):  # fmt: skip
            cases.append(_case("decode", dtype=dtype, batch=batch, context=context))
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
    return cases


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
    ]  # fmt: skip


def grid_ci() -> list[Case]:
    """A few minutes' subset for CI: each dtype, head_dim and GQA group of the attention
    kernels at least once, both block sizes, window/cap/splits, the KV ops, one rejected
    shape and the Llama decode and mixed steps."""
    cases = [_case("decode", dtype=dt) for dt in DTYPES]
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
        _case("write_kv", batch=512),
        _case("write_kv", dtype="float8_e4m3fn", batch=512),
        _case("copy_blocks", batch=64),
    ]
    return cases + [c for c in steps() if c.model == "llama8b"]


GRIDS = {"ci": grid_ci, "full": grid_full}


# ------------------------------------------------------------------------ failure rule


def verdict(row: dict) -> str:
    """ "pass", "expected: <why>" (recorded, not a failure) or "fail: <why>" for one row."""
    status = row["status"]
    if status.startswith("rejected"):
        return "expected: rejected by the kernels' validation"
    if status != "ok":
        return f"fail: {status}"
    if (row.get("smem_bytes") or 0) > SMEM_LIMIT_BYTES:
        return f"fail: dynamic shared memory {row['smem_bytes']} B > {SMEM_LIMIT_BYTES} B"
    spill = max(row.get("spill_bytes_nvjitlink") or 0, row.get("spill_bytes_ptxas") or 0)
    if spill:
        if row["dtype"] in NO_SPILL_DTYPES:
            return f"fail: spills {spill} B in a {row['dtype']} kernel"
        return f"expected: spills {spill} B ({row['dtype']})"
    return "pass"


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
)


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
    )
    return row


# --------------------------------------------------------------------------- roofline


def traffic(case: Case) -> roofline.Traffic | None:
    """Bytes the case's kernel must move (None for whole steps)."""
    import numpy as np

    cache = np.dtype(_np_dtype(case.dtype)).itemsize
    q = np.dtype(_np_dtype(case.q_dtype)).itemsize
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


def _np_dtype(name: str):
    import ml_dtypes  # jax's dependency; numpy itself has no bf16/fp8
    import numpy as np

    return np.dtype(getattr(ml_dtypes, name, None) or name)


# ------------------------------------------------------------------------- toolchain


@dataclass(frozen=True)
class Toolchain:
    ptxas: str
    nvjitlink: str


def find_toolchain() -> Toolchain | str:
    """The assemblers and the CUDA plugin, or a sentence saying what is missing."""
    if _find_spec("jax_plugins.xla_cuda12") is None:
        return "jax-cuda12-plugin is not installed (scripts/gpu_compile_check.sh installs it)"
    found = {}
    for key, package, rel in (
        ("ptxas", "nvidia.cuda_nvcc", "bin/ptxas"),
        ("nvjitlink", "nvidia.nvjitlink", "lib/libnvJitLink.so.12"),
    ):
        spec = _find_spec(package)
        roots = (spec.submodule_search_locations or []) if spec else []
        hits = [pathlib.Path(r) / rel for r in roots if (pathlib.Path(r) / rel).exists()]
        if not hits:
            return f"{package} ({rel}) is not installed (scripts/gpu_compile_check.sh installs it)"
        found[key] = str(hits[0])
    return Toolchain(**found)


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
                  "GetErrorLogSize", "GetErrorLog", "Destroy")
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


def kernel_ptx(dump: pathlib.Path) -> dict[str, pathlib.Path]:
    """Entry name -> the dumped PTX file that defines it, for our kernels."""
    out = {}
    for path in dump.glob("*.ptx"):
        for name in re.findall(r"\.entry (\w+)\(", path.read_text()):
            if name.startswith(KERNEL_NAMES):
                out[name] = path
    return out


class Target:
    """The compile-only H200 devices and the sharding every argument carries."""

    def __init__(self):
        import jax
        from jax.experimental import topologies
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        topo = topologies.get_topology_desc(
            platform="cuda", target_config=TARGET_CONFIG, topology="1x1x1"
        )
        self.device = topo.devices[0]
        self.sharding = NamedSharding(Mesh([self.device], ("x",)), PartitionSpec())
        self.jax = jax

    def spec(self, shape, dtype="int32"):
        return self.jax.ShapeDtypeStruct(tuple(shape), _np_dtype(dtype), sharding=self.sharding)


def kernel_fn_and_args(case: Case, t: Target):
    """The jitted callable and ShapeDtypeStruct arguments of a kernel case."""
    import pallas_kernels as pk

    bs, d, kv = case.block_size, case.head_dim, NUM_KV_HEADS
    pages = -(-case.context // bs)
    # A pool that holds the whole batch, within POOL_BYTES of K + V on the device.
    block_bytes = 2 * kv * bs * d * _np_dtype(case.dtype).itemsize
    num_blocks = min(max(case.batch * pages, 64), POOL_BYTES // block_bytes) + 1
    cache = t.spec((num_blocks, kv, bs, d), case.dtype)
    kw = dict(scale=d**-0.5, sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    if case.num_splits:
        kw["num_splits"] = case.num_splits
    if case.kernel == "decode":
        q = t.spec((case.batch, kv * case.group, d), case.q_dtype)
        args = (q, cache, cache, t.spec((case.batch, pages)), t.spec((case.batch,)))
        return functools.partial(pk.paged_attention, **kw), args
    if case.kernel == "ragged":
        q = t.spec((case.num_tokens, kv * case.group, d), case.q_dtype)
        tables, lens, qsl = (
            t.spec((case.batch, pages)),
            t.spec((case.batch,)),
            t.spec((case.batch + 1,)),
        )
        return functools.partial(pk.ragged_paged_attention, **kw), (
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
}  # fmt: skip


def step_fn_and_args(case: Case, t: Target):
    """The engine's jitted step of a two-layer model, with abstract weights (nothing of
    the 8B-shaped weights is allocated) and a pool sized like a real 32-layer deployment."""
    import jax
    from flax import nnx

    from paged_jax.config import EngineConfig
    from paged_jax.model_api import model_kv_cache_groups
    from paged_jax.models import LlamaForCausalLM
    from paged_jax.models.gemma import Gemma2ForCausalLM
    from paged_jax.worker.input_batch import InputBatch
    from paged_jax.worker.runner import Runner

    cls = {"llama8b": LlamaForCausalLM, "gemma2": Gemma2ForCausalLM}[case.model]
    config = cls.config_from_hf(MODEL_HF[case.model], {}, "bfloat16")
    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), attention_backend="pallas"))
    engine_config = EngineConfig(
        block_size=case.block_size,
        num_kv_blocks=64,  # the runner's own (concrete) caches; replaced by specs below
        max_num_seqs=case.batch,
        max_num_batched_tokens=max(case.num_tokens, case.batch),
        max_model_len=case.context,
        attention_backend="pallas",
        dtype="bfloat16",
    )
    runner = Runner(model, engine_config)
    groups = model_kv_cache_groups(model)  # Gemma 2: a full and a sliding-window group
    step = InputBatch(engine_config, kv_cache_groups=groups).dummy_step_input(
        case.num_tokens, case.batch, decode_only=case.decode_only
    )
    # ~100 GB of KV over 32 layers: the per-layer pool an 8B model gets on an H200.
    pool_blocks = POOL_BYTES // 32 // (2 * NUM_KV_HEADS * case.block_size * case.head_dim * 2)

    def spec(x):
        shape = tuple(getattr(x, "shape", ()))
        return t.spec(shape, str(x.dtype))

    args = list(jax.tree.map(spec, runner.step_args(step)))
    args[1] = [
        tuple(t.spec((pool_blocks, *k.shape[1:]), str(k.dtype)) for k in pair)
        for pair in runner.kv_caches
    ]
    return runner.jitted_step, tuple(args)


def compile_case(case: Case, t: Target, tools: Toolchain) -> list[dict]:
    """Rows for one case: one per Pallas kernel in its compiled module."""
    import jax

    is_step = case.kernel == "step"
    first_kernel = {
        "decode": "paged_decode_attention",
        "ragged": "ragged_paged_attention",
        "write_kv": "paged_write_kv",
        "copy_blocks": "paged_copy_blocks",
    }.get(case.kernel, "step")
    start = time.perf_counter()
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
            lowered.compile(
                compiler_options={"xla_dump_to": str(dump), "xla_dump_emitter_re": "ptx"}
            )
        except Exception as e:  # noqa: BLE001 - a compile error is a recorded failure
            row = base_row(case, first_kernel)
            row["status"] = f"error: {type(e).__name__}: {str(e)[:400]}"
            row["verdict"] = verdict(row)
            return [row]
        compile_s = time.perf_counter() - start
        launches, ptx = kernel_launches(dump), kernel_ptx(dump)
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
            )
            if name in ptx:
                row["regs_nvjitlink"], row["spill_bytes_nvjitlink"] = nvjitlink_stats(
                    tools, ptx[name]
                )
                row["regs_ptxas"], row["spill_bytes_ptxas"] = ptxas_stats(tools, ptx[name])
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


# ------------------------------------------------------------------------------ main


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
        f"{row['compile_s'] or 0:5.1f}s  {row['verdict'][:60]}",
        flush=True,
    )


def markdown_table(rows: list[dict], pattern: str = "") -> str:
    """The rows (those whose case matches `pattern`) as the table in docs/kernels.md."""
    lines = [
        "| case | kernel | grid | warps | regs nvJitLink / ptxas | spill B (stores) | smem B "
        "| roofline us | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not re.search(pattern, r["case"]):
            continue
        grid = "x".join(map(str, r["grid"])) if r["grid"] else "-"
        regs = f"{r['regs_nvjitlink']} / {r['regs_ptxas']}" if r["regs_ptxas"] else "-"
        spill = f"{r['spill_bytes_nvjitlink'] or 0} / {r['spill_bytes_ptxas'] or 0}"
        smem = f"{r['smem_bytes']:,}" if r["smem_bytes"] is not None else "-"
        us = f"{r['roofline_us']:.1f}" if r["roofline_us"] is not None else "-"
        lines.append(
            f"| {r['case']} | {r['kernel']} | {grid} | {r['warps'] or '-'} | {regs} | {spill} "
            f"| {smem} | {us} | {r['verdict'].split(' (')[0]} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), default="ci")
    parser.add_argument("--output", default=None, help=f"JSON (default: full -> {FULL_OUTPUT})")
    parser.add_argument("--only", default=None, help="regex: compile only matching case names")
    parser.add_argument("--list", action="store_true", help="print the grid; compile nothing")
    parser.add_argument(
        "--table", metavar="JSON", help="print a report's rows (--only filters) as markdown"
    )
    args = parser.parse_args(argv)
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

    output = pathlib.Path(args.output or (FULL_OUTPUT if args.grid == "full" else CI_OUTPUT))
    ptxas_version = (
        subprocess.run([tools.ptxas, "--version"], capture_output=True, text=True, check=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    header = dict(
        target="NVIDIA H200 (sm_90a), deviceless compile",
        command=f"python scripts/gpu_compile_check.py --grid {args.grid}",
        jax_version=jax.__version__,
        ptxas=ptxas_version,
        smem_limit_bytes=SMEM_LIMIT_BYTES,
        bandwidth_bytes_per_s=roofline.H200_BYTES_PER_S,
        rule=(
            "fail on a compile error, a spill in a bf16/f16/fp8 kernel, or dynamic shared "
            "memory over the limit; validation rejections and f32 spills are recorded"
        ),
        num_kv_heads=NUM_KV_HEADS,
    )
    target = Target()
    rows: list[dict] = []
    start = time.perf_counter()
    for case in cases:
        for row in compile_case(case, target, tools):
            rows.append(row)
            print_row(row)
        write_report(output, dict(header, wall_s=round(time.perf_counter() - start, 1)), rows)
    failed = failures(rows)
    print(f"gpu_compile_check: {len(cases)} cases, {len(rows)} rows in "
          f"{time.perf_counter() - start:.0f} s; wrote {output}")  # fmt: skip
    for line in failed:
        print(f"FAIL {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
