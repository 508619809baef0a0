"""The pure-JAX references against an independent numpy attention, plus layout and seam."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pk_testing import assert_close, make_case, naive_attention

import pallas_kernels as pk
from pallas_kernels import reference

BENCH_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"

CONFIGS = [  # block_size, num_kv_heads, group, head_dim, dtype, sliding_window, soft_cap
    pytest.param(8, 2, 1, 64, "float32", None, None, id="bs8-mha-d64-f32"),
    pytest.param(16, 1, 4, 128, "float32", None, 5.0, id="bs16-gqa4-d128-f32-softcap"),
    pytest.param(32, 1, 8, 64, "bfloat16", None, None, id="bs32-gqa8-d64-bf16"),
    pytest.param(16, 2, 4, 64, "float32", 11, None, id="bs16-gqa4-d64-f32-window11"),
]


@pytest.mark.parametrize("block_size,kv_heads,group,head_dim,dtype,window,cap", CONFIGS)
def test_reference_decode_matches_naive(block_size, kv_heads, group, head_dim, dtype, window, cap):
    bs = block_size
    case = make_case(
        0,
        seq_lens=[1, bs - 1, bs, bs + 1, 4 * bs + 3, 0],
        block_size=bs,
        num_kv_heads=kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
    )
    out = reference.paged_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        scale=0.1,
        sliding_window=window,
        soft_cap=cap,
    )
    assert out.dtype == case.q.dtype
    assert_close(out, naive_attention(case, scale=0.1, sliding_window=window, soft_cap=cap), dtype)
    assert np.all(np.asarray(out[-1].astype(jnp.float32)) == 0)  # seq_len 0 -> zeros


@pytest.mark.parametrize("block_size,kv_heads,group,head_dim,dtype,window,cap", CONFIGS)
def test_reference_ragged_matches_naive(block_size, kv_heads, group, head_dim, dtype, window, cap):
    bs = block_size
    # fresh prefill | chunk continuing a cached prefix | decode | decode at a block edge | pad
    case = make_case(
        1,
        seq_lens=[bs + 3, 2 * bs + 5, bs + 1, bs, 0],
        q_lens=[bs + 3, bs - 2, 1, 1, 0],
        num_rows=2 * bs + 8,
        block_size=bs,
        num_kv_heads=kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
    )
    out = reference.ragged_paged_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        scale=0.1,
        sliding_window=window,
        soft_cap=cap,
    )
    assert_close(out, naive_attention(case, scale=0.1, sliding_window=window, soft_cap=cap), dtype)


def test_reference_survives_huge_poison():
    case = make_case(
        2, seq_lens=[3, 9], block_size=8, num_kv_heads=1, group=4, head_dim=64, poison=3e38
    )
    out = reference.paged_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale=0.125
    )
    assert_close(out, naive_attention(case, scale=0.125), "float32")


def test_reference_write_kv_drops_minus_one_slots():
    k_cache, v_cache = pk.init_kv_cache(4, 8, 2, 64, jnp.float32)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((4, 2, 64)), jnp.float32)
    slots = jnp.array([9, -1, 31, 0], jnp.int32)
    new_k, new_v = reference.write_kv(k_cache, v_cache, k, 2 * k, slots)
    expected = np.zeros(k_cache.shape, np.float32)
    for t, slot in enumerate(np.asarray(slots)):
        if slot >= 0:
            expected[slot // 8, :, slot % 8] = np.asarray(k[t])
    np.testing.assert_array_equal(np.asarray(new_k), expected)
    np.testing.assert_array_equal(np.asarray(new_v), 2 * expected)


def test_reference_copy_blocks():
    rng = np.random.default_rng(0)
    k_cache = jnp.asarray(rng.standard_normal((6, 2, 8, 64)), jnp.float32)
    v_cache = k_cache + 1
    src, dst = jnp.array([1, 3, 2], jnp.int32), jnp.array([4, 5, -1], jnp.int32)
    new_k, new_v = reference.copy_blocks(k_cache, v_cache, src, dst)
    expected = np.asarray(k_cache).copy()
    expected[4], expected[5] = expected[1], expected[3]
    np.testing.assert_array_equal(np.asarray(new_k), expected)
    np.testing.assert_array_equal(np.asarray(new_v), expected + 1)


def test_init_kv_cache_layout_and_errors():
    k_cache, v_cache = pk.init_kv_cache(10, 16, 4, 128, jnp.bfloat16)
    assert k_cache.shape == v_cache.shape == (10, 4, 16, 128) == pk.kv_cache_shape(10, 16, 4, 128)
    assert k_cache.dtype == jnp.bfloat16 and not np.asarray(k_cache.astype(jnp.float32)).any()
    with pytest.raises(ValueError, match=r"block_size=0 must be a positive int"):
        pk.init_kv_cache(10, 0, 4, 128)
    with pytest.raises(ValueError, match=r"dtype=int32 must be one of"):
        pk.init_kv_cache(10, 16, 4, 128, jnp.int32)


def test_get_attention_ops_names():
    ops = pk.get_attention_ops("reference")
    assert isinstance(ops, pk.AttentionOps) and ops.paged_attention is reference.paged_attention
    expected = "pallas" if jax.default_backend() == "gpu" else "reference"
    auto = pk.get_attention_ops("auto")
    assert (auto.write_kv is reference.write_kv) == (expected == "reference")
    interp = pk.get_attention_ops("pallas_interpret")
    assert interp.ragged_paged_attention.keywords == {"interpret": True}
    assert pk.get_attention_ops("pallas").copy_blocks is pk.copy_blocks
    with pytest.raises(ValueError, match=r"name='mosaic' must be one of 'auto', 'pallas'"):
        pk.get_attention_ops("mosaic")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_query_tiles_cover_every_row_once(seed):
    rng = np.random.default_rng(seed)
    tile = 4
    num_seqs = 9
    q_lens = rng.choice([0, 1, 2, 3, 4, 5, 9, 13], num_seqs).tolist()
    ctx = [q + int(rng.integers(0, 20)) for q in q_lens]
    num_tokens = sum(q_lens) + int(rng.integers(0, 6))  # padding rows past the last sequence
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq, row, pos = reference.query_tiles(
        jnp.asarray(qsl), jnp.asarray(ctx, jnp.int32), num_tokens, tile
    )
    seq, row, pos = np.asarray(seq), np.asarray(row), np.asarray(pos)
    assert row.shape == pos.shape and row.shape[1] == tile
    assert row.shape[0] == num_tokens // tile + min(num_seqs, num_tokens)
    expected = {}  # row -> (sequence, position) for every real row
    for s, (q, c) in enumerate(zip(q_lens, ctx)):
        for k in range(q):
            expected[int(qsl[s]) + k] = (s, c - q + k)
    got = {}
    for i in range(row.shape[0]):
        live = row[i] < num_tokens
        assert np.all(pos[i][~live] == -1)
        assert np.all(np.diff(row[i][live]) == 1)  # consecutive rows of one sequence
        for r, p in zip(row[i][live], pos[i][live]):
            assert int(r) not in got
            got[int(r)] = (int(seq[i]), int(p))
    assert got == expected


@pytest.mark.parametrize("window", [None, 7])
def test_reference_ragged_long_chunks_match_naive(window):
    # Chunks longer than a query tile (several tiles per sequence, a partial last tile),
    # decode rows between them, empty sequences and padding rows.
    q_lens = [37, 1, 0, 2, 18, 1, 16, 3]
    seq_lens = [37, 40, 0, 2, 50, 17, 33, 64]
    case = make_case(
        7,
        seq_lens=seq_lens,
        q_lens=q_lens,
        num_rows=sum(q_lens) + 5,
        block_size=8,
        num_kv_heads=2,
        group=2,
        head_dim=32,
    )
    out = reference.ragged_paged_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        scale=0.2,
        sliding_window=window,
    )
    assert_close(out, naive_attention(case, scale=0.2, sliding_window=window), "float32")
    assert np.all(np.asarray(out[sum(q_lens) :]) == 0)  # padding rows


def _pool_sized_f32_arrays(hlo_text: str, pool_elements: int) -> list[str]:
    """Instructions outside fusion bodies whose result is an f32 array of at least
    ``pool_elements`` elements: a whole cache pool widened to f32 and materialised."""
    fused = set(re.findall(r" fusion\(.*?calls=%([\w.\-]+)", hlo_text))
    hits, body = [], None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line)
        if head:
            body = head.group(1)
            continue
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = f32\[([\d,]+)\]", line)
        if m and body not in fused and math.prod(map(int, m.group(2).split(","))) >= pool_elements:
            hits.append(line.strip()[:160])
    return hits


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16", "float8_e4m3fn"])
@pytest.mark.parametrize("ragged", [False, True], ids=["decode", "ragged"])
def test_reference_never_widens_the_whole_pool(cache_dtype, ragged):
    # A narrow cache is widened page by page, after the gather: a program that converts
    # the whole pool to f32 costs time in proportion to the pool, not to the context.
    # Enough sequences (and query tiles) for several row groups, so the loops are real.
    num_blocks, kv_heads, bs, d, num_seqs = 512, 2, 16, 32, 80
    k_cache = jnp.zeros((num_blocks, kv_heads, bs, d), cache_dtype)
    q_dtype = jnp.bfloat16 if cache_dtype.startswith("float8") else cache_dtype
    q = jnp.zeros((num_seqs, 2 * kv_heads, d), q_dtype)
    tables = (jnp.arange(num_seqs * 6, dtype=jnp.int32) % (num_blocks - 1) + 1).reshape(num_seqs, 6)
    lens = jnp.arange(num_seqs, dtype=jnp.int32) % 96 + 1
    if ragged:
        qsl = jnp.arange(num_seqs + 1, dtype=jnp.int32)
        lowered = reference.ragged_paged_attention.lower(
            q, k_cache, k_cache, tables, lens, qsl, scale=0.1
        )
    else:
        lowered = reference.paged_attention.lower(q, k_cache, k_cache, tables, lens, scale=0.1)
    hits = _pool_sized_f32_arrays(lowered.compile().as_text(), num_blocks * kv_heads * bs * d)
    assert not hits, hits


def _previous_reference():
    """The reference before the CPU restructure, as bench_kernels keeps it for its
    side-by-side (decode and ragged; no window, soft cap or fp8)."""
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    # Registered first: the script defines dataclasses, which look their module up in
    # sys.modules while the class body is processed.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.previous_reference()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_decode_many_groups_matches_naive_and_previous(dtype):
    # More sequences than one row group, lengths out of order (ties, empty rows in the
    # middle): sorting into groups and back must give every row its own output.
    rng = np.random.default_rng(3)
    seq_lens = [int(x) for x in rng.integers(1, 70, 75)]
    seq_lens[5] = seq_lens[40] = 0
    seq_lens[7] = seq_lens[8] = 33
    case = make_case(
        12, seq_lens=seq_lens, block_size=8, num_kv_heads=2, group=2, head_dim=32, dtype=dtype
    )
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    out = reference.paged_attention(*args, scale=0.2)
    assert_close(out, naive_attention(case, scale=0.2), dtype)
    assert not np.asarray(out[5].astype(jnp.float32)).any()
    previous, _ = _previous_reference()
    got = np.asarray(out.astype(jnp.float32))
    want = np.asarray(previous(*args, scale=0.2).astype(jnp.float32))
    # Same math in the same chunk order: f32 differs by summation order only; bf16
    # outputs by at most one rounding step.
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == "float32" else dict(atol=8e-3, rtol=8e-3)
    np.testing.assert_allclose(got, want, **tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_ragged_matches_previous(dtype):
    q_lens = [37, 1, 0, 2, 18, 1, 16, 3]
    seq_lens = [37, 140, 0, 2, 50, 17, 33, 64]
    case = make_case(
        8,
        seq_lens=seq_lens,
        q_lens=q_lens,
        num_rows=sum(q_lens) + 5,
        block_size=16,
        num_kv_heads=2,
        group=4,
        head_dim=32,
        dtype=dtype,
    )
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    out = reference.ragged_paged_attention(*args, case.query_start_loc, scale=0.2)
    assert_close(out, naive_attention(case, scale=0.2), dtype)
    _, previous = _previous_reference()
    want = previous(*args, case.query_start_loc, scale=0.2)
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == "float32" else dict(atol=8e-3, rtol=8e-3)
    np.testing.assert_allclose(
        np.asarray(out.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)), **tol
    )
