"""validate=True: out-of-range ids become clear errors (checkify), in kernels and references.

Interpret mode and the XLA references clamp or drop a bad id, so without these checks a
CPU test passes while a GPU reads or writes out of bounds.
"""

from __future__ import annotations

from functools import partial

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from pk_testing import make_case

import pallas_kernels as pk
from pallas_kernels import reference


@pytest.fixture(scope="module")
def case():
    return make_case(
        0, seq_lens=[5, 9, 0], block_size=4, num_kv_heads=1, group=2, head_dim=64, poison=0.0
    )


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_valid_inputs_pass_and_give_the_unvalidated_answer(case, impl):
    ops = pk.get_attention_ops("pallas_interpret" if impl == "kernel" else "reference")
    checked_ops = pk.get_attention_ops(
        "pallas_interpret" if impl == "kernel" else "reference", validate=True
    )
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    got = pk.checked(partial(checked_ops.paged_attention, scale=0.125))(*args)
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(ops.paged_attention(*args, scale=0.125))
    )


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_out_of_range_block_id_is_a_clear_error(case, impl):
    ops = pk.get_attention_ops(
        "pallas_interpret" if impl == "kernel" else "reference", validate=True
    )
    num_blocks = case.k_cache.shape[0]
    tables = case.block_tables.at[1, 2].set(num_blocks + 3)
    with pytest.raises(
        checkify.JaxRuntimeError,
        match=rf"block_tables\[1, 2\] = {num_blocks + 3} is not a block id in \[0, {num_blocks}\)",
    ):
        pk.checked(partial(ops.paged_attention, scale=0.125))(
            case.q, case.k_cache, case.v_cache, tables, case.seq_lens
        )
    with pytest.raises(checkify.JaxRuntimeError, match=r"block_tables\[0, 0\] = -1"):
        pk.checked(partial(ops.ragged_paged_attention, scale=0.125))(
            case.q,
            case.k_cache,
            case.v_cache,
            case.block_tables.at[0, 0].set(-1),
            case.seq_lens,
            case.query_start_loc,
        )


def test_lengths_past_the_table_and_bad_query_starts_are_errors(case):
    ops = pk.get_attention_ops("reference", validate=True)
    cap = case.block_tables.shape[1] * 4
    args = (case.q, case.k_cache, case.v_cache, case.block_tables)
    with pytest.raises(checkify.JaxRuntimeError, match=rf"seq_lens\[2\] = {cap + 1} must be in"):
        pk.checked(partial(ops.paged_attention, scale=0.1))(*args, case.seq_lens.at[2].set(cap + 1))
    qsl = jnp.array([0, 1, 2, 9], jnp.int32)  # sequence 2 has seq_len 0 but 7 new tokens
    with pytest.raises(checkify.JaxRuntimeError, match=r"sequence 2 has q_len .* = 7"):
        pk.checked(partial(ops.ragged_paged_attention, scale=0.1))(*args, case.seq_lens, qsl)


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_slot_mapping_out_of_range_or_repeated_is_an_error(impl):
    write = pk.get_attention_ops(
        "pallas_interpret" if impl == "kernel" else "reference", validate=True
    ).write_kv
    k_cache, v_cache = pk.init_kv_cache(4, 4, 1, 64, jnp.float32)
    new = jnp.ones((3, 1, 64), jnp.float32)
    ok = pk.checked(write)(k_cache, v_cache, new, new, jnp.array([5, -1, 15], jnp.int32))
    assert float(ok[0][1, 0, 1, 0]) == 1.0
    with pytest.raises(checkify.JaxRuntimeError, match=r"slot_mapping\[2\] = 16 must be -1"):
        pk.checked(write)(k_cache, v_cache, new, new, jnp.array([5, -1, 16], jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match="writes slot 5 twice"):
        pk.checked(write)(k_cache, v_cache, new, new, jnp.array([5, 6, 5], jnp.int32))


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_copy_pairs_are_checked(impl):
    copy = pk.get_attention_ops(
        "pallas_interpret" if impl == "kernel" else "reference", validate=True
    ).copy_blocks
    k_cache, v_cache = pk.init_kv_cache(6, 4, 1, 64, jnp.float32)
    ids = partial(jnp.array, dtype=jnp.int32)
    pk.checked(copy)(k_cache, v_cache, ids([1, 2]), ids([3, -1]))  # fine
    for src, dst, message in [
        ([1, 6], [3, 4], r"src_block_ids\[1\] = 6 is not a block id in \[0, 6\)"),
        ([1, 2], [3, 7], r"dst_block_ids\[1\] = 7 must be -1"),
        ([1, 2], [3, 3], r"dst_block_ids\[0\] = 3 appears twice"),
        ([1, 2], [2, 4], r"dst_block_ids\[0\] = 2 is also a source"),
    ]:
        with pytest.raises(checkify.JaxRuntimeError, match=message):
            pk.checked(copy)(k_cache, v_cache, ids(src), ids(dst))


def test_decode_only_promise_is_checked(case):
    ops = pk.get_attention_ops("reference", validate=True)
    qsl = jnp.array([0, 2, 3, 3], jnp.int32)  # sequence 0 has two new tokens
    with pytest.raises(checkify.JaxRuntimeError, match="sequence 0 has 2 new tokens"):
        pk.checked(partial(pk.step_attention, ops, decode_only=True, scale=0.1))(
            case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, qsl
        )


def test_validate_without_checkify_fails_loudly_instead_of_skipping(case):
    with pytest.raises(ValueError, match="not functionalized"):
        reference.paged_attention(
            case.q,
            case.k_cache,
            case.v_cache,
            case.block_tables,
            case.seq_lens,
            scale=0.1,
            validate=True,
        )


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_a_tuple_of_group_tables_names_for_group(case, impl):
    # A model written to the one-group contract passes attn_metadata.block_tables, which is
    # now a tuple of one array per KV-cache group: the error must say what to pass instead.
    ops = pk.get_attention_ops("pallas_interpret" if impl == "kernel" else "reference")
    with pytest.raises(
        ValueError, match=r"block_tables must be an array, got a tuple of 1 .*for_group\(0\)"
    ):
        ops.paged_attention(
            case.q, case.k_cache, case.v_cache, (case.block_tables,), case.seq_lens, scale=0.125
        )
