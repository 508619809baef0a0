"""The attention kernels' review fixes, on CPU: interpret mode against the references and a
naive float64 loop, plus the work tables (plan.py) and the lowered IR.

- a block-table id outside the pool is never followed (its keys are invisible);
- head_dim that is not a power of two is served (lanes masked to the next power of two);
- decode work lists cut equal key chunks from the real lengths (balanced);
- a mixed step's decode tokens go through the decode kernel, one plan per step;
- q is read and the output written in place (no pad / slice / cast around the kernel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pk_testing import assert_close, lower_for_cuda, make_case, naive_attention

import pallas_kernels as pk
from pallas_kernels import plan as plans
from pallas_kernels import reference
from pallas_kernels._attention_kernel import default_num_warps


def _args(case, ragged: bool):
    base = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    return base + (case.query_start_loc,) if ragged else base


# ------------------------------------------------------------------ bounds on table ids


@pytest.mark.parametrize("bad_id", [-3, 10**6, 2**31 - 1])
def test_out_of_pool_block_ids_are_never_followed(bad_id):
    case = make_case(21, seq_lens=[20, 9, 33], block_size=8, num_kv_heads=2, group=4, head_dim=64)
    tables = np.asarray(case.block_tables).copy()
    tables[0, 1] = bad_id  # keys 8..15 of sequence 0 point outside the pool
    tables[2, 0] = bad_id  # the first block of sequence 2
    bad = jnp.asarray(tables)
    args = (case.q, case.k_cache, case.v_cache, bad, case.seq_lens)
    out = pk.paged_attention(*args, scale=0.125, interpret=True)
    expected = reference.paged_attention(*args, scale=0.125)
    assert_close(out, expected, "float32")
    # Sequence 1 is untouched; sequence 0 equals attention without the masked keys.
    clean = pk.paged_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale=0.125,
        interpret=True,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(clean[1]), atol=1e-6)
    assert not np.allclose(np.asarray(out[0]), np.asarray(clean[0]), atol=1e-3)

    # The ragged kernel agrees with the reference on the same bad table.
    qsl = jnp.arange(4, dtype=jnp.int32)
    ragged = pk.ragged_paged_attention(*args, qsl, scale=0.125, interpret=True)
    assert_close(ragged, expected, "float32")


def test_validate_still_names_the_bad_table_entry():
    from jax.experimental import checkify

    case = make_case(22, seq_lens=[9, 4], block_size=8, num_kv_heads=1, group=2, head_dim=64)
    tables = np.asarray(case.block_tables).copy()
    tables[0, 1] = 999
    fn = checkify.checkify(
        lambda *a: pk.paged_attention(*a, scale=0.125, interpret=True, validate=True)
    )
    err, _ = fn(case.q, case.k_cache, case.v_cache, jnp.asarray(tables), case.seq_lens)
    assert err.get() is not None and "block_tables" in err.get()


# ---------------------------------------------------------- head_dim not a power of two


@pytest.mark.parametrize("head_dim,dtype", [(80, "float32"), (96, "bfloat16"), (80, "bfloat16")])
def test_head_dims_that_are_not_powers_of_two(head_dim, dtype):
    case = make_case(
        23, seq_lens=[1, 13, 30, 0], block_size=8, num_kv_heads=2, group=2, head_dim=head_dim,
        dtype=dtype,
    )  # fmt: skip
    kw = dict(scale=head_dim**-0.5)
    dec = pk.paged_attention(*_args(case, False), **kw, interpret=True)
    assert_close(dec, reference.paged_attention(*_args(case, False), **kw), dtype)
    assert_close(dec, naive_attention(case, **kw), dtype)

    ragged_case = make_case(
        24, seq_lens=[19, 11, 7], q_lens=[19, 1, 3], num_rows=28, block_size=8, num_kv_heads=2,
        group=2, head_dim=head_dim, dtype=dtype,
    )  # fmt: skip
    rag = pk.ragged_paged_attention(*_args(ragged_case, True), **kw, block_q=4, interpret=True)
    assert_close(rag, naive_attention(ragged_case, **kw), dtype)
    assert not np.asarray(rag[23:].astype(jnp.float32)).any()  # padding rows are 0


def test_auto_backend_accepts_head_dim_80():
    ops = pk.get_attention_ops("pallas_interpret")
    case = make_case(25, seq_lens=[5, 12], block_size=8, num_kv_heads=1, group=1, head_dim=80)
    out = ops.paged_attention(*_args(case, False), scale=0.1)
    assert_close(out, reference.paged_attention(*_args(case, False), scale=0.1), "float32")


# ------------------------------------------------------------------ decode work lists


def _ranges(items, num_seqs):
    got = {s: [] for s in range(num_seqs)}
    for seq, _row, lo, hi in np.asarray(items):
        if seq < num_seqs:
            got[int(seq)].append((int(lo), int(hi)))
    return got


@pytest.mark.parametrize(
    "lens,kv_heads,window",
    [
        ([300, 9000, 500, 0, 1], 8, None),
        ([32768], 8, None),
        ([8192] * 64, 8, None),
        ([100] * 5 + [20000], 2, None),
        ([5000, 40, 7000], 4, 1024),
    ],
)
def test_decode_work_list_covers_each_sequence_once_in_equal_chunks(lens, kv_heads, window):
    block_k = 64
    seq_lens = jnp.asarray(lens, jnp.int32)
    qsl = jnp.arange(len(lens) + 1, dtype=jnp.int32)
    num_items = plans.num_decode_items(len(lens), kv_heads)
    items = plans.decode_items(
        seq_lens, qsl, block_k=block_k, num_items=num_items, sliding_window=window
    )
    assert items.shape == (num_items, 4)
    got = _ranges(items, len(lens))
    sizes = [hi - lo for rs in got.values() for lo, hi in rs]
    for s, n in enumerate(lens):
        lo = 0 if window is None else max(n - window, 0)
        want_lo, want_hi = lo // block_k * block_k, -(-n // block_k) * block_k
        rs = sorted(got[s])
        if n == 0:
            assert rs == []
            continue
        assert rs[0][0] == want_lo and rs[-1][1] == want_hi  # the visible keys, once
        assert all(a[1] == b[0] for a, b in zip(rs, rs[1:]))  # back to back, no overlap
        assert all(row == s for seq, row, *_ in np.asarray(items) if seq == s)
    # Balance: no chunk is longer than the chunk size, and a long sequence among short
    # ones is cut so that no program holds much more than an equal share of the work.
    chunk = max(sizes)
    assert all(size <= chunk for size in sizes)
    total = sum(sizes)
    share = max(plans.MIN_CHUNK_TOKENS, total * kv_heads / plans.TARGET_PROGRAMS)
    assert chunk <= share + block_k


def test_decode_kernel_balances_one_long_sequence_among_short_ones():
    lens = [3, 700, 2, 1500, 40]
    case = make_case(26, seq_lens=lens, block_size=16, num_kv_heads=1, group=4, head_dim=64)
    out = pk.paged_attention(*_args(case, False), scale=0.125, block_k=16, interpret=True)
    assert_close(out, naive_attention(case, scale=0.125), "float32")
    items = plans.decode_items(
        case.seq_lens, jnp.arange(6, dtype=jnp.int32), block_k=16,
        num_items=plans.num_decode_items(5, 1),
    )  # fmt: skip
    per_seq = _ranges(items, 5)
    assert len(per_seq[3]) > 1 and len(per_seq[0]) == 1  # the long one is split


# --------------------------------------------------------------------- engine steps


def _mixed_case(dtype="float32"):
    # prefill 19 | decode | chunk of 5 | decode | decode (len 1) | padded seq | pad rows
    return make_case(
        27,
        seq_lens=[19, 30, 12, 9, 1, 0],
        q_lens=[19, 1, 5, 1, 1, 0],
        num_rows=32,
        block_size=8,
        num_kv_heads=2,
        group=4,
        head_dim=64,
        dtype=dtype,
    )


@pytest.mark.parametrize("window,cap", [(None, None), (6, 20.0)])
def test_mixed_step_routes_decode_rows_and_matches_the_reference(window, cap):
    case = _mixed_case()
    kw = dict(scale=0.125, sliding_window=window, soft_cap=cap)
    ops = pk.get_attention_ops("pallas_interpret").for_step()
    out = pk.step_attention(ops, *_args(case, True), decode_only=False, **kw)
    assert_close(out, naive_attention(case, **kw), "float32")
    assert not np.asarray(out[27:]).any()
    plan = next(iter(ops.plan_cache.values()))
    # Query blocks only for the prefill and the chunk; decode rows are the decode kernel's.
    used = np.asarray(plan.ragged_items)[:, plans.ITEM_SEQ] < 6
    assert sorted(set(np.asarray(plan.ragged_items)[used, plans.ITEM_SEQ])) == [0, 2]
    assert (
        np.asarray(plan.decode_row).tolist()
        == [False] * 19
        + [True]
        + [False] * 5
        + [
            True,
            True,
        ]
        + [False] * 5
    )


def test_ragged_only_step_sends_every_row_through_the_ragged_kernel():
    # batch_invariant engines: a decode row's key chunks must not depend on the others.
    case = _mixed_case()
    ops = pk.get_attention_ops("pallas_interpret").for_step()
    args = _args(case, True)
    out = pk.step_attention(ops, *args, decode_only=False, ragged_only=True, scale=0.125)
    assert_close(out, naive_attention(case, scale=0.125), "float32")
    assert not np.asarray(out[27:]).any()
    plan = next(iter(ops.plan_cache.values()))
    assert not np.asarray(plan.decode_row).any() and not plan.skip_decode
    used = np.asarray(plan.ragged_items)[:, plans.ITEM_SEQ] < 6
    assert sorted(set(np.asarray(plan.ragged_items)[used, plans.ITEM_SEQ])) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"ragged_only=True needs decode_only=False"):
        pk.step_attention(ops, *args, decode_only=True, ragged_only=True, scale=0.125)


def test_decode_only_step_through_the_plan():
    case = make_case(28, seq_lens=[7, 40, 1, 0], block_size=8, num_kv_heads=2, group=4, head_dim=64)
    qsl = jnp.asarray([0, 1, 2, 3, 3], jnp.int32)
    q = jnp.pad(case.q, ((0, 4), (0, 0), (0, 0)))  # 8 token rows, 3 real
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, qsl)
    ops = pk.get_attention_ops("pallas_interpret").for_step()
    out = pk.step_attention(ops, *args, decode_only=True, scale=0.125)
    assert_close(out, reference.ragged_paged_attention(*args, scale=0.125), "float32")
    assert not np.asarray(out[3:]).any()


def test_one_plan_per_step_shared_by_every_layer(monkeypatch):
    calls = []
    real = plans.make_plan

    def counting(*a, **kw):
        calls.append(kw.get("sliding_window"))
        return real(*a, **kw)

    monkeypatch.setattr(plans, "make_plan", counting)
    case = _mixed_case()
    ops = pk.get_attention_ops("pallas_interpret").for_step()

    def three_layers(*args):
        out = 0
        for window in (None, 6, None):  # two layer types, as in a hybrid model
            out = out + pk.step_attention(
                ops, *args, decode_only=False, scale=0.125, sliding_window=window
            )
        return out

    jax.eval_shape(three_layers, *_args(case, True))
    assert calls == [None, 6]  # one plan per window, not one per layer


# -------------------------------------------------------------------- lowered IR


def _spec(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _float_ops(text: str, names) -> list[str]:
    """Lines applying one of `names` to a floating-point tensor (the q / output path;
    the int32 work tables are sliced on purpose)."""
    return [
        line
        for line in text.splitlines()
        if any(n in line for n in names) and any(t in line for t in ("xbf16>", "xf32>", "xf16>"))
    ]


def test_no_padding_or_slicing_around_the_kernels():
    cache = _spec((64, 2, 16, 128), jnp.bfloat16)
    tables, lens = _spec((8, 4)), _spec((8,))
    text = lower_for_cuda(
        lambda q, k, v, t, s, qsl: pk.ragged_paged_attention(
            q, k, v, t, s, qsl, scale=0.1, num_splits=1
        ),
        _spec((40, 8, 128), jnp.bfloat16), cache, cache, tables, lens, _spec((9,)),
    )  # fmt: skip
    assert not _float_ops(text, ("stablehlo.pad", "stablehlo.slice", "stablehlo.convert"))
    # The kernel's own output is q's dtype and shape (a reshape away from the result).
    assert "tensor<40x2x4x128xbf16>" in text
    text = lower_for_cuda(
        lambda q, k, v, t, s: pk.paged_attention(q, k, v, t, s, scale=0.1, num_splits=1),
        _spec((8, 8, 128), jnp.bfloat16), cache, cache, tables, lens,
    )  # fmt: skip
    assert not _float_ops(text, ("stablehlo.pad", "stablehlo.slice", "stablehlo.convert"))


def test_eight_warps_for_tiles_of_128_rows():
    assert default_num_warps(128, 32, 64) == 8
    assert default_num_warps(64, 32, 128) == 4
    assert default_num_warps(16, 128, 256) == 8
