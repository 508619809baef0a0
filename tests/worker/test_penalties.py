"""Presence, frequency and repetition penalties on device, against transformers and by hand."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.config import EngineConfig
from paged_jax.core.scheduler_output import ScheduledSeq
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.input_batch import InputBatch
from paged_jax.worker.sampling import (
    SamplingMetadata,
    apply_penalties,
    sample,
    with_fed_last_token,
)


def _penalize(logits, history, lens, num_out, presence=0.0, frequency=0.0, repetition=1.0):
    s = logits.shape[0]
    return np.asarray(
        apply_penalties(
            jnp.asarray(logits, jnp.float32),
            jnp.asarray(history, jnp.int32),
            jnp.asarray(lens, jnp.int32),
            jnp.asarray(num_out, jnp.int32),
            jnp.full(s, presence, jnp.float32),
            jnp.full(s, frequency, jnp.float32),
            jnp.full(s, repetition, jnp.float32),
        )
    )


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(0)
    vocab, width = 40, 16
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    lens = [5, 16, 9]
    history = rng.integers(0, vocab, size=(3, width))
    history[0, 1] = history[0, 3]  # a repeated token is penalised once, not twice
    history[2, 9:] = 7  # stale ids past the row's length must not count
    got = _penalize(logits, history, lens, num_out=[2, 0, 4], repetition=penalty)
    proc = RepetitionPenaltyLogitsProcessor(penalty)
    for r, n in enumerate(lens):
        ids = torch.tensor(history[r : r + 1, :n], dtype=torch.long)
        want = proc(ids, torch.tensor(logits[r : r + 1])).numpy()[0]
        np.testing.assert_allclose(got[r], want, rtol=1e-6)


def test_frequency_and_presence_count_output_tokens_only():
    vocab = 6
    logits = np.zeros((1, vocab), np.float32)
    # prompt [1, 1, 2], output [3, 3, 3, 1]; position 7 is past the length.
    history = np.asarray([[1, 1, 2, 3, 3, 3, 1, 5]])
    got = _penalize(logits, history, [7], [4], presence=0.5, frequency=0.25)
    # token 3: 3 output occurrences -> -(0.5 + 3 * 0.25); token 1: once in the output
    # (prompt copies do not count) -> -(0.5 + 0.25); 2 is prompt-only, 5 is stale.
    np.testing.assert_allclose(got[0], [0.0, -0.75, 0.0, -1.25, 0.0, 0.0])
    neg = _penalize(logits + 1.0, history, [7], [4], presence=-1.0, frequency=-2.0)
    np.testing.assert_allclose(neg[0], [1.0, 4.0, 1.0, 8.0, 1.0, 1.0])


def test_sampler_applies_penalties_before_greedy_and_leaves_raw_logprobs():
    logits = jnp.asarray([[0.0, 3.0, 2.0, 1.0], [0.0, 3.0, 2.0, 1.0]])
    history = np.asarray([[1, 1, 0, 0], [1, 1, 0, 0]], np.int32)
    meta = SamplingMetadata(
        temperature=jnp.zeros(2),
        top_k=jnp.zeros(2, jnp.int32),
        top_p=jnp.ones(2),
        min_p=jnp.zeros(2),
        seeds=jnp.zeros(2, jnp.uint32),
        counters=jnp.asarray([1, 1], jnp.int32),
        masked_token_ids=jnp.full((2, 1), -1, jnp.int32),
        presence_penalty=jnp.asarray([0.0, 0.0]),
        frequency_penalty=jnp.asarray([0.0, 0.0]),
        repetition_penalty=jnp.asarray([2.0, 1.0]),  # row 1: penalties off
        history_token_ids=jnp.asarray(history),
        history_lens=jnp.asarray([2, 2], jnp.int32),
    )
    out = sample(logits, meta)
    # Row 0: 3.0 / 2 = 1.5 < 2.0, so token 2 wins; row 1 keeps the argmax.
    np.testing.assert_array_equal(np.asarray(out.token_ids), [2, 1])
    raw = np.asarray(jnp.log(jnp.exp(logits[0]) / jnp.exp(logits[0]).sum()))
    np.testing.assert_allclose(np.asarray(out.logprobs)[0], raw[2], rtol=1e-5)


def test_input_batch_sends_a_history_only_when_a_row_uses_penalties():
    cfg = EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=32)
    batch = InputBatch(cfg)
    batch.add_request("a", [5, 6, 7], [1], SamplingParams(), seed=0)
    seq = ScheduledSeq("a", num_computed_tokens=0, num_new_tokens=3, num_output_tokens=0)
    assert batch.prepare([seq]).sampling.history_token_ids is None
    batch.add_request("b", [8, 9], [2], SamplingParams(repetition_penalty=1.2), seed=0)
    seq_b = ScheduledSeq("b", num_computed_tokens=0, num_new_tokens=2, num_output_tokens=0)
    step = batch.prepare([seq, seq_b])
    assert step.sampling.history_token_ids.shape == (8, 32)
    np.testing.assert_array_equal(step.sampling.history_token_ids[1, :2], [8, 9])
    np.testing.assert_allclose(step.sampling.repetition_penalty[:3], [1.0, 1.2, 1.0], rtol=1e-6)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("presence_penalty", 2.5, r"presence_penalty=2.5 must be in \[-2, 2\]"),
        ("frequency_penalty", "x", r"frequency_penalty='x' must be a number"),
        ("repetition_penalty", 0.0, r"repetition_penalty=0.0 must be a number > 0"),
        ("include_stop_str_in_output", 1, r"include_stop_str_in_output=1 must be a bool"),
        ("skip_special_tokens", None, r"skip_special_tokens=None must be a bool"),
    ],
)
def test_bad_penalty_values_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


def test_history_last_position_takes_the_fed_token():
    # Row 0 decodes (its newest token 9 was unknown to the host: stale 0 in the history);
    # row 1 is padding (length 0) and must stay untouched.
    history = jnp.asarray([[4, 5, 0, 0], [1, 1, 1, 1]], jnp.int32)
    meta = SamplingMetadata(
        temperature=jnp.zeros(2),
        top_k=jnp.zeros(2, jnp.int32),
        top_p=jnp.ones(2),
        min_p=jnp.zeros(2),
        seeds=jnp.zeros(2, jnp.uint32),
        counters=jnp.asarray([1, 0], jnp.int32),
        masked_token_ids=jnp.full((2, 1), -1, jnp.int32),
        history_token_ids=history,
        history_lens=jnp.asarray([3, 0], jnp.int32),
    )
    fed = with_fed_last_token(meta, jnp.asarray([9, 3, 3], jnp.int32), jnp.asarray([0, 0]))
    np.testing.assert_array_equal(np.asarray(fed.history_token_ids), [[4, 5, 9, 0], [1, 1, 1, 1]])
