"""BlockTable: each input-batch row's block ids, one table per KV-cache group (numpy).

A row holds one request's block ids in token order, per group, and how many are filled.
A step gathers the scheduled rows into padded i32[S, W] tables and turns each token's
position into a slot (block id * block_size + offset):

    group 0 (full):       row r  [b3 b8 b5  0  0 ...]   position 9, block_size 4
    group 1 (window 4):   row r  [b2 b6 b9  0  0 ...]     -> slot b5*4+1 / b9*4+1

A window group's manager frees blocks wholly below the window (and may hand them to
another request), but the row keeps their old ids; the step's table reads 0, the null
block, for them, exactly as the host's manager holds them:

    window 4, position 9 (computed 9): blocks below (9 - 4 + 1) // 4 = 1 are dead
    group 1 step table  [ 0 b6 b9  0 ...]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paged_jax.constants import NULL_BLOCK_ID

PAD_SLOT_ID = -1  # slot of a padding token: its K/V write is dropped

# One flat id list (a single-group model) or one list per KV-cache group.
BlockIds = Sequence[int] | Sequence[Sequence[int]]


class BlockTable:
    """Per-row block ids of every KV-cache group and the step's padded tables from them.

    Args:
        num_rows: rows (the input batch's max_num_seqs).
        max_blocks_per_seq: W, the width of every table.
        block_size: tokens per block.
        windows: per KV-cache group, its sliding window in tokens, or None (full attention).

    Attributes:
        tables: per group i32[num_rows, W]; entries past a row's filled length are 0.
        num_blocks: per group i32[num_rows], the filled length of each row.
    """

    def __init__(
        self,
        num_rows: int,
        max_blocks_per_seq: int,
        block_size: int,
        windows: Sequence[int | None] = (None,),
    ):
        self.block_size = block_size
        self.windows = tuple(windows)
        self.tables = tuple(
            np.zeros((num_rows, max_blocks_per_seq), np.int32) for _ in self.windows
        )
        self.num_blocks = tuple(np.zeros(num_rows, np.int32) for _ in self.windows)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def width(self) -> int:
        """W, the most blocks a row holds per group."""
        return self.tables[0].shape[1]

    # ----------------------------------------------------------------- rows
    def per_group(self, block_ids: BlockIds) -> Sequence[Sequence[int]]:
        """A flat id list (single-group models) or one list per group -> one list per group."""
        if self.num_groups == 1 and (not block_ids or not isinstance(block_ids[0], Sequence)):
            return (block_ids,)
        assert len(block_ids) == self.num_groups, "one block-id list per KV-cache group"
        return block_ids

    def add_row(self, row: int, block_ids: BlockIds) -> None:
        """Starts `row` afresh with the given block ids (a new or resumed request)."""
        for table, num in zip(self.tables, self.num_blocks):
            table[row] = NULL_BLOCK_ID
            num[row] = 0
        self.append_row(row, block_ids)

    def append_row(self, row: int, block_ids: BlockIds) -> None:
        """Appends blocks to the row's table(s): a flat list or one list per group."""
        for table, num, ids in zip(self.tables, self.num_blocks, self.per_group(block_ids)):
            if not len(ids):
                continue
            start = int(num[row])
            end = start + len(ids)
            assert end <= table.shape[1], "block table wider than max_blocks_per_seq"
            table[row, start:end] = ids
            num[row] = end

    def append_one_per_row(self, rows: np.ndarray, block_ids: Sequence[int]) -> None:
        """Appends one block to each row of group 0 in one vectorised write (decode steps).

        Equals ``append_row(row, [block_id])`` for every (row, block_id) pair.
        """
        assert self.num_groups == 1, "the one-block fast path is for single-group models"
        table, num = self.tables[0], self.num_blocks[0]
        ends = num[rows]
        assert (ends < table.shape[1]).all(), "block table wider than max_blocks_per_seq"
        table[rows, ends] = block_ids
        num[rows] = ends + 1

    def replace(self, row: int, updates: Sequence[tuple[int, int, int]]) -> None:
        """Points table slots at their copy-on-write copies: (group, index, new block id)."""
        for group, index, block_id in updates:
            assert index < self.num_blocks[group][row], "a copy replaced a missing block"
            self.tables[group][row, index] = block_id

    def truncate_row(self, row: int, num_blocks: Sequence[int]) -> None:
        """Keeps the first num_blocks[g] blocks of the row in each group g (a rollback)."""
        for table, num, keep in zip(self.tables, self.num_blocks, num_blocks):
            if keep < num[row]:
                table[row, keep : num[row]] = NULL_BLOCK_ID
                num[row] = keep

    def clear_row(self, row: int) -> None:
        """Empties the row (its request left the batch)."""
        for table, num in zip(self.tables, self.num_blocks):
            table[row, : num[row]] = NULL_BLOCK_ID
            num[row] = 0

    # ----------------------------------------------------------------- step
    def step_tables(
        self, rows: np.ndarray, num_computed: np.ndarray, num_seqs_padded: int
    ) -> tuple[np.ndarray, ...]:
        """Per group the step's i32[S, W] table: the scheduled rows in order, then 0 rows.

        Args:
            rows: i[n] the scheduled sequences' rows.
            num_computed: i32[n] tokens each already has in the cache (where its window
                starts for this step).
            num_seqs_padded: S.
        """
        n = len(rows)
        out = []
        for table, window in zip(self.tables, self.windows):
            tables = np.zeros((num_seqs_padded, table.shape[1]), np.int32)
            tables[:n] = table[rows]
            if window is not None:
                # Blocks wholly below this step's window were freed (and may be reused):
                # null them, exactly as SlidingWindowManager did before this step.
                num_dead = np.maximum(num_computed - window + 1, 0) // self.block_size
                cols = np.arange(table.shape[1])
                tables[:n][cols[None, :] < num_dead[:, None]] = NULL_BLOCK_ID
            out.append(tables)
        return tuple(out)

    def slot_mappings(
        self, row_of_token: np.ndarray, positions: np.ndarray, num_tokens_padded: int
    ) -> tuple[np.ndarray, ...]:
        """Per group the step's i32[T] slot of each token; PAD_SLOT_ID past the real ones.

        Args:
            row_of_token: i[t] the row of each real token.
            positions: i32[t] each real token's position in its sequence.
            num_tokens_padded: T.
        """
        t = len(positions)
        block_index = positions // self.block_size
        block_offset = positions % self.block_size
        out = []
        for table in self.tables:
            slot_mapping = np.full(num_tokens_padded, PAD_SLOT_ID, np.int32)
            block_ids = table[row_of_token, block_index]
            assert (block_ids > 0).all(), "a scheduled token has no block: allocate_slots skipped"
            slot_mapping[:t] = block_ids * self.block_size + block_offset
            out.append(slot_mapping)
        return tuple(out)

    def padding(
        self, num_tokens_padded: int, num_seqs_padded: int
    ) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
        """All-padding slot mappings and tables of one bucket: write nothing, read nothing."""
        slots = tuple(
            np.full(num_tokens_padded, PAD_SLOT_ID, np.int32) for _ in range(self.num_groups)
        )
        tables = tuple(
            np.zeros((num_seqs_padded, self.width), np.int32) for _ in range(self.num_groups)
        )
        return slots, tables
