"""AttentionMetadata: one slot mapping and block table per KV-cache group, a pytree."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from paged_jax.models import AttentionMetadata
from paged_jax.worker.step_input import GroupTables


def _meta(**kwargs) -> AttentionMetadata:
    base = dict(
        slot_mappings=(np.arange(4, dtype=np.int32), np.arange(4, 8, dtype=np.int32)),
        block_tables=(np.ones((2, 3), np.int32), np.full((2, 3), 2, np.int32)),
        seq_lens=np.asarray([3, 1], np.int32),
        query_start_loc=np.asarray([0, 3, 4], np.int32),
        logits_indices=np.asarray([2, 3], np.int32),
    )
    return AttentionMetadata(**{**base, **kwargs})


def test_for_group_gives_that_groups_slots_and_table():
    meta = _meta()
    assert meta.num_groups == 2
    slot_mapping, block_table = meta.for_group(1)
    np.testing.assert_array_equal(slot_mapping, [4, 5, 6, 7])
    assert (block_table == 2).all()
    assert isinstance(meta.for_group(0), GroupTables)
    with pytest.raises(ValueError, match=r"kv_cache_group=2 must be in \[0, 2\)"):
        meta.for_group(2)


def test_a_single_array_is_one_group():
    table = np.ones((2, 3), np.int32)
    meta = _meta(slot_mappings=np.zeros(4, np.int32), block_tables=table)
    assert meta.num_groups == 1 and meta.for_group(0).block_table is table
    with pytest.raises(
        ValueError, match=r"len\(slot_mappings\)=1 must equal len\(block_tables\)=2"
    ):
        _meta(slot_mappings=np.zeros(4, np.int32))


def test_flags_are_static_and_arrays_are_leaves():
    meta = _meta(decode_only=True, validate=True)
    leaves, treedef = jax.tree.flatten(meta)
    assert len(leaves) == 2 + 2 + 3  # per group slots and tables, then the three arrays
    assert jax.tree.unflatten(treedef, leaves).decode_only

    @jax.jit
    def branch(m: AttentionMetadata):
        # A Python branch on the flag: only possible because it is static.
        return m.seq_lens * (2 if m.decode_only else 3)

    np.testing.assert_array_equal(branch(meta), [6, 2])
    np.testing.assert_array_equal(branch(_meta()), [9, 3])
