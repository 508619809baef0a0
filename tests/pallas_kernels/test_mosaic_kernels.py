"""Mosaic GPU decode and ragged kernels in GPU interpret mode (CPU) against the reference.

Every kernel run has the race detector on (a race raises). Caches hold NaN in every slot
the output must not depend on (pk_testing.make_case): the null block, unused blocks and
slots past seq_len. Needs jax >= names.MOSAIC_MIN_JAX_VERSION; older jax skips.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pk_testing import assert_close, make_case, naive_attention, with_timeout

from pallas_kernels import plan as plans
from pallas_kernels import reference
from pallas_kernels.mosaic_decode import (
    SMEM_BUDGET,
    default_tiling,
    mosaic_unavailable_reason,
    paged_attention_mosaic,
    smem_bytes,
)
from pallas_kernels.mosaic_ragged import ragged_paged_attention_mosaic

pytestmark = pytest.mark.skipif(
    mosaic_unavailable_reason() is not None,
    reason=str(mosaic_unavailable_reason()),
)

COMPILE_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "gpu_compile_check.py"


def interpret_params():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.InterpretGPUParams(detect_races=True)


def check(case, dtype, *, sliding_window=None, soft_cap=None, **knobs):
    scale = case.q.shape[-1] ** -0.5
    opts = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    out = with_timeout(paged_attention_mosaic, *args, **opts, interpret=interpret_params(), **knobs)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, reference.paged_attention(*args, **opts), dtype)
    assert_close(out, naive_attention(case, **opts), dtype)


FAST = [
    # seq_lens straddle page edges (bs-1, bs, bs+1), a 1-token and a padded (0) sequence
    pytest.param(
        dict(seq_lens=[1, 15, 16, 17, 40, 0], block_size=16, num_kv_heads=1, group=4),
        {},
        dict(num_splits=1),
        id="mixed-gqa4-one-split",
    ),
    pytest.param(
        dict(seq_lens=[37, 100], block_size=16, num_kv_heads=2, group=4),
        dict(sliding_window=20, soft_cap=5.0),
        dict(num_splits=2),
        id="window-cap-gqa4-splits2",
    ),
    pytest.param(
        dict(seq_lens=[5, 90, 33], block_size=8, num_kv_heads=2, group=1),
        {},
        dict(num_items=6, pages_per_step=4, num_stages=2),
        id="gqa1-worklist-bs8",
    ),
]


@pytest.mark.parametrize("shape,masking,knobs", FAST)
def test_mosaic_decode_matches_reference(shape, masking, knobs):
    case = make_case(0, head_dim=64, dtype="bfloat16", **shape)
    check(case, "bfloat16", **masking, **knobs)


def test_mosaic_decode_float16_head_dim_128():
    case = make_case(
        1, seq_lens=[33, 17], block_size=16, num_kv_heads=1, group=8, head_dim=128, dtype="float16"
    )
    scale = 128**-0.5
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    out = with_timeout(
        paged_attention_mosaic, *args, scale=scale, num_splits=1, interpret=interpret_params()
    )
    ref = reference.paged_attention(*args, scale=scale)
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=5e-3, rtol=5e-3
    )


def test_mosaic_decode_never_follows_ids_outside_the_pool():
    # Ids -1 and num_blocks + 3 inside a sequence's length: their keys are invisible,
    # exactly as in the reference (which masks them the same way).
    case = make_case(2, seq_lens=[40, 20], block_size=16, num_kv_heads=1, group=4, head_dim=64)
    tables = np.asarray(case.block_tables).copy()
    num_blocks = case.k_cache.shape[0]
    tables[0, 1] = -1
    tables[1, 0] = num_blocks + 3
    q, k, v = (x.astype(jnp.bfloat16) for x in (case.q, case.k_cache, case.v_cache))
    args = (q, k, v, jnp.asarray(tables), case.seq_lens)
    out = with_timeout(
        paged_attention_mosaic, *args, scale=0.125, num_splits=1, interpret=interpret_params()
    )
    assert_close(out, reference.paged_attention(*args, scale=0.125), "bfloat16")


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
def test_mosaic_decode_fp8_cache_with_scales(fp8):
    case = make_case(3, seq_lens=[5, 40, 17], block_size=16, num_kv_heads=2, group=4, head_dim=64)
    q = case.q.astype(jnp.bfloat16)
    k, v = case.k_cache.astype(fp8), case.v_cache.astype(fp8)  # NaN poison stays NaN
    scales = dict(k_scale=jnp.float32(0.7), v_scale=jnp.float32(1.3))
    args = (q, k, v, case.block_tables, case.seq_lens)
    out = with_timeout(
        paged_attention_mosaic,
        *args,
        scale=0.125,
        num_items=5,
        interpret=interpret_params(),
        **scales,
    )
    assert_close(out, reference.paged_attention(*args, scale=0.125, **scales), "bfloat16")


def test_race_detector_reports_a_read_before_its_barrier():
    # Control: the detector the tests rely on is live in this jax (a kernel that reads
    # an SMEM tile before waiting on its TMA barrier must raise). jax 0.12 raises by
    # itself; jax 0.11.2 only prints, and the kernels' outputs pass through
    # mosaic_compat.raise_on_races, as here.
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.mosaic_compat import raise_on_races

    def body(x_ref, o_ref, smem, bar, out_smem):
        plgpu.copy_gmem_to_smem(x_ref, smem, bar)
        out_smem[...] = smem[...] * 2  # the race: no barrier_wait yet
        plgpu.barrier_wait(bar)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, o_ref)
        plgpu.wait_smem_to_gmem(0)

    def kernel(fn):  # one 64 x 64 f32 tile through SMEM, as both bodies expect
        return plgpu.kernel(
            fn,
            out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
            scratch_types=[
                plgpu.SMEM((64, 64), jnp.float32),
                plgpu.Barrier(num_barriers=1),
                plgpu.SMEM((64, 64), jnp.float32),
            ],
            grid=(1,),
            grid_names=("x",),
            interpret=interpret_params(),
        )

    racy = kernel(body)

    @jax.jit
    def checked(x):
        return raise_on_races((racy(x),), interpret_params(), "racy")[0]

    with pytest.raises(Exception, match="RACE|race|CpuCallback"):
        with_timeout(checked, jnp.ones((64, 64), jnp.float32))
    # The same kernel with the wait before the read runs clean through the same check.

    def fixed_body(x_ref, o_ref, smem, bar, out_smem):
        plgpu.copy_gmem_to_smem(x_ref, smem, bar)
        plgpu.barrier_wait(bar)
        out_smem[...] = smem[...] * 2
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, o_ref)
        plgpu.wait_smem_to_gmem(0)

    fixed = kernel(fixed_body)
    out = with_timeout(
        jax.jit(lambda x: raise_on_races((fixed(x),), interpret_params(), "fixed")[0]),
        jnp.ones((64, 64), jnp.float32),
    )
    np.testing.assert_array_equal(np.asarray(out), 2.0)


@pytest.mark.parametrize(
    "field,kwargs,match",
    [
        ("dtype", dict(dtype="float32"), "bfloat16 or float16"),
        ("group", dict(group=128), "<= 64"),
        ("block_size", dict(block_size=4), "multiple of 8"),
        ("head_dim", dict(head_dim=80), "head_dim=80 must be one of"),
        ("head_dim", dict(head_dim=256), "head_dim=256 must be one of"),
    ],
)
def test_mosaic_decode_rejects_unsupported_shapes(field, kwargs, match):
    shape = dict(seq_lens=[5], block_size=16, num_kv_heads=1, group=4, head_dim=64)
    shape.update(kwargs)
    dtype = shape.pop("dtype", "bfloat16")
    case = make_case(4, dtype=dtype, **shape)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    with pytest.raises(ValueError, match=match):
        paged_attention_mosaic(*args, scale=0.125, interpret=True)


SLOW = [
    dict(seq_lens=[130, 7, 64], block_size=32, num_kv_heads=2, group=8, splits=3),
    dict(seq_lens=[200, 1], block_size=16, num_kv_heads=1, group=2, splits=None),
    dict(seq_lens=[77, 48, 3], block_size=8, num_kv_heads=4, group=4, splits=2),
]


# Each shape once and each masking once (shape i with masking i): the full 3 x 3 product
# cost CI about 75 CPU s more in the one stage whose jax runs these kernels.
@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, masking", list(zip(SLOW, [{}, dict(sliding_window=33), dict(soft_cap=3.0)]))
)
def test_mosaic_decode_sweep(shape, masking):
    shape = dict(shape)
    splits = shape.pop("splits")
    case = make_case(5, head_dim=64, dtype="bfloat16", **shape)
    knobs = dict(num_splits=splits) if splits else dict(num_items=len(shape["seq_lens"]) + 4)
    check(case, "bfloat16", **masking, **knobs)


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_default_tiling_fits_the_smem_budget(cache_dtype, block_size, head_dim):
    # The deviceless H200 lowering rejects a kernel over 232,448 B of SMEM (at d=256,
    # bs=32 the former fixed 2-page, 2-stage tiling asked for 240,680 B).
    t = default_tiling("bfloat16", cache_dtype, block_size, head_dim)
    block_k = t["pages_per_step"] * block_size
    assert smem_bytes("bfloat16", cache_dtype, head_dim, block_k, t["num_stages"]) <= SMEM_BUDGET
    assert t["num_stages"] >= 2 or t["pages_per_step"] == 1


# Ragged: prefill (crossing pages), a chunk over a cached prefix, decodes, a padded
# sequence (seq_len 0, no rows) and padding rows past query_start_loc[-1].
RAGGED = dict(seq_lens=[19, 53, 33, 16, 0], q_lens=[19, 14, 1, 1, 0], num_rows=40, block_size=16)


def check_ragged(case, dtype, *, sliding_window=None, soft_cap=None, **knobs):
    scale = case.q.shape[-1] ** -0.5
    opts = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    args = (
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
    )
    out = with_timeout(
        ragged_paged_attention_mosaic, *args, **opts, interpret=interpret_params(), **knobs
    )
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, reference.ragged_paged_attention(*args, **opts), dtype)
    assert_close(out, naive_attention(case, **opts), dtype)


RAGGED_FAST = [
    # block_q 16 x GQA 4: exactly one 64-row tile per query block
    pytest.param(dict(num_kv_heads=1, group=4), {}, dict(num_splits=1), id="gqa4-bq16"),
    # GQA 8 at block_q 16: two tiles per query block; window + cap; split keys
    pytest.param(
        dict(num_kv_heads=2, group=8),
        dict(sliding_window=20, soft_cap=5.0),
        dict(block_q=16, num_splits=2),
        id="gqa8-two-tiles-window-cap-splits2",
    ),
    # GQA 1: 64 tokens per block, so one block holds several sequences' worth of rows
    pytest.param(
        dict(num_kv_heads=2, group=1),
        {},
        dict(pages_per_step=2, num_stages=2),
        id="gqa1-default-bq",
    ),
]


@pytest.mark.parametrize("shape,masking,knobs", RAGGED_FAST)
def test_mosaic_ragged_matches_reference(shape, masking, knobs):
    case = make_case(6, head_dim=64, dtype="bfloat16", **RAGGED, **shape)
    check_ragged(case, "bfloat16", **masking, **knobs)


def test_mosaic_ragged_fp8_cache_with_scales():
    case = make_case(7, head_dim=64, num_kv_heads=1, group=4, **RAGGED)
    q = case.q.astype(jnp.bfloat16)
    k, v = case.k_cache.astype("float8_e4m3fn"), case.v_cache.astype("float8_e4m3fn")
    scales = dict(k_scale=jnp.float32(0.7), v_scale=jnp.float32(1.3))
    args = (q, k, v, case.block_tables, case.seq_lens, case.query_start_loc)
    out = with_timeout(
        ragged_paged_attention_mosaic, *args, scale=0.125, interpret=interpret_params(), **scales
    )
    ref = reference.ragged_paged_attention(*args, scale=0.125, **scales)
    assert_close(out, ref, "bfloat16")


def test_mosaic_kernels_take_a_step_plan():
    # A mixed step's plan: the ragged kernel skips the decode sequences (their rows are
    # 0 there) and the decode kernel takes them from the flat rows.
    from pallas_kernels.plan import make_plan

    case = make_case(8, head_dim=64, num_kv_heads=1, group=4, dtype="bfloat16", **RAGGED)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    qsl = case.query_start_loc
    plan = make_plan(
        case.seq_lens,
        qsl,
        num_tokens=case.q.shape[0],
        num_kv_heads=1,
        decode_block_k=32,
        ragged_block_q=16,
        decode_only=False,
    )
    # A short decode work list keeps the interpreted grid small (the default has ~264 items).
    short = plans.decode_items(case.seq_lens, qsl, block_k=32, num_items=7)
    plan = dataclasses.replace(plan, decode_items=short)
    ref = np.asarray(reference.ragged_paged_attention(*args, qsl, scale=0.125), np.float32)
    rag = with_timeout(
        ragged_paged_attention_mosaic, *args, qsl, scale=0.125, plan=plan, interpret=True
    )
    dec = with_timeout(paged_attention_mosaic, *args, scale=0.125, plan=plan, interpret=True)
    decode_rows = np.asarray(plan.decode_row)
    assert decode_rows.sum() == 2
    others = ~decode_rows[:, None, None]
    assert_close(np.where(others, rag, 0.0), np.where(others, ref, 0.0), "bfloat16")
    assert not np.asarray(rag, np.float32)[decode_rows].any()
    seq_of_row = np.minimum(np.asarray(plan.row_seq), len(RAGGED["seq_lens"]) - 1)
    assert_close(np.asarray(dec, np.float32)[seq_of_row][decode_rows], ref[decode_rows], "bfloat16")


def test_mosaic_ragged_never_follows_ids_outside_the_pool():
    case = make_case(9, head_dim=64, num_kv_heads=1, group=4, dtype="bfloat16", **RAGGED)
    tables = np.asarray(case.block_tables).copy()
    tables[1, 1] = -1
    tables[2, 0] = case.k_cache.shape[0] + 3
    args = (case.q, case.k_cache, case.v_cache, jnp.asarray(tables), case.seq_lens)
    args += (case.query_start_loc,)
    out = with_timeout(
        ragged_paged_attention_mosaic, *args, scale=0.125, interpret=interpret_params()
    )
    assert_close(out, reference.ragged_paged_attention(*args, scale=0.125), "bfloat16")


RAGGED_SLOW = [
    dict(
        seq_lens=[70, 9, 130, 1, 0],
        q_lens=[70, 3, 40, 1, 0],
        num_rows=120,
        block_size=16,
        num_kv_heads=1,
        group=8,
    ),
    dict(seq_lens=[33, 100, 5], q_lens=[33, 1, 5], block_size=8, num_kv_heads=2, group=4),
    dict(seq_lens=[64, 48], q_lens=[20, 48], num_rows=72, block_size=32, num_kv_heads=2, group=1),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, masking, knobs",
    [
        (shape, masking, knobs)
        for shape, (masking, knobs) in zip(
            RAGGED_SLOW,
            [({}, dict(num_splits=3)), (dict(sliding_window=17), {}), (dict(soft_cap=3.0), {})],
        )
    ],
)
def test_mosaic_ragged_sweep(shape, masking, knobs):
    case = make_case(10, head_dim=64, dtype="bfloat16", **shape)
    check_ragged(case, "bfloat16", **masking, **knobs)


def _h200_target():
    """A compile-only H200 device (CUDA plugin needed) and the compile-check module, or
    skip."""
    try:
        from jax.experimental import topologies

        spec = importlib.util.spec_from_file_location("gpu_compile_check_mosaic", COMPILE_SCRIPT)
        gcc = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = gcc  # dataclasses look their module up by name
        spec.loader.exec_module(gcc)
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=gcc.TARGET_CONFIG, topology="1x1x1"
        )
    except Exception as e:  # no CUDA plugin in this venv
        pytest.skip(f"no deviceless H200 target here ({type(e).__name__}: {e})"[:200])
    return topo.devices[0], gcc


@pytest.mark.parametrize(
    "kernel,cache_dtype",
    [("decode", "bfloat16"), ("ragged", "bfloat16"), ("ragged", "float8_e4m3fn")],
)
def test_mosaic_kernels_lower_for_an_h200(kernel, cache_dtype):
    # GPU interpret mode accepts casts and index patterns the real lowering rejects
    # (fp8 -> bf16, i1 broadcasts, a TMA box at a row offset not known to be a multiple
    # of the SMEM tiling): Mosaic's layout inference and SMEM check must pass too.
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    device, gcc = _h200_target()
    sharding = NamedSharding(Mesh([device], ("x",)), PartitionSpec())

    def spec(shape, dtype="int32"):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)

    seqs, pages, bs, kv, d = 4, 16, 16, 2, 128
    cache = spec((seqs * pages + 1, kv, bs, d), cache_dtype)
    static = dict(scale=d**-0.5, sliding_window=100, soft_cap=30.0)
    scales = {}
    if cache_dtype != "bfloat16":
        scales = dict(k_scale=spec((), "float32"), v_scale=spec((), "float32"))
    tokens = 64 if kernel == "ragged" else seqs
    args = [spec((tokens, kv * 4, d), "bfloat16"), cache, cache, spec((seqs, pages))]
    args.append(spec((seqs,)))
    fn = paged_attention_mosaic
    if kernel == "ragged":
        args.append(spec((seqs + 1,)))
        fn = ragged_paged_attention_mosaic
    with gcc.mosaic_compile_report() as report, jax.default_device(device):
        lowered = jax.jit(functools.partial(fn, **static)).lower(*args, **scales)
        assert "mosaic_gpu" in lowered.as_text()
        lowered.compile()
    # jax 0.11.2 + jax-cuda13-plugin assemble the kernel during the compile (ptxas's
    # report comes back); a jax that builds the cubin only on a device reports nothing.
    regs, spills = gcc.parse_assembler_log(report["text"])
    if regs is not None:
        assert 0 < regs <= 255 and spills == 0, report["text"][-600:]
