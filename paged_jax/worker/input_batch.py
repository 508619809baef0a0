"""InputBatch: persistent numpy rows packed into a fixed-shape StepInput (host side).

Each running request owns one row of the persistent buffers (its token ids, block
tables and sampling settings). Rows are written when a request is added, appended to
as it grows, and reused when it leaves; a step only gathers the scheduled rows and
computes positions / slot mappings with vectorised numpy, then pads everything to the
step's (num_tokens, num_seqs) bucket so the jitted step never sees a new shape.

    query_start_loc:  0        3    4          9 (= num real tokens) ... padding
    tokens:           [a a a | b | c c c c c | pad pad ...]
    sequence a: 3 new tokens at positions seq_len_a-3 .. seq_len_a-1

The result is already grouped the way the step consumes it (paged_jax.worker.step_input):
AttentionMetadata with one block table and slot mapping per KV-cache group (the rows
live in a BlockTable), SamplingMetadata, the TokenFeed and the step's StepCopies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from paged_jax.config import EngineConfig, bucket_for
from paged_jax.core.copy_on_write import max_copies_per_step
from paged_jax.core.kv_cache_spec import FULL_ATTENTION, KVCacheGroupSpec
from paged_jax.core.scheduler_output import ScheduledSeq, SchedulerOutput
from paged_jax.sampling_params import MAX_MIN_TOKENS_STOP_IDS, SamplingParams
from paged_jax.worker.block_table import PAD_SLOT_ID, BlockIds, BlockTable
from paged_jax.worker.step_input import (
    AttentionMetadata,
    SamplingMetadata,
    SpecDecodeInput,
    StepCopies,
    StepInput,
    TokenFeed,
)

__all__ = ["PAD_SLOT_ID", "InputBatch", "ScheduledSeq", "StepInput", "decode_step_shapes"]


def decode_step_shapes(config: EngineConfig) -> list[tuple[int, int]]:
    """The (num_tokens, num_seqs) shapes a decode-only step can have: n tokens for n
    sequences, n <= max_num_seqs, so only the token buckets up to max_num_seqs's. None
    under batch_invariant, whose steps all take the ragged path."""
    if config.batch_invariant:
        return []
    shapes = set()
    for n in range(1, config.max_num_seqs + 1):
        t = bucket_for(n, config.token_buckets)
        shapes.add((t, config.seq_bucket(t)))
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
    processed_logprobs: np.ndarray | None  # bool[S]; None: every row raw_logprobs


class InputBatch:
    """Persistent per-request rows and the packing of a step's StepInput.

    Args:
        config: the resolved EngineConfig (buckets, max_num_seqs, max_model_len, ...).
            With speculative decoding (config.num_speculative_tokens = k > 0) every
            step carries a SpecDecodeInput and k + 1 logits rows per sequence.
        stop_ids_width: K, the most stop ids min_tokens bans per request.
        kv_cache_groups: the model's KV-cache groups (one block table each).
    """

    def __init__(
        self,
        config: EngineConfig,
        stop_ids_width: int = MAX_MIN_TOKENS_STOP_IDS,
        *,
        kv_cache_groups: Sequence[KVCacheGroupSpec] = (FULL_ATTENTION,),
    ):
        self.config = config
        n = config.max_num_seqs
        # A scheduled sequence writes into at most one shared block per KV-cache group
        # (the partial last block its fork shares), so a step has at most this many
        # copies on write (paged_jax.core.copy_on_write.max_copies_per_step).
        self.copies_width = max_copies_per_step(n, len(kv_cache_groups))
        self.max_model_len = config.max_model_len
        self.token_ids = np.zeros((n, config.max_model_len), np.int32)
        self.num_token_ids = np.zeros(n, np.int32)
        self.block_table = BlockTable(
            n,
            config.max_blocks_per_seq,
            config.block_size,
            windows=[g.sliding_window for g in kv_cache_groups],
        )
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
        self.processed_logprobs = np.zeros(n, bool)
        self.row_of: dict[str, int] = {}
        self.req_of_row: list[str | None] = [None] * n
        # Bumped whenever a row changes hands: keys the reuse of sampling arrays.
        self._rows_version = 0
        self._rows_sampling_cache: tuple[tuple, _RowsSampling] | None = None
        self._one_to_n = np.arange(1, n + 1, dtype=np.int32)
        self.num_spec_tokens = config.num_speculative_tokens

    # ----------------------------------------------------------------- rows
    def apply_schedule(
        self,
        out: SchedulerOutput,
        requests: Mapping[str, Any],
        seeds: Mapping[str, int],
        eos_token_ids: Sequence[int],
    ) -> None:
        """Mirrors a schedule's row changes: removed requests' rows go first, then new
        (or resumed) requests get rows (their ``sampling_params`` from ``requests``,
        their seeds; a min_tokens request also stops early on none of eos_token_ids),
        then new and replaced block ids land."""
        for req_id in out.removed_req_ids:
            if req_id in self.row_of:
                self.remove_request(req_id)
        for row in out.new_rows:
            params = requests[row.req_id].sampling_params
            stop_ids = ()
            if params.min_tokens:
                stop_ids = [*params.stop_token_ids, *eos_token_ids]
            self.add_request(
                row.req_id, row.token_ids, row.block_ids, params, seeds[row.req_id], stop_ids
            )
        if out.new_block_ids:
            self.append_new_block_ids(out.new_block_ids)
        for req_id, updates in out.replaced_block_ids.items():
            self.replace_block_ids(req_id, updates)

    def add_request(
        self,
        req_id: str,
        token_ids: Sequence[int],
        block_ids: BlockIds,
        params: SamplingParams,
        seed: int,
        min_tokens_stop_ids: Sequence[int] = (),
    ) -> None:
        """Give a (new or resumed) request a row holding its tokens and block tables."""
        assert req_id not in self.row_of, f"request {req_id!r} already has a row: double add"
        row = self.req_of_row.index(None)
        self._rows_version += 1
        self.row_of[req_id] = row
        self.req_of_row[row] = req_id
        self.num_token_ids[row] = 0
        self.append_token_ids(req_id, token_ids)
        self.block_table.add_row(row, block_ids)
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
        processed = params.logprobs_mode == "processed_logprobs"
        if processed and self.num_spec_tokens:
            raise ValueError(
                "SamplingParams.logprobs_mode='processed_logprobs' is not supported with "
                "speculative decoding yet; use 'raw_logprobs'"
            )
        self.processed_logprobs[row] = processed
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
        self.block_table.clear_row(row)

    def append_token_ids(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Appends known token ids (prompt or output) to the request's row."""
        row = self.row_of[req_id]
        start = int(self.num_token_ids[row])
        end = start + len(token_ids)
        assert end <= self.max_model_len, "scheduler let a request grow past max_model_len"
        self.token_ids[row, start:end] = token_ids
        self.num_token_ids[row] = end

    def set_draft_tokens(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Writes drafts right after the row's known tokens without counting them: the
        step reads them there as its input tokens, and the penalties as history."""
        row = self.row_of[req_id]
        start = int(self.num_token_ids[row])
        assert start + len(token_ids) <= self.max_model_len, "drafts past max_model_len"
        self.token_ids[row, start : start + len(token_ids)] = token_ids

    def truncate_block_ids(self, req_id: str, num_blocks: Sequence[int]) -> None:
        """Keeps the first num_blocks[g] block ids of the request's row per group."""
        self.block_table.truncate_row(self.row_of[req_id], num_blocks)

    def replace_block_ids(self, req_id: str, updates: Sequence[tuple[int, int, int]]) -> None:
        """Points table slots at their copy-on-write copies: (group, index, new block id)."""
        self.block_table.replace(self.row_of[req_id], updates)

    def append_step_tokens(self, tokens: Mapping[str, Any], *, emitted: bool = False) -> None:
        """Appends a step's tokens to their requests' rows (a request preempted meanwhile
        has none): one sampled token each, or with ``emitted`` a list each (the tokens a
        speculative step emitted)."""
        row_of = self.row_of
        if emitted:
            for req_id, token_ids in tokens.items():
                if req_id in row_of:
                    self.append_token_ids(req_id, token_ids)
            return
        rows = list(map(row_of.get, tokens))
        values = list(tokens.values())
        if None in rows:
            keep = [i for i, row in enumerate(rows) if row is not None]
            rows = [rows[i] for i in keep]
            values = [values[i] for i in keep]
        self.append_sampled(rows, values)

    def remove_all(self) -> None:
        """Frees every row (nothing runs now)."""
        for req_id in list(self.row_of):
            self.remove_request(req_id)

    def append_sampled(self, rows: Sequence[int], token_ids: Sequence[int]) -> None:
        """Append one sampled token to each given row (one vectorised write per step)."""
        if not rows:
            return
        r = np.asarray(rows, np.intp)
        ends = self.num_token_ids[r]
        assert (ends < self.max_model_len).all(), "scheduler let a request pass max_model_len"
        self.token_ids[r, ends] = token_ids
        self.num_token_ids[r] = ends + 1

    def append_block_ids(self, req_id: str, block_ids: BlockIds) -> None:
        """Appends blocks to the request's table(s): a flat list or one list per group."""
        self.block_table.append_row(self.row_of[req_id], block_ids)

    def append_new_block_ids(self, new_block_ids: dict[str, BlockIds]) -> None:
        """append_block_ids for every request of a step's SchedulerOutput.new_block_ids.

        The common decode case (one group, one new block per request) is one vectorised
        write; anything else goes request by request.
        """
        table = self.block_table
        if table.num_groups == 1 and len(new_block_ids) > 1:
            ids = []
            for block_ids in new_block_ids.values():
                group = table.per_group(block_ids)[0]
                if len(group) != 1:
                    break
                ids.append(group[0])
            else:
                rows = np.fromiter(
                    map(self.row_of.__getitem__, new_block_ids), np.intp, len(new_block_ids)
                )
                table.append_one_per_row(rows, ids)
                return
        for req_id, block_ids in new_block_ids.items():
            self.append_block_ids(req_id, block_ids)

    # ----------------------------------------------------------------- step
    def prepare(
        self,
        seqs: Sequence[ScheduledSeq],
        block_copies: Sequence[tuple[int, int]] = (),
        spec_token_ids: dict[str, list[int]] | None = None,
    ) -> StepInput:
        """Pack the scheduled sequences, in order, and the step's block copies into a StepInput.

        spec_token_ids: with speculative decoding, req_id -> the drafts the step verifies
        (written with set_draft_tokens first; their count is in num_new_tokens).
        """
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
        # Batch-invariant steps never take the decode kernel: one attention path for all.
        decode_kernel = decode_only and not cfg.batch_invariant
        assert num_tokens <= cfg.max_num_batched_tokens, "scheduler broke the token budget"
        # The program is chosen by the token count; its sequence dimension holds
        # min(T, max_num_seqs) >= num_seqs rows (every sequence has a token).
        t_pad = bucket_for(num_tokens, cfg.token_buckets)
        s_pad = cfg.seq_bucket(t_pad)

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
        positions[:num_tokens] = pos
        # A token the host does not have yet (async scheduling: sampled by the step in
        # flight) is read on device from its row's last sample.
        token_rows = np.full(t_pad, -1, np.int32)
        if not self.num_spec_tokens:  # speculative steps are synchronous: all on the host
            token_rows[:num_tokens] = np.where(
                pos >= self.num_token_ids[row_of_token], row_of_token, -1
            )
        seq_lens = np.zeros(s_pad, np.int32)
        seq_lens[:num_seqs] = computed + num_new
        query_start_loc = np.full(s_pad + 1, num_tokens, np.int32)
        query_start_loc[0] = 0
        query_start_loc[1 : num_seqs + 1] = cu
        logits_indices = np.zeros(s_pad, np.int32)
        logits_indices[:num_seqs] = cu - 1
        spec = None
        if self.num_spec_tokens:
            spec, logits_indices = self._spec_input(
                req_ids, rows, cu, num_out, s_pad, spec_token_ids or {}
            )
        attention = AttentionMetadata(
            slot_mappings=self.block_table.slot_mappings(row_of_token, pos, t_pad),
            block_tables=self.block_table.step_tables(rows, computed, s_pad),
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            logits_indices=logits_indices,
            decode_only=decode_kernel,
            validate=cfg.validate,
            ragged_only=cfg.batch_invariant,
        )
        rows_sampling = self._rows_sampling(rows, s_pad)
        sampling = self._sampling(rows, num_out, seq_lens, rows_sampling)
        if spec is not None and sampling.history_lens is not None:
            # Position 0's history is the known tokens; position j adds drafts[:j].
            history_lens = seq_lens.copy()
            history_lens[:num_seqs] = self.num_token_ids[rows]
            sampling = sampling._replace(history_lens=history_lens)
        return StepInput(
            token_ids=token_ids,
            positions=positions,
            attention=attention,
            sampling=sampling,
            feed=TokenFeed(token_rows=token_rows, sample_rows=rows_sampling.sample_rows),
            copies=self._copies(block_copies),
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            spec=spec,
        )

    def _spec_input(
        self,
        req_ids: Sequence[str],
        rows: np.ndarray,
        cu: np.ndarray,
        num_out: np.ndarray,
        s_pad: int,
        spec_token_ids: dict[str, list[int]],
    ) -> tuple[SpecDecodeInput, np.ndarray]:
        """The drafts and the k + 1 logits rows per sequence of a speculative step.

        Sequence s with d drafts ends its tokens with [known, x_1 .. x_d], so its rows
        cu[s] - 1 - d .. cu[s] - 1 predict positions 0 .. d; later rows repeat the last.
        """
        k = self.num_spec_tokens
        k1 = k + 1
        num_seqs = len(rows)
        drafts = np.zeros((s_pad, k), np.int32)
        num_draft = np.zeros(s_pad, np.int32)
        for i, req_id in enumerate(req_ids):
            ids = spec_token_ids.get(req_id)
            if ids:
                drafts[i, : len(ids)] = ids
                num_draft[i] = len(ids)
        last = np.zeros(s_pad, np.int32)
        last[:num_seqs] = cu - 1
        j = np.arange(k1, dtype=np.int32)[None, :]
        first = last - num_draft
        logits_indices = np.minimum(first[:, None] + j, last[:, None]).reshape(-1)
        ban_positions = np.zeros(s_pad, np.int32)
        ban_positions[:num_seqs] = np.maximum(self.min_tokens[rows] - num_out, 0)
        spec = SpecDecodeInput(
            draft_token_ids=drafts, num_draft=num_draft, ban_positions=ban_positions
        )
        return spec, logits_indices.astype(np.int32)

    def _sampling(
        self,
        rows: np.ndarray,
        num_out: np.ndarray,
        seq_lens: np.ndarray,
        rows_sampling: _RowsSampling,
    ) -> SamplingMetadata:
        """The step's SamplingMetadata: the reused per-row arrays plus this step's counters,
        min_tokens bans and (only when some row uses one) penalties with the history."""
        num_seqs, s_pad = len(rows), len(seq_lens)

        def padded(buf: np.ndarray, fill) -> np.ndarray:
            out = np.full((s_pad, *buf.shape[1:]), fill, buf.dtype)
            out[:num_seqs] = buf[rows]
            return out

        counters = np.zeros(s_pad, np.int32)
        counters[:num_seqs] = num_out
        if rows_sampling.any_min_tokens:
            masked = padded(self.stop_ids, -1)
            active = np.zeros(s_pad, bool)
            active[:num_seqs] = num_out < self.min_tokens[rows]
            masked[~active] = -1  # speculative steps: ban_positions limits it further
        else:  # nothing banned: the same all -1 array every step
            masked = rows_sampling.no_masked
        penalties = {}
        if rows_sampling.any_penalty:
            penalties = dict(
                presence_penalty=padded(self.presence_penalty, 0.0),
                frequency_penalty=padded(self.frequency_penalty, 0.0),
                repetition_penalty=padded(self.repetition_penalty, 1.0),
                history_token_ids=padded(self.token_ids, 0),
                history_lens=seq_lens,
            )
        return SamplingMetadata(
            temperature=rows_sampling.temperature,
            top_k=rows_sampling.top_k,
            top_p=rows_sampling.top_p,
            min_p=rows_sampling.min_p,
            seeds=rows_sampling.seeds,
            counters=counters,
            masked_token_ids=masked,
            processed_logprobs=rows_sampling.processed_logprobs,
            **penalties,
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
            processed_logprobs=(
                padded(self.processed_logprobs, False)
                if self.processed_logprobs[rows].any()
                else None
            ),
        )
        self._rows_sampling_cache = (key, entry)
        return entry

    def _copies(self, pairs: Sequence[tuple[int, int]]) -> StepCopies:
        width = self.copies_width
        if len(pairs) > width:
            raise RuntimeError(
                f"{len(pairs)} block copies in one step exceed the bound of {width} "
                "(max_num_seqs x KV-cache groups): the block manager broke its invariant"
            )
        src = np.zeros(width, np.int32)
        dst = np.full(width, PAD_SLOT_ID, np.int32)
        if pairs:
            src[: len(pairs)], dst[: len(pairs)] = zip(*pairs)
        return StepCopies(src=src, dst=dst)

    def dummy_step_input(
        self, num_tokens: int, num_seqs: int, decode_only: bool = False
    ) -> StepInput:
        """An all-padding StepInput of one bucket (for warmup): writes and reads nothing."""
        s, t = num_seqs, num_tokens
        slot_mappings, block_tables = self.block_table.padding(t, s)
        attention = AttentionMetadata(
            slot_mappings=slot_mappings,
            block_tables=block_tables,
            seq_lens=np.zeros(s, np.int32),
            query_start_loc=np.zeros(s + 1, np.int32),
            logits_indices=np.zeros(s, np.int32),
            decode_only=decode_only,
            validate=self.config.validate,
            ragged_only=self.config.batch_invariant,
        )
        sampling = SamplingMetadata(
            temperature=np.zeros(s, np.float32),
            top_k=np.zeros(s, np.int32),
            top_p=np.ones(s, np.float32),
            min_p=np.zeros(s, np.float32),
            seeds=np.zeros(s, np.uint32),
            counters=np.zeros(s, np.int32),
            masked_token_ids=np.full((s, self.stop_ids.shape[1]), -1, np.int32),
        )
        feed = TokenFeed(
            token_rows=np.full(t, -1, np.int32),
            sample_rows=np.full(s, len(self.req_of_row), np.int32),
        )
        spec = None
        if self.num_spec_tokens:
            k = self.num_spec_tokens
            spec = SpecDecodeInput(
                draft_token_ids=np.zeros((s, k), np.int32),
                num_draft=np.zeros(s, np.int32),
                ban_positions=np.zeros(s, np.int32),
            )
            attention = dataclasses.replace(
                attention, logits_indices=np.zeros(s * (k + 1), np.int32)
            )
        return StepInput(
            token_ids=np.zeros(t, np.int32),
            positions=np.zeros(t, np.int32),
            attention=attention,
            sampling=sampling,
            feed=feed,
            copies=self._copies(()),
            num_tokens=0,
            num_seqs=0,
            spec=spec,
        )
