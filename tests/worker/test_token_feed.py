"""The device token feed of async scheduling: placeholder tokens read per-row samples."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from paged_jax.config import EngineConfig
from paged_jax.core.scheduler_output import ScheduledSeq
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.input_batch import InputBatch
from paged_jax.worker.runner import feed_tokens, init_row_tokens, record_tokens


def test_feed_and_record_by_row():
    rows = init_row_tokens(4)
    # Sequences in rows 2 and 0 sample 11 and 22; the padded sequence (row 4) is dropped.
    rows = record_tokens(rows, jnp.array([11, 22, 99]), jnp.array([2, 0, 4]))
    np.testing.assert_array_equal(rows, [22, 0, 11, 0])
    host = jnp.array([5, 6, 7, 8])
    fed = feed_tokens(rows, host, jnp.array([-1, 2, -1, 0]))
    np.testing.assert_array_equal(fed, [5, 11, 7, 22])


def test_input_batch_marks_only_tokens_the_host_lacks():
    cfg = EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32)
    batch = InputBatch(cfg)
    params = SamplingParams(temperature=0)
    batch.add_request("a", [1, 2, 3], [1], params, seed=0)  # row 0
    batch.add_request("b", [4, 5], [2], params, seed=0)  # row 1
    # "a" decodes its in-flight 4th token (position 3, not on the host); "b" prefills.
    step = batch.prepare([ScheduledSeq("a", 3, 1, 1), ScheduledSeq("b", 0, 2, 0)])
    np.testing.assert_array_equal(step.feed.token_rows[:3], [0, -1, -1])
    assert (step.feed.token_rows[3:] == -1).all()
    np.testing.assert_array_equal(step.feed.sample_rows[:2], [0, 1])
    assert (step.feed.sample_rows[2:] == 4).all()
    batch.append_token_ids("a", [9])  # the token arrived: now a host token
    step = batch.prepare([ScheduledSeq("a", 3, 1, 1)])
    assert step.token_ids[0] == 9 and step.feed.token_rows[0] == -1
