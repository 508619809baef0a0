"""The draft proposer's programs: proposals equal the draft model's own greedy continuation
(transformers' dense generate).

The draft's paged cache is addressed by hand-made (permuted) block tables, as the target's
scheduler would hand them over: a prompt catch-up, k proposals from the next token, then
a step after a partial rejection whose stale lookahead KV must not change the next
proposal. Proposals go through DraftModelProposer.propose (the Proposer contract), so
draft_probs is checked in its row-indexed layout too.
"""

from __future__ import annotations

import numpy as np

from paged_jax.config import EngineConfig
from paged_jax.core.scheduler_output import ScheduledSeq
from paged_jax.sampling_params import SamplingParams

K = 3
BLOCK = 4
MAX_LEN = 48


def _assert_continues(got: np.ndarray, ref: list[int]) -> None:
    """The draft's k tokens equal transformers' greedy ones (which stop after an EOS)."""
    assert len(ref) >= 1 and got.tolist()[: len(ref)] == ref, (got.tolist(), ref)


def _count_compiles() -> list[float]:
    """A list that every XLA backend compile in this process appends to from now on (the
    engine's counter needs a Runner; this test has none)."""
    import jax

    seen: list[float] = []

    def on_event(name: str, duration: float, **_kwargs) -> None:
        if name == "/jax/core/compile/backend_compile_duration":
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    return seen


def _batch(step, rows, token_lists, accepted, block_ids, temperature):
    from paged_jax.spec_decode.proposer import ProposalBatch, ProposalSampling

    n = len(rows)
    return ProposalBatch(
        step_input=step,
        req_ids=[f"r{i}" for i in range(n)],
        rows=np.asarray(rows, np.int32),
        token_ids=token_lists,
        next_token_ids=np.array([t[-1] for t in token_lists], np.int32),
        next_positions=np.array([len(t) - 1 for t in token_lists], np.int32),
        num_accepted=np.asarray(accepted, np.int32),
        block_ids=[(ids,) for ids in block_ids],
        sampling=ProposalSampling(
            temperature=np.asarray(temperature, np.float32),
            top_k=np.zeros(n, np.int32),
            top_p=np.ones(n, np.float32),
            min_p=np.zeros(n, np.float32),
            seeds=np.arange(n, dtype=np.uint32) + 11,
            counters=np.zeros(n, np.int32),
        ),
    )


def test_draft_proposals_equal_greedy_after_catch_up_and_rejection(tiny_hf_checkpoint, hf_greedy):
    from paged_jax.spec_decode.draft_model import DraftModelProposer
    from paged_jax.spec_decode.proposer import ProposerContext, SpeculativeConfig
    from paged_jax.worker.input_batch import InputBatch

    path = tiny_hf_checkpoint("llama", seed=3)
    config = EngineConfig(
        block_size=BLOCK,
        num_kv_blocks=40,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=MAX_LEN,
        attention_backend="reference",
    )
    spec = SpeculativeConfig(model=str(path), num_speculative_tokens=K)
    proposer = DraftModelProposer(spec, ProposerContext(config, vocab_size=128))
    proposer.initialize(config.num_kv_blocks)
    proposer.warmup()
    compiles = _count_compiles()

    batch = InputBatch(config)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, size=n).tolist() for n in (5, 9)]
    # Permuted block ids, enough for prompt + 2 steps of k + 1 tokens + lookahead.
    ids = rng.permutation(np.arange(1, 40)).tolist()
    blocks = [ids[i * 8 : (i + 1) * 8] for i in range(2)]
    for i, prompt in enumerate(prompts):
        batch.add_request(f"r{i}", prompt, blocks[i], SamplingParams(), 0)
    step = batch.prepare([ScheduledSeq(f"r{i}", 0, len(p), 0) for i, p in enumerate(prompts)])

    # The target's first sampled token b (any id; here a fixed one per row).
    firsts = [7, 11]
    lists = [p + [b] for p, b in zip(prompts, firsts)]
    got = proposer.propose(_batch(step, [0, 1], lists, [0, 0], blocks, [0.0, 0.0]))
    assert got.num_tokens.tolist() == [K, K]
    probs = np.asarray(got.draft_probs)  # f32[max_num_seqs, k, V] by input-batch row
    assert probs.shape == (config.max_num_seqs, K, 128)
    np.testing.assert_allclose(probs[:2].sum(-1), 1.0, rtol=1e-5)
    for i in range(2):
        _assert_continues(got.token_ids[i], hf_greedy(path, lists[i], K))
        assert (probs[i, np.arange(K), got.token_ids[i]] == 1.0).all(), "greedy q is one-hot"

    # Verification step: tokens [b d1 .. dk] at positions P .. P+k; the target accepts
    # one draft token and corrects the next (c), so positions past P+1 hold stale KV.
    for i in range(2):
        batch.append_token_ids(f"r{i}", [firsts[i], *got.token_ids[i].tolist()])
    step = batch.prepare([ScheduledSeq(f"r{i}", len(p), K + 1, 1) for i, p in enumerate(prompts)])
    corrections = [5, 9]
    lists = [lists[i] + [int(got.token_ids[i][0]), corrections[i]] for i in range(2)]
    # Row 1 samples (temperature 1): its q is a full distribution and its tokens come
    # from it; the proposal is the same on a second call (keys by seed and position).
    again = _batch(step, [0, 1], lists, [1, 1], blocks, [0.0, 1.0])
    got2 = proposer.propose(again)
    _assert_continues(got2.token_ids[0], hf_greedy(path, lists[0], K))
    q = np.asarray(got2.draft_probs)[1]
    assert (q[np.arange(K), got2.token_ids[1]] > 0).all() and (q > 0).sum() > K
    assert proposer.propose(again).token_ids.tolist() == got2.token_ids.tolist()
    assert len(compiles) == 0, "a draft call compiled after warm-up"

    # Near max_model_len the proposals stop at the last position.
    near = [list(range(3, 3 + MAX_LEN - 1))]
    short = proposer.propose(_batch(None, [2], near, [0], [blocks[0]], [0.0]))
    assert short.num_tokens.tolist() == [1]
