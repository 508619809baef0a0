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
# A hang guard, not a speed limit: deviceless compiles take minutes on a loaded 2-core
# machine; no test asserts how long one took.
HANG_GUARD_S = 1200


def _load():
    spec = importlib.util.spec_from_file_location("gpu_compile_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gcc = _load()


def test_full_grid_covers_what_users_run():
    from pallas_kernels.validation import CACHE_DTYPES

    cases = gcc.grid_full()
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "case names must be unique (they key the JSON rows)"
    attn = [c for c in cases if c.kernel in ("decode", "ragged")]
    assert {c.dtype for c in attn} == set(gcc.GRID_DTYPES)
    assert set(gcc.GRID_DTYPES) == {d.name for d in CACHE_DTYPES}, "every dtype the kernels take"
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
    assert {c.model for c in cases if c.kernel == "step"} == {
        "llama8b", "gemma2", "mixtral-tiny", "qwen3moe",
    }  # fmt: skip
    # every kernel at every dtype and head_dim, the non-power-of-two ones included
    for kernel in ("decode", "ragged", "write_kv", "copy_blocks"):
        have = {(c.dtype, c.head_dim) for c in cases if c.kernel == kernel}
        assert have >= {(dt, d) for dt in gcc.GRID_DTYPES for d in (64, 128, 256, 80, 96)}, kernel
    # f32 decode (must not spill) at every head_dim, group and the batch / context ends
    f32 = [c for c in attn if c.kernel == "decode" and c.dtype == "float32"]
    assert {(c.head_dim, c.group) for c in f32} >= {
        (d, g) for d in gcc.HEAD_DIMS for g in (1, 4, 8)
    }
    assert {c.batch for c in f32} >= {1, 256} and max(c.context for c in f32) == 32768
    # batch 1-256 and contexts 2k-32k for both attention kernels
    for kernel in ("decode", "ragged"):
        mine = [c for c in attn if c.kernel == kernel]
        assert {1, 256} <= {c.batch for c in mine}, kernel
        assert {2048, 32768} <= {c.context for c in mine}, kernel
    # ragged mixes: decode tokens only, one long prefill chunk, a chunk among many
    # decodes (decode-heavy), several prefills, and fp8 mixes
    ragged = [c for c in attn if c.kernel == "ragged"]
    assert any(not c.prefill for c in ragged)
    assert any(c.prefill and c.batch == len(c.prefill) for c in ragged)
    assert any(c.prefill and c.batch - len(c.prefill) >= 255 for c in ragged)
    assert any(len(c.prefill) >= 8 for c in ragged)
    assert any(c.prefill and c.dtype.startswith("float8") for c in ragged)
    # head_dim 80 / 96 in mixes and with window / cap (the masked lanes meet the masks)
    odd = [c for c in ragged if c.head_dim in (80, 96)]
    assert any(c.sliding_window and c.soft_cap for c in odd)
    # whole steps: mixed and decode-only buckets of both models, and TP=2 of Llama
    steps = [c for c in cases if c.kernel == "step"]
    assert {(c.model, c.decode_only, c.tp) for c in steps} >= {
        ("llama8b", False, 1), ("llama8b", True, 1), ("gemma2", False, 1),
        ("gemma2", True, 1), ("llama8b", False, 2), ("llama8b", True, 2),
    }  # fmt: skip
    assert all(c.sliding_window and c.soft_cap for c in steps if c.model == "gemma2")


def test_ci_grid_is_a_subset_of_the_full_grid():
    full = {c.name: c for c in gcc.grid_full()}
    ci = gcc.grid_ci()
    assert 10 <= len(ci) <= 40
    for c in ci:
        assert full.get(c.name) == c, f"{c.name} is not in --grid full"
    assert {c.dtype for c in ci if c.kernel == "decode"} == set(gcc.GRID_DTYPES)
    assert any(c.head_dim == 80 for c in ci), "a head_dim that is not a power of two"
    assert any(c.kernel == "step" for c in ci)
    # one case of each kernel family at head_dim 80 and with an fp8 cache
    for kernel in ("decode", "ragged", "write_kv", "copy_blocks"):
        assert any(c.kernel == kernel and c.head_dim == 80 for c in ci), kernel
        assert any(c.kernel == kernel and c.dtype.startswith("float8") for c in ci), kernel


def test_smoke_grid_is_ci_cases_of_every_kernel_and_a_step():
    ci = {c.name: c for c in gcc.grid_ci()}
    smoke = gcc.grid_smoke()
    assert [c.name for c in smoke] == list(gcc.SMOKE_CASES), "every SMOKE_CASES name is in ci"
    assert all(ci[c.name] == c for c in smoke)
    kernels = {c.kernel for c in smoke}
    assert {"decode", "ragged", "write_kv", "copy_blocks", "step"} <= kernels
    assert any(c.dtype.startswith("float8") for c in smoke)
    assert any(c.name.startswith("probe-") for c in smoke), "the expected-failure rule is run"


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
        # head_dim 80/96 are served (masked to the next power of two): a rejection fails
        (dict(status="rejected: head_dim=80 must be a power of two"), "fail"),
        (dict(status="error: XlaRuntimeError: RESOURCE_EXHAUSTED"), "fail"),
        (dict(spill_bytes_ptxas=20), "fail"),  # bf16: either path spilling fails
        (dict(dtype="float8_e4m3fn", spill_bytes_nvjitlink=8), "fail"),
        (dict(dtype="float16", spill_bytes_nvjitlink=8), "fail"),
        (dict(dtype="float32", spill_bytes_nvjitlink=136), "fail"),  # f32 must not spill
        (dict(smem_bytes=gcc.SMEM_LIMIT_BYTES + 1), "fail"),
        (dict(smem_bytes=gcc.SMEM_LIMIT_BYTES), "pass"),
        # no second compile-only device: recorded, saying why, not a failure
        (dict(status="unsupported: topology 1x1x2 gave 1 device"), "expected"),
    ],
)
def test_failure_rule(kw, expected):
    row = _row(**kw)
    assert gcc.verdict(row).split(":")[0] == expected
    assert bool(gcc.failures([row])) == (expected == "fail")


def test_known_expected_failures_are_probes_a_gpu_rejects_too():
    probes = {c.name: c for c in gcc.grid_full() if c.name in gcc.KNOWN_EXPECTED_FAILURES}
    assert set(probes) == set(gcc.KNOWN_EXPECTED_FAILURES), "every listed case is in the grid"
    for name, case in probes.items():
        assert name.startswith("probe-") and case.block_k, "only deliberately oversized tiles"
        assert any(c.name == name for c in gcc.grid_ci())
        # the probe is certain to be over the limit: one K tile alone exceeds it
        itemsize = gcc.np_dtype(case.dtype).itemsize
        assert case.block_k * case.head_dim * itemsize > gcc.SMEM_LIMIT_BYTES
    name = next(iter(probes))
    row = _row(smem_bytes=None, status="error: JaxRuntimeError: RESOURCE_EXHAUSTED: Shared memory")
    row["case"] = name
    assert gcc.verdict(row).startswith("expected: ")
    assert gcc.failures([row]) == []
    row.update(status="ok", smem_bytes=1024)  # a probe that compiles means the rule is blind
    assert gcc.verdict(row).startswith("fail: ")
    assert gcc.failures([row])


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
    only = "^(copy_blocks-bf16-d128|decode-bf16-d64-g1-bs32|decode-bf16-d80)"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(SCRIPT), "--grid", "ci", "--only", only, "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"] if r["status"] == "ok"}
    decode = rows["decode-bf16-d64-g1-bs32-b64x8k"]
    # a work list of key chunks: at least one program per sequence, one row per KV head
    assert decode["grid"][0] >= 64 and decode["grid"][1:] == [8, 1] and decode["warps"] == 4
    assert 0 < decode["smem_bytes"] <= gcc.SMEM_LIMIT_BYTES
    assert decode["regs_nvjitlink"] > 0 and decode["regs_ptxas"] > 0
    assert rows["copy_blocks-bf16-d128-g4-bs16-n64"]["smem_bytes"] == 0
    report = json.loads(out.read_text())
    # head_dim 80 is served (masked to 128), not rejected
    d80 = [r for r in report["rows"] if r["head_dim"] == 80]
    assert d80 and all(r["status"] == "ok" for r in d80), d80
    assert decode["kv_buffers_in_flight"] >= 1 and decode["cp_async"] > 0
    assert report["failures"] == []
    # the toolchain the venv holds, in the header and on every row
    tools = gcc.find_toolchain()
    assert report["toolchain"]["cuda"] == tools.cuda
    assert report["toolchain"]["ptxas"].startswith(f"Build cuda_{tools.cuda[4:]}.")
    assert {r["toolchain"] for r in report["rows"]} == {report["toolchain"]["label"]}


def test_markdown_table_of_synthetic_rows():
    ok = _row(grid=[64, 8, 1], warps=4, regs_nvjitlink=248, regs_ptxas=192, roofline_us=447.6,
              cp_async=96, max_wait_group=2, kv_buffers_in_flight=2)  # fmt: skip
    ok["verdict"] = gcc.verdict(ok)
    rejected = _row(status="rejected: head_dim=80 must be a power of two")
    rejected["verdict"] = gcc.verdict(rejected)
    lines = gcc.markdown_table([ok, rejected]).splitlines()
    assert lines[2] == (
        "| synthetic | paged_decode_attention | 64x8x1 | 4 | 248 / 192 | 0 / 0 | 74,240 "
        "| 2 (96, wait 2) | 447.6 | pass |"
    )
    assert lines[3].endswith(
        "| fail: the kernels' validation rejects this shape: head_dim=80 must be a power of two |"
    )


# Synthetic PTX: a kernel's prologue, then a loop `$L__BB0_2` closed by a backward branch.
_PTX_HEAD = ".visible .entry k(\n)\n{\n\tld.global.b32 { %r1 }, [ %rd1 + 0 ];\n"
_PTX_TAIL = "\t@%p9 bra \t$L__BB0_2;\n\tbra.uni \t$L__BB0_3;\n$L__BB0_3:\n\tret;\n}\n"
_COPY = "\tcp.async.cg.shared.global [ %r2 + 0 ], [ %rd2 + 0 ], 0x10, %p1;\n"
_COMMIT = "\tcp.async.commit_group;\n"
_READ = "\tldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r3, %r4, %r5, %r6}, [%rd3];\n"
_MMA = "\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r3}, {%r4}, {%f1};\n"


def _ptx(prologue: str, body: str) -> str:
    return _PTX_HEAD + prologue + "$L__BB0_2:\n" + body + _PTX_TAIL


def test_buffering_single_buffered_loop():
    # K and V of tile 0 before the loop; each iteration waits for everything, computes,
    # then issues the next tile: nothing is in flight while the tile is consumed.
    kv = (_COPY + _COMMIT) * 2
    b = gcc.ptx_buffering(_ptx(kv, "\tcp.async.wait_group \t0;\n\tbar.sync \t0;\n"
                                    + _READ + _MMA + kv))  # fmt: skip
    assert b == dict(cp_async=4, cp_async_bulk=0, max_wait_group=0, loop_commit_groups=2,
                     loop_ld_global=0, loop_ld_global_vector=0, loop_ld_global_prefetched=0,
                     kv_buffers_in_flight=1)  # fmt: skip


def test_buffering_double_and_triple_buffered_loops():
    kv = (_COPY + _COMMIT) * 2
    # Two tiles ahead, wait leaves one tile (2 groups) in flight while consuming.
    two = _ptx(kv * 2, "\tcp.async.wait_group \t2;\n" + _READ + _MMA + kv)
    assert gcc.ptx_buffering(two)["kv_buffers_in_flight"] == 2
    assert gcc.ptx_buffering(two)["max_wait_group"] == 2
    three = _ptx(kv * 3, "\tcp.async.wait_group \t4;\n" + _READ + _MMA + kv)
    assert gcc.ptx_buffering(three)["kv_buffers_in_flight"] == 3
    # Issue the next tile before computing on this one: one tile in flight over compute.
    ahead = _ptx(kv, "\tcp.async.wait_group \t0;\n" + kv + _READ + _MMA)
    assert gcc.ptx_buffering(ahead)["kv_buffers_in_flight"] == 2


def test_buffering_without_async_copies_and_without_a_loop():
    body = (
        "\tld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];\n"
        "\t@%p2 ld.global.b32 { %r5 }, [ %rd2 + 0 ];\n"
        "\tst.shared.v4.b32 [%r9], {%r1, %r2, %r3, %r4};\n\tbar.sync \t0;\n"
        "\tld.shared.v4.b32 {%r1, %r2, %r3, %r4}, [%r9];\n"
        # wgmma's own groups are not cp.async groups
        "\twgmma.commit_group.sync.aligned;\n\twgmma.wait_group.sync.aligned 0;\n"
    )
    b = gcc.ptx_buffering(_ptx("", body))
    assert (b["cp_async"], b["max_wait_group"], b["loop_commit_groups"]) == (0, None, 0)
    assert (b["loop_ld_global"], b["loop_ld_global_vector"]) == (2, 1)
    assert b["kv_buffers_in_flight"] == 1  # synchronous loads complete before compute
    flat = _PTX_HEAD + "\tst.global.b32 [ %rd1 + 0 ], { %r1 };\n\tret;\n}\n"
    assert gcc.ptx_buffering(flat)["kv_buffers_in_flight"] is None  # no loop: not a tile loop
    bulk = _ptx("", "\tcp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                    " [%r1], [%rd1, {%r2, %r3}], [%r4];\n" + _READ)  # fmt: skip
    assert gcc.ptx_buffering(bulk)["cp_async_bulk"] == 1
    assert gcc.ptx_buffering(bulk)["cp_async"] == 0


def test_collectives_of_a_sharded_step_parse(tmp_path):
    (tmp_path / "m.sm_9.0a_gpu_after_optimizations.txt").write_text(
        "  %all-reduce-start.1 = bf16[512,4096]{1,0} all-reduce-start(%fusion.3), "
        "replica_groups={{0,1}}\n"
        "  %all-reduce-done.1 = bf16[512,4096]{1,0} all-reduce-done(%all-reduce-start.1)\n"
        "  %ar = (f32[8]{0}, f32[8]{0}) all-reduce(%a, %b), to_apply=%add\n"
        "  %all-gather = f32[64,128256]{1,0} all-gather(%logits), dimensions={1}\n"
    )
    (tmp_path / "m.sm_9.0a_gpu_after_optimizations-memory-usage-report.txt").write_text(
        "all-reduce(%x)\n"  # not the HLO module itself
    )
    assert gcc.collectives(tmp_path) == {"all-reduce": 2, "all-gather": 1}


def test_grids_hold_tensor_parallel_steps():
    tp = [c for c in gcc.grid_full() if c.kernel == "step" and c.tp == 2]
    assert {c.decode_only for c in tp} == {True, False}
    assert any(c.tp == 2 for c in gcc.grid_ci())


def test_compare_table_of_before_and_after(tmp_path):
    before = _row(grid=[64, 8, 1], warps=4, regs_nvjitlink=248, regs_ptxas=192, cp_async=67,
                  max_wait_group=0, kv_buffers_in_flight=1)  # fmt: skip
    before["verdict"] = gcc.verdict(before)
    after = dict(before, regs_nvjitlink=232, smem_bytes=139264, max_wait_group=2,
                 kv_buffers_in_flight=2, cp_async=96)  # fmt: skip
    rejected = dict(_row(status="rejected: head_dim=80 must be a power of two"), case="d80")
    rejected["verdict"] = gcc.verdict(rejected)
    served = dict(before, case="d80", head_dim=80)
    only_before = dict(before, case="gone")
    paths = []
    for name, rows in (("before", [before, rejected, only_before]), ("after", [after, served])):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(dict(rows=rows)))
    lines = gcc.compare_table(*(json.loads(p.read_text())["rows"] for p in paths)).splitlines()
    assert len(lines) == 4, "a row per (case, kernel) in both reports; 'gone' is left out"
    assert lines[0].startswith("| case | kernel | grid |")
    assert lines[2] == (
        "| synthetic | paged_decode_attention | 64x8x1 | 248 → 232 | 192 | 0 / 0 "
        "| 74,240 → 139,264 | 1 (67, wait 0) → 2 (96, wait 2) | pass |"
    )
    assert "| fail → pass |" in lines[3] and "- → 248" in lines[3]
    assert gcc.main(["--compare", str(paths[0]), str(paths[1])]) == 0


def test_buffering_of_tiles_prefetched_into_registers():
    # Tile i+1 is loaded into registers while tile i computes; its values are only used
    # (stored to shared memory) in the next iteration, reached through the loop's movs.
    load = "\tld.global.v4.b32 { %r11, %r12, %r13, %r14 }, [ %rd5 + 0 ];\n"
    body = (
        "\tst.shared.v4.b32 [%r9], {%r1, %r2, %r3, %r4};\n\tbar.sync \t0;\n"
        + load + _READ + _MMA
        + "".join(f"\tmov.b32 \t%r{i}, %r{i + 10};\n" for i in (1, 2, 3, 4))
    )  # fmt: skip
    first = "\tld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd4 + 0 ];\n"  # tile 0
    b = gcc.ptx_buffering(_ptx(first, body))
    assert (b["loop_ld_global_vector"], b["loop_ld_global_prefetched"]) == (1, 1)
    assert b["kv_buffers_in_flight"] == 2
    # A page id loaded one tile ahead feeds only addresses (and a mask): not a K/V buffer.
    page = "\tld.global.b32 { %r20 }, [ %rd6 + 0 ];\n"
    body = (
        "\tmul.wide.s32 \t%rd7, %r21, 512;\n\tadd.s64 \t%rd8, %rd1, %rd7;\n"
        "\tsetp.eq.s32 \t%p3, %r21, 0;\n\tselp.f32 \t%f2, 0fFF800000, %f1, %p3;\n"
        "\tld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd8 + 0 ];\n"
        "\tst.shared.v4.b32 [%r9], {%r1, %r2, %r3, %r4};\n\tbar.sync \t0;\n"
        + _READ + _MMA + page + "\tmov.b32 \t%r21, %r20;\n"
    )  # fmt: skip
    b = gcc.ptx_buffering(_ptx(page, body))
    assert (b["loop_ld_global"], b["loop_ld_global_prefetched"]) == (2, 0)
    assert b["kv_buffers_in_flight"] == 1


def test_kernel_pools_stay_out_of_the_offset_wrap_range():
    # write_kv at 512 tokens x 8k context wants 262,145 blocks: an fp8 head_dim-64 cache
    # of 2**31 + 8,192 elements in 2 GiB, which the kernels refuse (32-bit offsets wrap).
    from pallas_kernels.layout import offsets_wrap

    for case in gcc.grid_full():
        if case.kernel in ("decode", "ragged", "write_kv", "copy_blocks"):
            blocks = gcc.kernel_pool_blocks(case)
            shape = (blocks, gcc.NUM_KV_HEADS, case.block_size, case.head_dim)
            assert not offsets_wrap(shape, gcc.np_dtype(case.dtype).itemsize), case.name
            assert blocks >= 64, case.name


def test_grids_hold_the_mosaic_kernels():
    mosaic = {c.name: c for c in gcc.grid_full() if c.backend == "mosaic"}
    assert {
        "mosaic-decode-bf16-d128-g4-bs16-b64x2k",
        "mosaic-decode-e4m3-d128-g4-bs16-b64x2k",
        "mosaic-ragged-bf16-d128-g4-bs16-b64x4k-pf256",
        "mosaic-ragged-e4m3-d128-g4-bs16-b64x4k-pf256",
    } <= set(mosaic)
    assert all(name.startswith("mosaic-") for name in mosaic)
    assert {c.kernel for c in mosaic.values()} == {"decode", "ragged"}
    # head_dim 80/96/256 fail Mosaic's layout inference at the default tiling: left out
    assert {c.head_dim for c in mosaic.values()} <= {64, 128}
    ci = [c for c in gcc.grid_ci() if c.backend == "mosaic"]
    assert len(ci) == 1 and ci[0].name == "mosaic-decode-bf16-d128-g4-bs16-b64x2k"


def _mosaic_row(**kw):
    case = gcc.mosaic("decode", batch=64, context=2048)
    row = gcc.base_row(case, "paged_decode_attention_mosaic")
    row.update(status="ok", grid=[97, 8, 1], warps=4, smem_bytes=188672)
    row.update(deferred=gcc.MOSAIC_DEFERRED, **kw)
    return row


@pytest.mark.parametrize(
    "kw,expected",
    [
        ({}, "pass"),  # no registers or spills: the cubin is built at load time
        (dict(smem_bytes=gcc.SMEM_LIMIT_BYTES + 1), "fail"),
        (dict(status="error: MosaicError: failed to infer layout"), "fail"),
        (dict(status="error: no mosaic_gpu_v2 custom call in the compiled module"), "fail"),
    ],
)
def test_failure_rule_of_mosaic_rows(kw, expected):
    row = _mosaic_row(**kw)
    assert row["regs_ptxas"] is None and row["spill_bytes_ptxas"] is None
    assert gcc.verdict(row).split(":")[0] == expected


def test_mosaic_smem_is_the_kernels_own_estimate():
    pytest.importorskip("jax")
    from pallas_kernels.mosaic_decode import SMEM_BUDGET

    bf16 = gcc.mosaic_smem_bytes(gcc.mosaic("decode", batch=64, context=2048))
    fp8 = gcc.mosaic_smem_bytes(gcc.mosaic("decode", dtype="float8_e4m3fn", batch=64))
    assert 0 < fp8 < bf16 <= SMEM_BUDGET < gcc.SMEM_LIMIT_BYTES


def test_merge_replaces_only_the_compiled_cases():
    a, b, c = (dict(_row(), case=n, kernel="k") for n in ("a", "b", "c"))
    del a["deferred"]  # a row of a report written before the key existed
    new_b = dict(b, smem_bytes=1)
    merged = gcc.merge_rows([a, b, c], [new_b, dict(c, case="d")], ["a", "d", "b", "c"])
    assert [r["case"] for r in merged] == ["a", "d", "b", "c"]
    assert merged[2]["smem_bytes"] == 1 and merged[0] == dict(a, deferred=None)
    assert all(tuple(r) == gcc.ROW_KEYS for r in merged)


def _mosaic_skip_reason() -> str | None:
    tools = gcc.find_toolchain()
    if isinstance(tools, str):
        return f"no CUDA toolchain: {tools}"
    import jax

    from pallas_kernels.names import mosaic_jax_reason

    return mosaic_jax_reason(jax.__version__)


@pytest.mark.skipif(_mosaic_skip_reason() is not None, reason=str(_mosaic_skip_reason()))
def test_mosaic_case_compiles_for_an_h200_and_merges(tmp_path):
    out = tmp_path / "rows.json"
    kept = dict(_row(), case="decode-bf16-d128-g4-bs16-b64x8k", verdict="pass")
    out.write_text(json.dumps(dict(target="x", rows=[kept], failures=[])))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(SCRIPT), "--grid", "ci", "--only", "^mosaic-", "--merge",
           "--output", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["target"] == "x" and report["merged_runs"][0]["cases"] == 1
    first, row = report["rows"]
    assert first == dict(kept, deferred=None), "the other rows are kept, not recompiled"
    assert row["case"] == "mosaic-decode-bf16-d128-g4-bs16-b64x2k"
    assert row["kernel"] == "paged_decode_attention_mosaic" and row["status"] == "ok"
    # a work list of key chunks: at least one program per sequence, one per KV head
    assert row["grid"][0] > 64 and row["grid"][1:] == [8, 1] and row["warps"] == 4
    estimate = gcc.mosaic_smem_bytes(gcc.mosaic("decode", batch=64, context=2048))
    if row["deferred"]:  # the cubin is built at load time: the kernel's own estimate
        assert row["smem_bytes"] == estimate
        assert row["regs_ptxas"] is None and "deferred to load time" in row["deferred"]
    else:  # Mosaic ran ptxas during the compile (jax 0.11.2 + CUDA 13): its own report
        assert 0 < row["regs_ptxas"] <= 255 and row["spill_bytes_ptxas"] == 0, row
        assert row["smem_bytes_estimate"] == estimate
        assert 0 < row["smem_bytes"] <= gcc.SMEM_LIMIT_BYTES
    assert row["verdict"] == "pass" and report["failures"] == []


def test_markdown_table_of_a_mosaic_row():
    row = _mosaic_row()
    row["verdict"] = gcc.verdict(row)
    line = gcc.markdown_table([row]).splitlines()[2]
    assert line.startswith(
        "| mosaic-decode-bf16-d128-g4-bs16-b64x2k | paged_decode_attention_mosaic "
    )
    assert "| 97x8x1 | 4 | deferred to load time | deferred to load time | 188,672 |" in line


def test_grids_hold_moe_steps_with_each_grouped_matmul():
    from paged_jax.models.moe import EXPERT_MATMULS

    moe = [c for c in gcc.grid_full() if c.expert_matmul]
    assert {(c.model, c.expert_matmul) for c in moe} == {
        (m, mm) for m in ("mixtral-tiny", "qwen3moe") for mm in EXPERT_MATMULS
    }
    assert {c.expert_matmul for c in moe if c.tp == 2} == set(EXPERT_MATMULS)
    ci = [c for c in gcc.grid_ci() if c.expert_matmul]
    assert [c.name for c in ci] == ["step-mixtral-tiny-mixed-t512-s64-tiled"]
    assert gcc.MODEL_HF["qwen3moe"]["num_experts"] == 128  # Qwen3-30B-A3B's layer shape


def test_moe_lowering_reads_the_scoped_matmuls(tmp_path):
    meta = 'metadata={op_name="jit(step)/while/body/moe_expert_matmul/ragged_dot_general"}'
    (tmp_path / "m.gpu_after_optimizations.txt").write_text(
        "  %f = bf16[512,128,2048]{2,1,0} fusion(%x), kind=kLoop, " + meta + "\n"
        "  %g = f32[8,512,768]{2,1,0} fusion(%a, %b), kind=kCustom, " + meta
        + ', backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}\n'
        '  %c = (bf16[64,32]{1,0}, s8[0]{0}) custom-call(%p, %q), custom_call_target="__cublas$gemm", '
        'metadata={op_name="jit(step)/moe_expert_matmul/dot_general"}\n'
        '  %d = bf16[64,32]{1,0} dot(%p, %q), metadata={op_name="jit(step)/mlp/dot_general"}\n'
    )  # fmt: skip
    got = gcc.moe_lowering(tmp_path, "moe_expert_matmul", "ragged_dot")
    assert got == dict(
        matmul="ragged_dot",
        ops=[
            "fusion __triton_nested_gemm_fusion f32[8,512,768]",
            "custom-call __cublas$gemm (bf16[64,32], s8[0])",
        ],
        num_ops=2,
    )


@pytest.mark.skipif(
    isinstance(gcc.find_toolchain(), str), reason=f"no CUDA toolchain: {gcc.find_toolchain()}"
)
def test_tiny_moe_step_compiles_for_an_h200(tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(SCRIPT), "--grid", "ci", "--only", "^step-mixtral-tiny",
           "--output", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert rows and all(r["status"] == "ok" for r in rows) and report["failures"] == []
    lowering = rows[0]["moe_lowering"]
    assert lowering["matmul"] == "tiled" and lowering["num_ops"] >= 3, lowering
    # the step updates its KV pool in place: aliased input-to-output, few temporaries
    row = rows[0]
    pool = row["kv_pool_bytes"]
    # K and V of two stacked layers x (4 KV heads x block 16 x head_dim 64 x bf16) per block
    blocks = gcc.POOL_BYTES // 32 // (2 * gcc.NUM_KV_HEADS * 16 * 64 * 2)
    assert pool == 2 * 2 * blocks * (4 * 16 * 64 * 2), pool
    assert row["alias_bytes"] >= pool and row["output_bytes"] >= pool, row
    assert row["kv_layer_bytes"] == pool // 2 and row["temp_limit_bytes"] is None, row
    assert row["temp_bytes"] < gcc.MAX_TEMP_FRACTION * pool, row  # 1.7% measured


def _step_row(**kw):
    case = gcc.Case("step-synthetic", "step", model="llama8b")
    row = gcc.base_row(case, "paged_write_kv")
    row.update(status="ok", smem_bytes=0, kv_pool_bytes=1000, kv_layer_bytes=500)
    row.update(alias_bytes=1016, temp_bytes=49, temp_limit_bytes=50)
    row.update(argument_bytes=1100, output_bytes=1020)
    row.update(kw)
    return row


@pytest.mark.parametrize(
    "kw,expected",
    [
        ({}, "pass"),
        (dict(alias_bytes=16), "fail"),  # the KV pool is not donated: copied every step
        (dict(alias_bytes=999), "fail"),  # one of the pool's tensors is not aliased
        (dict(temp_bytes=50), "fail"),  # 5% of a full-depth step's pool
        (dict(temp_bytes=600, temp_limit_bytes=None), "pass"),  # two layers: recorded only
        (dict(alias_bytes=None, temp_bytes=None), "fail"),  # no evidence either way
        (dict(kv_pool_bytes=None, alias_bytes=None, temp_bytes=None), "pass"),  # a kernel row
        # 8-bit weights: temporaries under 10% of them (one dequantized matrix at most)
        (dict(weight_bytes=1000, quant_temp_limit_bytes=100), "pass"),
        (dict(weight_bytes=400, quant_temp_limit_bytes=40), "fail"),
    ],
)
def test_failure_rule_of_step_memory(kw, expected):
    row = _step_row(**kw)
    v = gcc.verdict(row)
    assert v.split(":")[0] == expected, v
    if kw.get("alias_bytes") == 16:
        assert "KV pool not aliased input-to-output" in v
    if kw.get("temp_bytes") == 50:
        assert "50 B (5% of the 1000 B KV pool)" in v
    if kw.get("weight_bytes") == 400:
        assert "49 B >= 40 B (10% of the 400 B of 8-bit weights)" in v


def test_ci_grid_holds_one_quantized_step():
    quantized = [c for c in gcc.grid_ci() if c.quantization]
    assert [c.name for c in quantized] == ["step-llama8b-32l-int8-decode-s64"]
    assert quantized[0].num_layers == 32 and quantized[0].batch == 64


def test_default_outputs_per_toolchain():
    assert gcc.default_output("full", "cuda12") == REPO / "docs" / "gpu_compile_h200.json"
    assert gcc.default_output("full", "cuda13") == (REPO / "docs" / "gpu_compile_h200_cuda13.json")
    assert gcc.default_output("ci", "cuda13").name == "gpu_compile_ci_cuda13.json"
    assert "runtime_version { major: 13 minor: 0 patch: 0 }" in gcc.target_config("cuda13")
    assert gcc.target_config("cuda12") == gcc.TARGET_CONFIG


def _fake_toolchain(root: pathlib.Path, plugin: str, ptxas_build: str, layout: str) -> None:
    """A site dir holding a jax CUDA plugin module and NVIDIA wheels' files in `layout`."""
    (root / "jax_plugins" / plugin).mkdir(parents=True)
    (root / "jax_plugins" / plugin / "__init__.py").write_text("")
    major = plugin.removeprefix("xla_cuda")
    bin_dir, lib_dir = {
        "cu12": (root / "nvidia/cuda_nvcc/bin", root / "nvidia/nvjitlink/lib"),
        "cu13": (root / "nvidia/cu13/bin", root / "nvidia/cu13/lib"),
    }[layout]
    bin_dir.mkdir(parents=True)
    lib_dir.mkdir(parents=True, exist_ok=True)
    ptxas = bin_dir / "ptxas"
    ptxas.write_text(f"#!/bin/sh\necho 'ptxas: NVIDIA (R)'\necho '{ptxas_build}'\n")
    ptxas.chmod(0o755)
    (lib_dir / f"libnvJitLink.so.{major}").write_text("")


def _isolated_toolchain(monkeypatch, root: pathlib.Path):
    """find_toolchain() seeing only `root`'s plugin and wheels (not the venv's real ones)."""
    import importlib.machinery

    real = gcc._find_spec

    def find_spec(name):
        if name.startswith("jax_plugins."):
            return importlib.machinery.PathFinder.find_spec(
                name.split(".", 1)[1], [str(root / "jax_plugins")]
            )
        if name == "nvidia":
            return importlib.machinery.PathFinder.find_spec(name, [str(root)])
        return real(name)

    monkeypatch.setattr(gcc, "_find_spec", find_spec)


def test_find_toolchain_reads_the_cuda13_layout(tmp_path, monkeypatch):
    _fake_toolchain(tmp_path, "xla_cuda13", "Build cuda_13.0.r13.0/compiler.1_0", "cu13")
    _isolated_toolchain(monkeypatch, tmp_path)
    tools = gcc.find_toolchain()
    assert not isinstance(tools, str), tools
    assert tools.cuda == "cuda13" and tools.plugin.startswith("jax-cuda13-plugin ")
    assert tools.ptxas == str(tmp_path / "nvidia/cu13/bin/ptxas")
    assert tools.nvjitlink == str(tmp_path / "nvidia/cu13/lib/libnvJitLink.so.13")
    assert tools.label("0.11.2") == "jax 0.11.2 + cuda13 (ptxas 13.0)"


def test_find_toolchain_refuses_assemblers_of_another_cuda(tmp_path, monkeypatch):
    # a CUDA 13 plugin beside CUDA 12 assemblers: XLA's PTX would be read by the wrong ptxas
    _fake_toolchain(tmp_path, "xla_cuda13", "Build cuda_12.9.r12.9/compiler.1_0", "cu12")
    _isolated_toolchain(monkeypatch, tmp_path)
    got = gcc.find_toolchain()
    assert isinstance(got, str) and "no CUDA 13 ptxas" in got, got


def _report(label: str, rows: list[dict]) -> dict:
    return dict(toolchain=dict(label=label), rows=rows)


def test_toolchain_table_sets_the_toolchains_side_by_side():
    a = _row(grid=[97, 8, 1], warps=4, regs_nvjitlink=168, regs_ptxas=128, smem_bytes=71680)
    b = dict(a, regs_nvjitlink=170)
    a["verdict"] = b["verdict"] = "pass"
    only_a = dict(a, case="only-in-a")
    text = gcc.toolchain_table([_report("jax 0.12 + cuda12", [a, only_a]),
                                _report("jax 0.11.2 + cuda13", [b])])  # fmt: skip
    lines = text.splitlines()
    assert lines[0] == "toolchains: jax 0.12 + cuda12 / jax 0.11.2 + cuda13"
    assert lines[4] == (
        "| synthetic | paged_decode_attention | 168 / 170 | 128 | 0, 0 | 71,680 | pass |"
    )
    assert len(lines) == 5, "a case only one report holds is left out"
    old = dict(ptxas="Build cuda_12.9.r12.9/compiler.1_0", jax_version="0.12.0.1", rows=[])
    assert gcc.report_label(old) == "jax 0.12.0.1 + cuda12 (ptxas 12.9)"


def test_memory_table_of_a_step_row():
    row = _step_row(kv_pool_bytes=6 * 2**30, kv_layer_bytes=3 * 2**30, alias_bytes=6 * 2**30 + 1024,
                    temp_bytes=96 * 2**20, argument_bytes=7 * 2**30, output_bytes=6 * 2**30)  # fmt: skip
    lines = gcc.memory_table([_report("t", [row, dict(row, kernel="other")])]).splitlines()
    assert len(lines) == 3, "one line per case, not per kernel"
    assert lines[2] == (
        "| step-synthetic | t | 6,144.0 MiB | 3,072.0 MiB | 6,144.0 MiB | 7,168.0 MiB "
        "| 6,144.0 MiB | 96.0 MiB | 1.56% | 3.1% |"
    )
