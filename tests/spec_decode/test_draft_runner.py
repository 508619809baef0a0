"""DraftRunner's programs: proposals equal the draft model's own greedy continuation
(transformers' dense generate).

The draft's paged cache is addressed by hand-made (permuted) block tables, as the target's
scheduler would hand them over: a prompt catch-up, k proposals from the next token, then
a step after a partial rejection whose stale lookahead KV must not change the next
proposal.
"""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.config import EngineConfig
from paged_jax.core.scheduler_output import ScheduledSeq
from paged_jax.sampling_params import SamplingParams

K = 3
BLOCK = 4


def _assert_continues(got: np.ndarray, ref: list[int]) -> None:
    """The draft's k tokens equal transformers' greedy ones (which stop after an EOS)."""
    assert len(ref) >= 1 and got.tolist()[: len(ref)] == ref, (got.tolist(), ref)


def _propose(runner, batch, rows_tokens, positions):
    """propose() for the batch's rows 0..n-1 with greedy settings; host token ids i32[n, K]."""
    from paged_jax.spec_decode.draft_runner import DraftSampling

    s = runner.num_rows
    n = len(rows_tokens)
    tokens = np.zeros(s, np.int32)
    tokens[:n] = rows_tokens
    pos = np.zeros(s, np.int32)
    pos[:n] = positions
    table = np.zeros((s, batch.config.max_blocks_per_seq), np.int32)
    table[:n] = batch.block_table.tables[0][:n]
    active = np.arange(s) < n
    sampling = DraftSampling(
        np.zeros(s, np.float32),
        np.zeros(s, np.int32),
        np.ones(s, np.float32),
        np.zeros(s, np.float32),
        np.zeros(s, np.uint32),
    )
    proposal = runner.propose(tokens, pos, table, active, sampling)
    ids = np.asarray(proposal.token_ids)
    probs = np.asarray(proposal.probs)
    assert (ids[n:] == 0).all(), "rows without a proposal must propose zeros"
    np.testing.assert_allclose(probs[:n].sum(-1), 1.0, rtol=1e-5)
    return ids[:n]


@pytest.mark.parametrize("family", ["llama"])
def test_draft_programs_equal_dense_greedy_after_catch_up_and_rejection(
    tiny_hf_checkpoint, hf_greedy, family
):
    from paged_jax.models import load_model
    from paged_jax.spec_decode.draft_runner import DraftRunner
    from paged_jax.worker.input_batch import InputBatch

    path = tiny_hf_checkpoint(family, seed=3)
    model = load_model(path, attention_backend="reference")
    config = EngineConfig(
        block_size=BLOCK,
        num_kv_blocks=40,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=48,
        attention_backend="reference",
    )
    runner = DraftRunner(model, config, config.num_kv_blocks, K)
    batch = InputBatch(config)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, size=n).tolist() for n in (5, 9)]
    # Permuted block ids, enough for prompt + 2 steps of k+1 tokens + lookahead.
    ids = rng.permutation(np.arange(1, 40)).tolist()
    for i, prompt in enumerate(prompts):
        batch.add_request(f"r{i}", prompt, ids[i * 8 : (i + 1) * 8], SamplingParams(), 0)
    step = batch.prepare([ScheduledSeq(f"r{i}", 0, len(p), 0) for i, p in enumerate(prompts)])
    runner.warmup([batch.dummy_step_input(*step.bucket)])
    compiles = runner.num_compiles
    runner.catch_up(step)

    # The target's first sampled token b (any id; here a fixed one per row).
    firsts = [7, 11]
    got = _propose(runner, batch, firsts, [len(p) for p in prompts])
    for i, prompt in enumerate(prompts):
        _assert_continues(got[i], hf_greedy(path, prompt + [firsts[i]], K))

    # Verification step: tokens [b d1 .. dk] at positions P .. P+k; the target accepts
    # one draft token and corrects the next (c), so positions past P+1 hold stale KV.
    for i in range(len(prompts)):
        batch.append_token_ids(f"r{i}", [firsts[i], *got[i].tolist()])
    step = batch.prepare([ScheduledSeq(f"r{i}", len(p), K + 1, 1) for i, p in enumerate(prompts)])
    runner.catch_up(step)
    corrections = [5, 9]
    got2 = _propose(runner, batch, corrections, [len(p) + 2 for p in prompts])
    for i, prompt in enumerate(prompts):
        context = prompt + [firsts[i], int(got[i][0]), corrections[i]]
        _assert_continues(got2[i], hf_greedy(path, context, K))
    assert runner.num_compiles == compiles, "a draft call compiled after warm-up"
