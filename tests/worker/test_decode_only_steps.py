"""InputBatch marks decode-only steps and knows every bucket they can land in."""

from __future__ import annotations

from paged_jax.config import EngineConfig
from paged_jax.core.scheduler_output import ScheduledSeq
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.input_batch import InputBatch, decode_step_shapes


def _batch() -> InputBatch:
    cfg = EngineConfig(block_size=4, max_num_seqs=20, max_num_batched_tokens=64, max_model_len=32)
    batch = InputBatch(cfg)
    for i, n in enumerate((5, 8, 3)):
        batch.add_request(
            f"r{i}",
            list(range(1, n + 1)),
            [1 + 3 * i, 2 + 3 * i, 3 + 3 * i],
            SamplingParams(),
            seed=0,
        )
    return batch


def _seq(req_id: str, computed: int, new: int) -> ScheduledSeq:
    return ScheduledSeq(
        req_id=req_id, num_computed_tokens=computed, num_new_tokens=new, num_output_tokens=0
    )


def test_all_single_token_rows_make_a_decode_only_step():
    batch = _batch()
    step = batch.prepare([_seq("r0", 4, 1), _seq("r1", 7, 1), _seq("r2", 2, 1)])
    assert step.attention.decode_only
    assert step.attention.query_start_loc.tolist()[:5] == [0, 1, 2, 3, 3]


def test_a_step_with_a_prefill_chunk_is_not_decode_only():
    batch = _batch()
    step = batch.prepare([_seq("r0", 0, 5), _seq("r1", 7, 1)])
    assert not step.attention.decode_only


def test_decode_step_shapes_cover_every_decode_batch_size():
    cfg = EngineConfig(max_num_seqs=20, max_num_batched_tokens=64, max_model_len=32)
    # n decodes: n tokens in the token buckets (16, 64); each bucket's sequence dimension
    # holds min(T, 20) rows in the seq buckets (8, 16, 20).
    assert decode_step_shapes(cfg) == [(16, 16), (64, 20)]
    assert set(decode_step_shapes(cfg)) <= set(cfg.step_shapes())
    assert not _batch().dummy_step_input(16, 8).attention.decode_only
    assert _batch().dummy_step_input(16, 8, decode_only=True).attention.decode_only
