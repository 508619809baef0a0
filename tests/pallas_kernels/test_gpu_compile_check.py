"""scripts/gpu_compile_check.py: its grid, row schema, failure rule and log parsing (no
toolchain needed), and one real deviceless H200 compile where the CUDA plugin and the
NVIDIA assemblers are installed (scripts/gpu_compile_check.sh installs them)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_compile_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_compile_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gcc = _load()


def test_full_grid_covers_what_users_run():
    cases = gcc.grid_full()
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "case names must be unique (they key the JSON rows)"
    attn = [c for c in cases if c.kernel in ("decode", "ragged")]
    assert {c.dtype for c in attn} == set(gcc.DTYPES)
    assert {c.head_dim for c in attn} == {64, 128, 256, 80, 96}
    assert {c.group for c in attn} == {1, 4, 8}
    assert {c.block_size for c in attn} == {16, 32}
    assert {c.kernel for c in cases} == {"decode", "ragged", "write_kv", "copy_blocks", "step"}
    assert any(c.sliding_window for c in attn) and any(c.soft_cap for c in attn)
    assert any(c.num_splits for c in attn)
    assert min(c.batch for c in attn) == 1 and max(c.batch for c in attn) == 256
    assert max(c.context for c in attn) == 32768
    mixed = [c for c in attn if c.kernel == "ragged" and c.prefill and c.batch > len(c.prefill)]
    assert mixed, "ragged mixes of prefill chunks and decode tokens"
    assert {c.model for c in cases if c.kernel == "step"} == {"llama8b", "gemma2"}


def test_ci_grid_is_a_subset_of_the_full_grid():
    full = {c.name: c for c in gcc.grid_full()}
    ci = gcc.grid_ci()
    assert 10 <= len(ci) <= 40
    for c in ci:
        assert full.get(c.name) == c, f"{c.name} is not in --grid full"
    assert {c.dtype for c in ci if c.kernel == "decode"} == set(gcc.DTYPES)
    assert any(c.head_dim == 80 for c in ci), "one case the validation rejects"
    assert any(c.kernel == "step" for c in ci)


def _row(**kw):
    case = gcc.Case("synthetic", "decode", dtype=kw.pop("dtype", "bfloat16"))
    row = gcc.base_row(case, "paged_decode_attention")
    row.update(status="ok", smem_bytes=74240, spill_bytes_nvjitlink=0, spill_bytes_ptxas=0)
    row.update(kw)
    return row


def test_row_schema():
    row = gcc.base_row(gcc.Case("c", "decode"), "paged_decode_attention")
    assert tuple(row) == gcc.ROW_KEYS
    for key in ("grid", "warps", "regs_nvjitlink", "regs_ptxas", "spill_bytes_nvjitlink",
                "spill_bytes_ptxas", "smem_bytes", "compile_s", "roofline_us"):  # fmt: skip
        assert key in row and row[key] is None


@pytest.mark.parametrize(
    "kw,expected",
    [
        ({}, "pass"),
        (dict(status="rejected: head_dim=80 must be a power of two"), "expected"),
        (dict(status="error: XlaRuntimeError: RESOURCE_EXHAUSTED"), "fail"),
        (dict(spill_bytes_ptxas=20), "fail"),  # bf16: either path spilling fails
        (dict(dtype="float8_e4m3fn", spill_bytes_nvjitlink=8), "fail"),
        (dict(dtype="float16", spill_bytes_nvjitlink=8), "fail"),
        (dict(dtype="float32", spill_bytes_nvjitlink=136), "expected"),
        (dict(smem_bytes=gcc.SMEM_LIMIT_BYTES + 1), "fail"),
        (dict(smem_bytes=gcc.SMEM_LIMIT_BYTES), "pass"),
    ],
)
def test_failure_rule(kw, expected):
    row = _row(**kw)
    assert gcc.verdict(row).split(":")[0] == expected
    assert bool(gcc.failures([row])) == (expected == "fail")


def test_assembler_logs_and_thunk_list_parse(tmp_path):
    ptxas = (
        "ptxas info    : Function properties for k\n"
        "    0 bytes stack frame, 252 bytes spill stores, 180 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers\n"
    )
    assert gcc.parse_assembler_log(ptxas) == (255, 252)
    jitlink = "info    : used 248 registers, used 1 barriers, 0 stack, 1024 bytes smem\n"
    assert gcc.parse_assembler_log(jitlink) == (248, 0)
    (tmp_path / "m.thunk_sequence.txt").write_text(
        "004: kCustomKernel [x] loop_pad_fusion grid: [2048, 1, 1] threads: [128, 1, 1]  "
        "shared_memory: 0 bytes\n"
        "005: kCustomKernel [x] paged_decode_attention grid: [64, 8, 1] threads: [128, 1, 1]  "
        "shared_memory: 74240 bytes\n"
    )
    assert gcc.kernel_launches(tmp_path) == {
        "paged_decode_attention": dict(grid=[64, 8, 1], threads=128, smem=74240)
    }


def test_roofline_column_of_a_decode_case():
    case = gcc.Case("c", "decode", batch=64, context=8192)
    assert gcc.traffic(case).total_bytes == 2_148_663_812  # test_roofline.py, by hand


@pytest.mark.skipif(
    isinstance(gcc.find_toolchain(), str), reason=f"no CUDA toolchain: {gcc.find_toolchain()}"
)
def test_tiny_cases_compile_for_an_h200(tmp_path):
    out = tmp_path / "rows.json"
    only = "^(copy_blocks-bf16|decode-bf16-d64-g1-bs32|decode-bf16-d80)"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(SCRIPT), "--grid", "ci", "--only", only, "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["kernel"]: r for r in json.loads(out.read_text())["rows"] if r["status"] == "ok"}
    decode = rows["paged_decode_attention"]
    assert decode["grid"] == [64, 8, 1] and decode["warps"] == 4
    assert 0 < decode["smem_bytes"] <= gcc.SMEM_LIMIT_BYTES
    assert decode["regs_nvjitlink"] > 0 and decode["regs_ptxas"] > 0
    assert rows["paged_copy_blocks"]["smem_bytes"] == 0
    report = json.loads(out.read_text())
    rejected = [r for r in report["rows"] if r["status"].startswith("rejected")]
    assert rejected and "power of two" in rejected[0]["status"]
    assert report["failures"] == []


def test_markdown_table_of_synthetic_rows():
    ok = _row(grid=[64, 8, 1], warps=4, regs_nvjitlink=248, regs_ptxas=192, roofline_us=447.6)
    ok["verdict"] = gcc.verdict(ok)
    rejected = _row(status="rejected: head_dim=80 must be a power of two")
    rejected["verdict"] = gcc.verdict(rejected)
    lines = gcc.markdown_table([ok, rejected]).splitlines()
    assert lines[2] == (
        "| synthetic | paged_decode_attention | 64x8x1 | 4 | 248 / 192 | 0 / 0 | 74,240 "
        "| 447.6 | pass |"
    )
    assert lines[3].endswith("| expected: rejected by the kernels' validation |")
