"""Every timed function of the kernel benchmarks takes its arrays as arguments.

A jitted closure that captures a concrete array gets it compiled in as a constant (jax
0.11.2: a captured 256 MiB array took 12.4 s to lower and 6.8 s to compile, 0.18 s as an
argument). Each timing function of bench_kernels (decode, mixed), bench_fp8_decode and
autotune_kernels is lowered here through ``pallas_kernels.timing.looped`` with small but
real arrays (caches over 1 MiB, so a captured one would exceed the limit), and fails on a
StableHLO constant over 1 MiB or an argument found among the traced constants; the
detector itself is shown to fire on a planted captured cache.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference, timing

ROOT = pathlib.Path(__file__).resolve().parents[1]
MIB = 1 << 20
NUM_BLOCKS = 1024  # 1024 blocks x 2 KV heads x 16 x 64: 4 MiB bf16, 2 MiB fp8 per cache


def load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def assert_takes_its_arrays(fn, q, operands):
    """The loop the scripts time, lowered: no constant over 1 MiB, no argument captured."""
    jitted = timing.looped(fn, 2)
    consts = jitted.trace(q, *operands).jaxpr.consts
    assert not [a for a in (q, *operands) if any(c is a for c in consts)], "argument captured"
    constants = timing.hlo_constants(jitted.lower(q, *operands).as_text())
    assert constants, "the parser found no constant at all: it no longer reads this jax's text"
    assert max(b for _, b in constants) <= MIB, constants
    assert min(a.nbytes for a in operands if a.ndim == 4) > MIB  # a captured cache would show
    timing.check_no_captured_arrays(jitted, q, *operands)  # what the scripts run


def small_pool(bk, heads, dtype="bfloat16"):
    heads = bk.Heads(heads.num_q_heads, heads.num_kv_heads, heads.head_dim, dtype=dtype)
    pool = bk.make_pool(heads, NUM_BLOCKS)
    tables, lens = bk.make_tables(np.random.default_rng(0), [48, 33], NUM_BLOCKS)
    q = jax.random.normal(jax.random.PRNGKey(2), (2, heads.num_q_heads, heads.head_dim))
    return heads, pool, tables, lens, q.astype(jnp.bfloat16)


# -- the detector


def test_the_detector_fires_on_a_planted_captured_cache():
    cache = jax.random.normal(jax.random.PRNGKey(0), (NUM_BLOCKS, 2, 16, 64), jnp.bfloat16)
    tables = jnp.arange(1, 7, dtype=jnp.int32).reshape(2, 3)
    lens = jnp.array([40, 33], jnp.int32)
    q = jnp.ones((2, 8, 64), jnp.bfloat16)

    def captures(x, t, s):  # the bug: the caches are closed over
        return reference.paged_attention(x, cache, cache, t, s, scale=0.125)

    def takes(x, k, v, t, s):
        return reference.paged_attention(x, k, v, t, s, scale=0.125)

    with pytest.raises(timing.CapturedArrayError, match="captures 1 array"):
        timing.check_no_captured_arrays(timing.looped(captures, 2), q, tables, lens)
    with pytest.raises(timing.CapturedArrayError, match="captures"):
        timing.time_loop(captures, q, (tables, lens), n=2, reps=1)
    # The StableHLO check alone also sees it: the random cache is one 4 MiB constant.
    text = timing.looped(captures, 2).lower(q, tables, lens).as_text()
    big = [c for c in timing.hlo_constants(text) if c[1] > MIB]
    assert big == [(f"{NUM_BLOCKS}x2x16x64xbf16", cache.nbytes)]
    with pytest.raises(AssertionError):
        assert_takes_its_arrays(captures, q, (tables, lens))
    assert_takes_its_arrays(takes, q, (cache, cache, tables, lens))


def test_hlo_constant_sizes():
    text = "\n".join(
        [
            "    %cst = stablehlo.constant dense<1.0> : tensor<4194304xbf16>",
            '    %c = stablehlo.constant dense<"0x0102"> : tensor<2x3xi32>',
            "    %c_0 = stablehlo.constant dense<true> : tensor<i1>",
            "    %c_1 = stablehlo.constant dense<0> : tensor<8x16xf8E4M3FN>",
            "    %1 = stablehlo.add %0, %cst : tensor<4xf32>",
        ]
    )
    assert timing.hlo_constants(text) == [
        ("4194304xbf16", 8 * MIB),
        ("2x3xi32", 24),
        ("i1", 1),
        ("8x16xf8E4M3FN", 128),
    ]


def test_time_loop_returns_the_first_calls_output_and_per_call_seconds():
    x = jnp.arange(6.0).reshape(2, 3)
    w = jnp.full((2, 3), 2.0)
    t, out = timing.time_loop(lambda x, w: x * w, x, (w,), n=4, reps=2)
    np.testing.assert_array_equal(out, x * w)  # call 0, not call 3 (its x is nudged)
    assert t.calls_per_loop == 4 and len(t.samples_s) == 2 and t.us_stats()["us"] > 0
    lowered_only, none = timing.time_loop(lambda x, w: x * w, x, (w,), n=4, reps=2, time_it=False)
    assert none is None and lowered_only.samples_s == ()


def test_copy_ceiling_counts_bytes_read_and_written():
    c = timing.copy_ceiling(4 * MIB, n=2, reps=2)
    assert c["array_bytes"] == 4 * MIB and c["bytes_per_pass"] == 8 * MIB
    assert c["gbps"] == pytest.approx(8 * MIB / c["seconds_per_pass"] / 1e9)


# -- the scripts' timing functions


@pytest.fixture(scope="module")
def bk():
    return load("bench_kernels")


def test_bench_decode_functions_take_their_arrays(bk):
    import pallas_kernels as pk

    heads, pool, tables, lens, q = small_pool(bk, bk.SMALL)
    caches, head_major = pool["caches"], pool["head_major"]
    np.testing.assert_array_equal(head_major[1], caches[1].transpose(1, 0, 2, 3))
    theirs, why = bk.jax_paged_attention(interpret=True)
    assert theirs is not None, why
    mosaic, _ = bk.mosaic_paged_attention("mosaic_gpu_interpret")  # None on jax < its minimum
    pallas = pk.get_attention_ops("pallas_interpret").paged_attention
    fns = bk.decode_fns(heads, pallas, mosaic, theirs)
    assert set(fns) == set(bk.IMPLS) - ({"mosaic"} if mosaic is None else set())
    for impl, fn in fns.items():
        assert_takes_its_arrays(fn, q, bk.decode_operands(impl, caches, head_major, tables, lens))


def test_bench_mixed_functions_take_their_arrays(bk):
    import pallas_kernels as pk

    heads, pool, tables, lens, q = small_pool(bk, bk.SMALL)
    caches = pool["caches"]
    qsl = jnp.arange(3, dtype=jnp.int32)
    fns = bk.mixed_fns(heads, pk.get_attention_ops("pallas_interpret"))
    assert list(fns) == ["step_decode_only", "step_mixed_path", "ragged_kernel"]
    for fn in fns.values():
        assert_takes_its_arrays(fn, q, (*caches, tables, lens, qsl))


@pytest.mark.parametrize("name", ["bfloat16", "fp8_e4m3"])
def test_bench_fp8_functions_take_their_arrays(bk, name):
    import pallas_kernels as pk

    fp8 = load("bench_fp8_decode")
    _, pool, tables, lens, q = small_pool(bk, bk.SMALL, dtype="float32")
    k32, v32 = pool["caches"]
    k, v, scales = fp8.caches_for(name, k32, v32)
    assert len(scales) == (2 if name.startswith("fp8") else 0)
    attend = pk.get_attention_ops("pallas_interpret").paged_attention
    fn = fp8.decode_fn(attend, bk.SMALL.head_dim, bool(scales))
    assert_takes_its_arrays(fn, q, (k, v, tables, lens, *scales))


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("kernel", ["paged_decode_attention", "ragged_paged_attention"])
def test_autotune_functions_take_their_arrays(kernel, dtype):
    import pallas_kernels as pk

    at = load("autotune_kernels")
    work = at.Workload(dtype, 32, interpret=True)
    # Small but real: the pool grown past 1 MiB (the tables' ids stay valid).
    reps = -(-2 * NUM_BLOCKS // work.k_cache.shape[0])
    work.k_cache, work.v_cache = (
        jnp.tile(c, (reps, 1, 1, 1)) for c in (work.k_cache, work.v_cache)
    )
    q = work.queries(kernel, 4)
    fn = work.attend(pk, kernel, interpret=True, **at.interpret_configs(kernel)[0])
    assert_takes_its_arrays(fn, q, work.operands(kernel))
