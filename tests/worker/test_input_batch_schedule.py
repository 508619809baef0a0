"""InputBatch's schedule-facing methods (host only): apply_schedule mirrors a
SchedulerOutput's row changes, append_step_tokens files a step's tokens by request,
remove_all frees every row (a rolled-back step)."""

from __future__ import annotations

import types

import numpy as np

from paged_jax.config import EngineConfig
from paged_jax.core.scheduler_output import NewRow, SchedulerOutput
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.input_batch import InputBatch


def make_batch() -> InputBatch:
    cfg = EngineConfig(
        block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=16, num_kv_blocks=20
    )
    return InputBatch(cfg)


def tokens_of(batch: InputBatch, req_id: str) -> list[int]:
    row = batch.row_of[req_id]
    return batch.token_ids[row, : batch.num_token_ids[row]].tolist()


def test_apply_schedule_then_step_tokens_then_remove_all():
    batch = make_batch()
    plain, min_tokens = SamplingParams(), SamplingParams(min_tokens=2, stop_token_ids=[9])
    requests = {
        "a": types.SimpleNamespace(sampling_params=plain),
        "b": types.SimpleNamespace(sampling_params=min_tokens),
        "gone": types.SimpleNamespace(sampling_params=plain),
    }
    batch.add_request("gone", [1], ([3],), plain, seed=0)
    out = SchedulerOutput(
        removed_req_ids=["gone", "never-had-a-row"],
        new_rows=[NewRow("a", [1, 2], ([4],), 0), NewRow("b", [5], ([6],), 0)],
        new_block_ids={"a": ([7],)},
    )
    batch.apply_schedule(out, requests, {"a": 11, "b": 12}, eos_token_ids=(2, 9))
    assert set(batch.row_of) == {"a", "b"}
    row_a, row_b = batch.row_of["a"], batch.row_of["b"]
    assert (batch.seeds[row_a], batch.seeds[row_b]) == (11, 12)
    # min_tokens bans its stop ids and EOS, each once; the plain request bans none.
    assert batch.stop_ids[row_b, :3].tolist() == [9, 2, -1]
    assert (batch.stop_ids[row_a] == -1).all()
    table, num_blocks = batch.block_table.tables[0], batch.block_table.num_blocks[0]
    assert table[row_a, : num_blocks[row_a]].tolist() == [4, 7]  # its row, then its new block
    assert table[row_b, : num_blocks[row_b]].tolist() == [6]

    # One sampled token each; a request without a row (preempted meanwhile) is skipped.
    batch.append_step_tokens({"a": 3, "preempted": 8, "b": 4})
    assert tokens_of(batch, "a") == [1, 2, 3] and tokens_of(batch, "b") == [5, 4]
    # Emitted lists (speculative decoding).
    batch.append_step_tokens({"a": [5, 6], "preempted": [1]}, emitted=True)
    assert tokens_of(batch, "a") == [1, 2, 3, 5, 6]

    batch.remove_all()
    assert batch.row_of == {} and batch.req_of_row == [None] * len(batch.req_of_row)
    np.testing.assert_array_equal(num_blocks, 0)
