"""InputBatch: persistent numpy buffers packed into a fixed-shape StepInput (host side).

Each running request owns one row of the persistent buffers (its token ids, block
table and sampling settings). Rows are written when a request is added, appended to
as it grows, and reused when it leaves; a step only gathers the scheduled rows and
computes positions / slot mapping with vectorised numpy, then pads everything to the
step's (num_tokens, num_seqs) bucket so the jitted step never sees a new shape.

    query_start_loc:  0        3    4          9 (= num real tokens) ... padding
    tokens:           [a a a | b | c c c c c | pad pad ...]
    sequence a: 3 new tokens at positions seq_len_a-3 .. seq_len_a-1

A model with several KV-cache groups (full attention + sliding windows) has one block
table and one slot mapping per group: group 0 in `block_tables` / `slot_mapping`, the
others in `extra_block_tables` / `extra_slot_mappings`. Window tables read 0 (the null
block) for blocks wholly below the window, as the host's managers hold them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from paged_jax.config import EngineConfig, bucket_for
from paged_jax.core.kv_cache_spec import FULL_ATTENTION, KVCacheGroupSpec
from paged_jax.core.scheduler_output import ScheduledSeq
from paged_jax.sampling_params import MAX_MIN_TOKENS_STOP_IDS, SamplingParams

PAD_SLOT_ID = -1


@dataclasses.dataclass(frozen=True)
class StepInput:
    """Everything one jitted step reads, padded to a (num_tokens, num_seqs) bucket.

    T = padded num_tokens, S = padded num_seqs, W = max_blocks_per_seq, K = stop-id width,
    G = number of KV-cache groups (slot_mapping and block_tables are group 0's).
    C = max_num_seqs (at most one copy-on-write per scheduled sequence and group).
    """

    token_ids: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    slot_mapping: np.ndarray  # i32[T]; -1 = padding (write dropped)
    block_tables: np.ndarray  # i32[S, W]; 0 = null block
    seq_lens: np.ndarray  # i32[S]; 0 = padded sequence
    query_start_loc: np.ndarray  # i32[S + 1]
    logits_indices: np.ndarray  # i32[S]; index of each sequence's last scheduled token
    temperature: np.ndarray  # f32[S]
    top_k: np.ndarray  # i32[S]
    top_p: np.ndarray  # f32[S]
    min_p: np.ndarray  # f32[S]
    seeds: np.ndarray  # u32[S]
    counters: np.ndarray  # i32[S]; tokens generated so far per sequence
    masked_token_ids: np.ndarray  # i32[S, K]; banned this step (min_tokens), -1 = none
    token_rows: np.ndarray  # i32[T]; row whose on-device sample is this token, -1 = token_ids
    sample_rows: np.ndarray  # i32[S]; row that keeps the sample on device; R = padding
    copy_src: np.ndarray  # i32[C]; copy-on-write sources (C = max_num_seqs), run first
    copy_dst: np.ndarray  # i32[C]; their destinations, -1 = padding (no copy)
    num_tokens: int  # real (unpadded) tokens
    num_seqs: int  # real (unpadded) sequences
    extra_slot_mappings: tuple[np.ndarray, ...] = ()  # G - 1 x i32[T]: groups 1..G-1
    extra_block_tables: tuple[np.ndarray, ...] = ()  # G - 1 x i32[S, W]: groups 1..G-1
    # Penalties: None when no scheduled request uses one (the runner then feeds a
    # resident all-zero history of the same shape, so nothing is copied per step).
    presence_penalty: np.ndarray | None = None  # f32[S]; 0 = off
    frequency_penalty: np.ndarray | None = None  # f32[S]; 0 = off
    repetition_penalty: np.ndarray | None = None  # f32[S]; 1 = off
    history_token_ids: np.ndarray | None = None  # i32[S, max_model_len]; prompt + output
    # Every scheduled sequence has exactly one new token (row i = sequence i): the step
    # may take the decode kernel. Static for the jitted step: its own compile per bucket.
    decode_only: bool = False

    @property
    def bucket(self) -> tuple[int, int]:
        """The (num_tokens, num_seqs) bucket of this step."""
        return int(self.token_ids.shape[0]), int(self.seq_lens.shape[0])


def decode_step_shapes(config: EngineConfig) -> list[tuple[int, int]]:
    """The (num_tokens, num_seqs) buckets a decode-only step can land in (n tokens, n seqs)."""
    shapes = {
        (bucket_for(n, config.token_buckets), bucket_for(n, config.seq_buckets))
        for n in range(1, config.max_num_seqs + 1)
    }
    return sorted(shapes)


class _RowsSampling(NamedTuple):
    """A step's padded per-row sampling arrays (a function of the scheduled rows)."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seeds: np.ndarray
    sample_rows: np.ndarray
    no_masked: np.ndarray  # i32[S, K] all -1
    any_min_tokens: bool
    any_penalty: bool


class InputBatch:
    """Persistent per-request rows and the packing of a step's StepInput."""

    def __init__(
        self,
        config: EngineConfig,
        stop_ids_width: int = MAX_MIN_TOKENS_STOP_IDS,
        *,
        kv_cache_groups: Sequence[KVCacheGroupSpec] = (FULL_ATTENTION,),
    ):
        self.config = config
        self.block_size = config.block_size
        n, w = config.max_num_seqs, config.max_blocks_per_seq
        self.max_model_len = config.max_model_len
        self.token_ids = np.zeros((n, config.max_model_len), np.int32)
        self.num_token_ids = np.zeros(n, np.int32)
        self.windows = tuple(g.sliding_window for g in kv_cache_groups)
        # Per group: block tables i32[n, w] and their filled lengths i32[n].
        self.group_block_tables = [np.zeros((n, w), np.int32) for _ in self.windows]
        self.group_num_blocks = [np.zeros(n, np.int32) for _ in self.windows]
        self.block_tables = self.group_block_tables[0]
        self.num_blocks = self.group_num_blocks[0]
        self.temperature = np.zeros(n, np.float32)
        self.top_k = np.zeros(n, np.int32)
        self.top_p = np.ones(n, np.float32)
        self.min_p = np.zeros(n, np.float32)
        self.seeds = np.zeros(n, np.uint32)
        self.min_tokens = np.zeros(n, np.int32)
        self.stop_ids = np.full((n, stop_ids_width), -1, np.int32)
        self.presence_penalty = np.zeros(n, np.float32)
        self.frequency_penalty = np.zeros(n, np.float32)
        self.repetition_penalty = np.ones(n, np.float32)
        self.has_penalty = np.zeros(n, bool)
        self.row_of: dict[str, int] = {}
        self.req_of_row: list[str | None] = [None] * n
        # Bumped whenever a row changes hands: keys the reuse of sampling arrays.
        self._rows_version = 0
        self._rows_sampling_cache: tuple[tuple, _RowsSampling] | None = None
        self._one_to_n = np.arange(1, n + 1, dtype=np.int32)

    # ----------------------------------------------------------------- rows
    def add_request(
        self,
        req_id: str,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        params: SamplingParams,
        seed: int,
        min_tokens_stop_ids: Sequence[int] = (),
    ) -> None:
        """Give a (new or resumed) request a row holding its tokens and block table."""
        assert req_id not in self.row_of, f"request {req_id!r} already has a row: double add"
        row = self.req_of_row.index(None)
        self._rows_version += 1
        self.row_of[req_id] = row
        self.req_of_row[row] = req_id
        self.num_token_ids[row] = 0
        self.append_token_ids(req_id, token_ids)
        for table, num in zip(self.group_block_tables, self.group_num_blocks):
            num[row] = 0
            table[row] = 0
        self.append_block_ids(req_id, block_ids)
        self.temperature[row] = params.temperature
        self.top_k[row] = params.effective_top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.seeds[row] = seed
        self.min_tokens[row] = params.min_tokens
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.has_penalty[row] = params.has_penalties
        self.stop_ids[row] = -1
        if params.min_tokens > 0:
            ids = list(dict.fromkeys(min_tokens_stop_ids))
            assert len(ids) <= self.stop_ids.shape[1], "SamplingParams should cap stop ids"
            self.stop_ids[row, : len(ids)] = ids

    def remove_request(self, req_id: str) -> None:
        """Free the request's row (its contents are overwritten on reuse)."""
        row = self.row_of.pop(req_id)
        self._rows_version += 1
        self.req_of_row[row] = None
        for table, num in zip(self.group_block_tables, self.group_num_blocks):
            table[row, : num[row]] = 0
            num[row] = 0

    def append_token_ids(self, req_id: str, token_ids: Sequence[int]) -> None:
        row = self.row_of[req_id]
        start = int(self.num_token_ids[row])
        end = start + len(token_ids)
        assert end <= self.max_model_len, "scheduler let a request grow past max_model_len"
        self.token_ids[row, start:end] = token_ids
        self.num_token_ids[row] = end

    def replace_block_ids(self, req_id: str, updates: Sequence[tuple[int, int, int]]) -> None:
        """Points table slots at their copy-on-write copies: (group, index, new block id)."""
        row = self.row_of[req_id]
        for group, index, block_id in updates:
            assert index < self.group_num_blocks[group][row], "a copy replaced a missing block"
            self.group_block_tables[group][row, index] = block_id

    def append_sampled(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Append one sampled token to each given row (one vectorised write per step)."""
        if not rows:
            return
        r = np.asarray(rows, np.intp)
        ends = self.num_token_ids[r]
        assert (ends < self.max_model_len).all(), "scheduler let a request pass max_model_len"
        self.token_ids[r, ends] = token_ids
        self.num_token_ids[r] = ends + 1

    def _per_group(self, block_ids) -> Sequence[Sequence[int]]:
        """A flat id list (single-group models) or one list per group -> per group."""
        if len(self.windows) == 1 and (not block_ids or not isinstance(block_ids[0], Sequence)):
            return (block_ids,)
        assert len(block_ids) == len(self.windows), "one block-id list per KV-cache group"
        return block_ids

    def append_block_ids(
        self, req_id: str, block_ids: Sequence[int] | Sequence[Sequence[int]]
    ) -> None:
        """Appends blocks to the request's table(s): a flat list or one list per group."""
        row = self.row_of[req_id]
        for g, ids in enumerate(self._per_group(block_ids)):
            if not len(ids):
                continue
            num = self.group_num_blocks[g]
            start = int(num[row])
            end = start + len(ids)
            table = self.group_block_tables[g]
            assert end <= table.shape[1], "block table wider than max_blocks_per_seq"
            table[row, start:end] = ids
            num[row] = end

    def append_new_block_ids(
        self, new_block_ids: dict[str, Sequence[int] | Sequence[Sequence[int]]]
    ) -> None:
        """append_block_ids for every request of a step's SchedulerOutput.new_block_ids.

        The common decode case (one group, one new block per request) is one vectorised
        write; anything else goes request by request.
        """
        if len(self.windows) == 1 and len(new_block_ids) > 1:
            ids = []
            for block_ids in new_block_ids.values():
                group = self._per_group(block_ids)[0]
                if len(group) != 1:
                    break
                ids.append(group[0])
            else:
                rows = np.fromiter(
                    map(self.row_of.__getitem__, new_block_ids), np.intp, len(new_block_ids)
                )
                num = self.num_blocks
                ends = num[rows]
                assert (ends < self.block_tables.shape[1]).all(), (
                    "block table wider than max_blocks_per_seq"
                )
                self.block_tables[rows, ends] = ids
                num[rows] = ends + 1
                return
        for req_id, block_ids in new_block_ids.items():
            self.append_block_ids(req_id, block_ids)

    # ----------------------------------------------------------------- step
    def prepare(
        self, seqs: Sequence[ScheduledSeq], block_copies: Sequence[tuple[int, int]] = ()
    ) -> StepInput:
        """Pack the scheduled sequences, in order, and the step's block copies into a StepInput."""
        cfg = self.config
        num_seqs = len(seqs)
        assert 0 < num_seqs <= cfg.max_num_seqs, "scheduler broke the max_num_seqs budget"
        # The ScheduledSeq columns in one C-level transpose (no per-sequence Python).
        req_ids, computed_l, num_new_l, num_out_l, _ = zip(*seqs)
        rows = np.fromiter(map(self.row_of.__getitem__, req_ids), np.intp, num_seqs)
        computed = np.array(computed_l, np.int32)
        num_out = np.array(num_out_l, np.int32)
        num_new = np.array(num_new_l, np.int32)
        # Every sequence has exactly one new token: token i is sequence i's, at
        # position computed[i], and the per-token index arithmetic is skipped.
        decode_only = min(num_new_l) == 1 and max(num_new_l) == 1
        num_tokens = num_seqs if decode_only else int(num_new.sum())
        assert num_tokens <= cfg.max_num_batched_tokens, "scheduler broke the token budget"
        t_pad = bucket_for(num_tokens, cfg.token_buckets)
        s_pad = bucket_for(num_seqs, cfg.seq_buckets)

        if decode_only:
            cu = self._one_to_n[:num_seqs]
            pos = computed
            row_of_token = rows
        else:
            cu = np.cumsum(num_new)
            # Per token: which scheduled sequence it belongs to and its offset in the chunk.
            seq_of_token = np.repeat(np.arange(num_seqs), num_new)
            offset = np.arange(num_tokens) - np.repeat(cu - num_new, num_new)
            pos = computed[seq_of_token] + offset
            row_of_token = rows[seq_of_token]

        token_ids = np.zeros(t_pad, np.int32)
        positions = np.zeros(t_pad, np.int32)
        token_ids[:num_tokens] = self.token_ids[row_of_token, pos]
        # A token the host does not have yet (async scheduling: sampled by the step in
        # flight) is read on device from its row's last sample.
        token_rows = np.full(t_pad, -1, np.int32)
        token_rows[:num_tokens] = np.where(
            pos >= self.num_token_ids[row_of_token], row_of_token, -1
        )
        positions[:num_tokens] = pos
        slot_mappings, block_tables = [], []
        block_size = self.block_size
        block_index = pos // block_size
        block_offset = pos % block_size
        for table, window in zip(self.group_block_tables, self.windows):
            slot_mapping = np.full(t_pad, PAD_SLOT_ID, np.int32)
            block_ids = table[row_of_token, block_index]
            assert (block_ids > 0).all(), "a scheduled token has no block: allocate_slots skipped"
            slot_mapping[:num_tokens] = block_ids * block_size + block_offset
            tables = np.zeros((s_pad, table.shape[1]), np.int32)
            tables[:num_seqs] = table[rows]
            if window is not None:
                # Blocks wholly below this step's window were freed (and may be reused):
                # null them, exactly as SlidingWindowManager did before this step.
                num_dead = np.maximum(computed - window + 1, 0) // block_size
                cols = np.arange(table.shape[1])
                tables[:num_seqs][cols[None, :] < num_dead[:, None]] = 0
            slot_mappings.append(slot_mapping)
            block_tables.append(tables)
        seq_lens = np.zeros(s_pad, np.int32)
        seq_lens[:num_seqs] = computed + num_new
        query_start_loc = np.full(s_pad + 1, num_tokens, np.int32)
        query_start_loc[0] = 0
        query_start_loc[1 : num_seqs + 1] = cu
        logits_indices = np.zeros(s_pad, np.int32)
        logits_indices[:num_seqs] = cu - 1
        counters = np.zeros(s_pad, np.int32)
        counters[:num_seqs] = num_out

        rows_sampling = self._rows_sampling(rows, s_pad)

        def padded(buf: np.ndarray, fill) -> np.ndarray:
            out = np.full((s_pad, *buf.shape[1:]), fill, buf.dtype)
            out[:num_seqs] = buf[rows]
            return out

        if rows_sampling.any_min_tokens:
            masked = padded(self.stop_ids, -1)
            active = np.zeros(s_pad, bool)
            active[:num_seqs] = num_out < self.min_tokens[rows]
            masked[~active] = -1
        else:  # nothing banned: the same all -1 array every step
            masked = rows_sampling.no_masked
        penalties = {}
        if rows_sampling.any_penalty:
            penalties = dict(
                presence_penalty=padded(self.presence_penalty, 0.0),
                frequency_penalty=padded(self.frequency_penalty, 0.0),
                repetition_penalty=padded(self.repetition_penalty, 1.0),
                history_token_ids=padded(self.token_ids, 0),
            )
        copy_src, copy_dst = self._copies(block_copies)
        return StepInput(
            token_ids=token_ids,
            positions=positions,
            slot_mapping=slot_mappings[0],
            block_tables=block_tables[0],
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            logits_indices=logits_indices,
            temperature=rows_sampling.temperature,
            top_k=rows_sampling.top_k,
            top_p=rows_sampling.top_p,
            min_p=rows_sampling.min_p,
            seeds=rows_sampling.seeds,
            counters=counters,
            masked_token_ids=masked,
            token_rows=token_rows,
            sample_rows=rows_sampling.sample_rows,
            copy_src=copy_src,
            copy_dst=copy_dst,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            extra_slot_mappings=tuple(slot_mappings[1:]),
            extra_block_tables=tuple(block_tables[1:]),
            **penalties,
            decode_only=decode_only,
        )

    def _rows_sampling(self, rows: np.ndarray, s_pad: int) -> _RowsSampling:
        """The step's per-row sampling arrays, reused while the scheduled rows and their
        requests stay the same (the usual decode step); never written after packing."""
        key = (rows.tobytes(), s_pad, self._rows_version)
        cached = self._rows_sampling_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        num_seqs = len(rows)

        def padded(buf: np.ndarray, fill) -> np.ndarray:
            out = np.full((s_pad, *buf.shape[1:]), fill, buf.dtype)
            out[:num_seqs] = buf[rows]
            return out

        sample_rows = np.full(s_pad, len(self.req_of_row), np.int32)
        sample_rows[:num_seqs] = rows
        entry = _RowsSampling(
            temperature=padded(self.temperature, 0.0),
            top_k=padded(self.top_k, 0),
            top_p=padded(self.top_p, 1.0),
            min_p=padded(self.min_p, 0.0),
            seeds=padded(self.seeds, 0),
            sample_rows=sample_rows,
            no_masked=np.full((s_pad, self.stop_ids.shape[1]), -1, np.int32),
            any_min_tokens=bool((self.min_tokens[rows] > 0).any()),
            any_penalty=bool(self.has_penalty[rows].any()),
        )
        self._rows_sampling_cache = (key, entry)
        return entry

    def _copies(self, pairs: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        width = self.config.max_num_seqs
        assert len(pairs) <= width, "more block copies than scheduled sequences in one step"
        src = np.zeros(width, np.int32)
        dst = np.full(width, PAD_SLOT_ID, np.int32)
        if pairs:
            src[: len(pairs)], dst[: len(pairs)] = zip(*pairs)
        return src, dst

    def dummy_step_input(
        self, num_tokens: int, num_seqs: int, decode_only: bool = False
    ) -> StepInput:
        """An all-padding StepInput of one bucket (for warmup): writes and reads nothing."""
        s, t, w = num_seqs, num_tokens, self.block_tables.shape[1]
        k = self.stop_ids.shape[1]
        return StepInput(
            token_ids=np.zeros(t, np.int32),
            positions=np.zeros(t, np.int32),
            slot_mapping=np.full(t, PAD_SLOT_ID, np.int32),
            block_tables=np.zeros((s, w), np.int32),
            seq_lens=np.zeros(s, np.int32),
            query_start_loc=np.zeros(s + 1, np.int32),
            logits_indices=np.zeros(s, np.int32),
            temperature=np.zeros(s, np.float32),
            top_k=np.zeros(s, np.int32),
            top_p=np.ones(s, np.float32),
            min_p=np.zeros(s, np.float32),
            seeds=np.zeros(s, np.uint32),
            counters=np.zeros(s, np.int32),
            masked_token_ids=np.full((s, k), -1, np.int32),
            token_rows=np.full(t, -1, np.int32),
            sample_rows=np.full(s, len(self.req_of_row), np.int32),
            copy_src=np.zeros(self.config.max_num_seqs, np.int32),
            copy_dst=np.full(self.config.max_num_seqs, PAD_SLOT_ID, np.int32),
            num_tokens=0,
            num_seqs=0,
            extra_slot_mappings=tuple(np.full(t, PAD_SLOT_ID, np.int32) for _ in self.windows[1:]),
            extra_block_tables=tuple(np.zeros((s, w), np.int32) for _ in self.windows[1:]),
            decode_only=decode_only,
        )
