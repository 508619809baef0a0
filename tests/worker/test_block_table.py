"""BlockTable: per-row block ids per KV-cache group, and the step's tables and slots."""

from __future__ import annotations

import random

import numpy as np
import pytest

from paged_jax.worker.block_table import PAD_SLOT_ID, BlockTable

BS = 4


def test_rows_add_append_replace_and_clear_exact_ids():
    table = BlockTable(num_rows=3, max_blocks_per_seq=4, block_size=BS)
    table.add_row(1, [7, 3])
    table.append_row(1, [5])
    table.replace(1, [(0, 1, 9)])  # a copy-on-write copy: slot 1 now names block 9
    np.testing.assert_array_equal(table.tables[0][1], [7, 9, 5, 0])
    assert table.num_blocks[0].tolist() == [0, 3, 0]
    table.clear_row(1)
    assert not table.tables[0].any() and not table.num_blocks[0].any()
    table.add_row(1, [2])  # a reused row starts afresh
    np.testing.assert_array_equal(table.tables[0][1], [2, 0, 0, 0])
    with pytest.raises(AssertionError, match="wider than max_blocks_per_seq"):
        table.append_row(1, [1, 2, 3, 4])
    with pytest.raises(AssertionError, match="replaced a missing block"):
        table.replace(1, [(0, 1, 6)])


def test_step_tables_and_slots_per_group_with_window_nulls():
    # Group 0 full attention, group 1 a window of 4 tokens; both hold 3 blocks for row 0.
    table = BlockTable(num_rows=2, max_blocks_per_seq=4, block_size=BS, windows=(None, 4))
    table.add_row(0, [[3, 8, 5], [2, 6, 9]])
    rows = np.asarray([0])
    # Position 9 (9 computed): the window sees 6..9, so block 0 (tokens 0..3) is dead.
    full, window = table.step_tables(rows, np.asarray([9], np.int32), num_seqs_padded=2)
    np.testing.assert_array_equal(full, [[3, 8, 5, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(window, [[0, 6, 9, 0], [0, 0, 0, 0]])
    slots = table.slot_mappings(rows, np.asarray([9], np.int32), num_tokens_padded=3)
    np.testing.assert_array_equal(slots[0], [5 * BS + 1, PAD_SLOT_ID, PAD_SLOT_ID])
    np.testing.assert_array_equal(slots[1], [9 * BS + 1, PAD_SLOT_ID, PAD_SLOT_ID])
    # The row itself keeps the old ids (only the step's copy reads the null block).
    np.testing.assert_array_equal(table.tables[1][0], [2, 6, 9, 0])
    with pytest.raises(AssertionError, match="one block-id list per KV-cache group"):
        table.append_row(0, [1])


def test_a_token_without_a_block_is_a_caller_bug():
    table = BlockTable(num_rows=1, max_blocks_per_seq=2, block_size=BS)
    table.add_row(0, [4])
    with pytest.raises(AssertionError, match="has no block"):
        table.slot_mappings(np.asarray([0]), np.asarray([BS], np.int32), 16)


def test_one_block_per_row_fast_path_equals_appending_row_by_row():
    rng = random.Random(3)
    fast = BlockTable(num_rows=8, max_blocks_per_seq=16, block_size=BS)
    slow = BlockTable(num_rows=8, max_blocks_per_seq=16, block_size=BS)
    for row in range(8):
        ids = [rng.randrange(1, 100) for _ in range(rng.randint(0, 3))]
        fast.add_row(row, ids)
        slow.add_row(row, ids)
    for _ in range(10):
        rows = rng.sample(range(8), rng.randint(1, 8))
        ids = [rng.randrange(1, 100) for _ in rows]
        fast.append_one_per_row(np.asarray(rows), ids)
        for row, block_id in zip(rows, ids):
            slow.append_row(row, [block_id])
        np.testing.assert_array_equal(fast.tables[0], slow.tables[0])
        np.testing.assert_array_equal(fast.num_blocks[0], slow.num_blocks[0])
