"""InputBatch packs scheduled sequences into a bucket-padded StepInput."""

from __future__ import annotations

import numpy as np

from paged_jax.config import EngineConfig
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.input_batch import PAD_SLOT_ID, InputBatch, ScheduledSeq


def make_batch() -> InputBatch:
    cfg = EngineConfig(
        block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=16, num_kv_blocks=20
    )
    return InputBatch(cfg)


def test_prefill_chunk_and_decode_pack_into_one_step():
    batch = make_batch()
    greedy = SamplingParams(temperature=0.0)
    # Request a: 6-token prompt, first 4 already computed, blocks [7, 3].
    batch.add_request("a", [10, 11, 12, 13, 14, 15], [7, 3], greedy, seed=1)
    # Request b: 3-token prompt + 1 output token, 3 computed; decode the 4th.
    batch.add_request("b", [20, 21, 22], [5], SamplingParams(temperature=0.8, top_k=5), seed=2)
    batch.append_token_ids("b", [23])
    step = batch.prepare(
        [
            ScheduledSeq("a", num_computed_tokens=4, num_new_tokens=2, num_output_tokens=0),
            ScheduledSeq("b", num_computed_tokens=3, num_new_tokens=1, num_output_tokens=1),
        ]
    )
    assert step.bucket == (16, 8)
    assert (step.num_tokens, step.num_seqs) == (3, 2)
    np.testing.assert_array_equal(step.token_ids[:3], [14, 15, 23])
    np.testing.assert_array_equal(step.positions[:3], [4, 5, 3])
    # pos 4,5 of a live in its 2nd block (id 3): slots 12, 13; pos 3 of b in block 5: slot 23.
    np.testing.assert_array_equal(step.attention.slot_mappings[0][:3], [12, 13, 23])
    assert (step.attention.slot_mappings[0][3:] == PAD_SLOT_ID).all()
    assert (step.positions[3:] == 0).all()
    np.testing.assert_array_equal(step.attention.seq_lens[:2], [6, 4])
    assert (step.attention.seq_lens[2:] == 0).all()
    np.testing.assert_array_equal(step.attention.query_start_loc, [0, 2, 3, 3, 3, 3, 3, 3, 3])
    np.testing.assert_array_equal(step.attention.logits_indices[:2], [1, 2])
    np.testing.assert_array_equal(step.attention.block_tables[0][0, :3], [7, 3, 0])
    np.testing.assert_array_equal(step.attention.block_tables[0][1, :2], [5, 0])
    assert (step.attention.block_tables[0][2:] == 0).all()
    np.testing.assert_allclose(step.sampling.temperature[:2], [0.0, 0.8])
    np.testing.assert_array_equal(step.sampling.top_k[:2], [0, 5])
    np.testing.assert_array_equal(step.sampling.seeds[:2], [1, 2])
    np.testing.assert_array_equal(step.sampling.counters[:2], [0, 1])


def test_rows_are_reused_and_block_tables_append():
    batch = make_batch()
    p = SamplingParams()
    batch.add_request("a", [1, 2, 3, 4], [2], p, seed=0)
    batch.add_request("b", [5], [4], p, seed=0)
    batch.remove_request("a")
    batch.add_request("c", [9, 9], [6], p, seed=0)
    assert batch.row_of == {"c": 0, "b": 1}
    batch.append_token_ids("c", [8, 7, 6])
    batch.append_block_ids("c", [11])
    step = batch.prepare([ScheduledSeq("c", 2, 3, 1)])
    np.testing.assert_array_equal(step.token_ids[:3], [8, 7, 6])
    # positions 2, 3 in block 6 (slots 26, 27); position 4 in block 11 (slot 44).
    np.testing.assert_array_equal(step.attention.slot_mappings[0][:3], [26, 27, 44])
    np.testing.assert_array_equal(step.attention.block_tables[0][0, :3], [6, 11, 0])


def test_min_tokens_masks_stop_ids_until_reached():
    batch = make_batch()
    p = SamplingParams(min_tokens=2, max_tokens=5, stop_token_ids=[9])
    batch.add_request("a", [1, 2], [1], p, seed=0, min_tokens_stop_ids=[9, 2, 9])
    step = batch.prepare([ScheduledSeq("a", 0, 2, 0)])
    np.testing.assert_array_equal(step.sampling.masked_token_ids[0, :3], [9, 2, -1])
    assert (step.sampling.masked_token_ids[1:] == -1).all()
    batch.append_token_ids("a", [5, 6])
    step = batch.prepare([ScheduledSeq("a", 3, 1, 2)])
    assert (step.sampling.masked_token_ids == -1).all()


def test_dummy_step_input_is_pure_padding():
    batch = make_batch()
    step = batch.dummy_step_input(32, 8)
    assert step.bucket == (32, 8)
    assert (step.attention.slot_mappings[0] == PAD_SLOT_ID).all()
    assert (step.attention.seq_lens == 0).all()


def test_copies_ride_in_a_fixed_width_padded_array_and_replace_table_slots():
    batch = make_batch()
    greedy = SamplingParams(temperature=0.0)
    batch.add_request("a", [1, 2, 3, 4, 5, 6], [7, 3], greedy, seed=1)
    batch.replace_block_ids("a", [(0, 1, 9)])  # slot 1 now names the copy, block 9
    seqs = [ScheduledSeq("a", num_computed_tokens=5, num_new_tokens=1, num_output_tokens=0)]
    step = batch.prepare(seqs, [(3, 9)])
    np.testing.assert_array_equal(step.attention.block_tables[0][0, :3], [7, 9, 0])
    np.testing.assert_array_equal(
        step.attention.slot_mappings[0][:1], [9 * 4 + 1]
    )  # written into the copy
    assert step.copies.src.shape == step.copies.dst.shape == (8,)  # max_num_seqs: one shape
    np.testing.assert_array_equal(step.copies.src[:1], [3])
    np.testing.assert_array_equal(step.copies.dst, [9] + [PAD_SLOT_ID] * 7)
    plain = batch.prepare(seqs)
    assert (plain.copies.dst == PAD_SLOT_ID).all()
    dummy = batch.dummy_step_input(16, 8)
    assert dummy.copies.dst.shape == (8,) and (dummy.copies.dst == PAD_SLOT_ID).all()
