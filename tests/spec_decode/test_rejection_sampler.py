"""The rejection sampler on synthetic target/draft distributions: exact greedy, and
emitted-token distributions equal to the target's (chi-square over seeded draws)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from paged_jax.worker.rejection_sampler import filtered_probs, rejection_sample, sample_speculative
from paged_jax.worker.sampling import sample
from paged_jax.worker.step_input import SamplingMetadata, SpecDecodeInput

VOCAB = 8
K = 2
# Fixed seeds make every run identical; the threshold makes a false failure of a fair
# sampler a 1-in-10^6 event per check for random seeds.
P_VALUE_FLOOR = 1e-6


def _keys(seeds, counters, k1):
    def one(s, c):
        return jax.vmap(lambda j: jax.random.fold_in(jax.random.PRNGKey(s), c + j))(jnp.arange(k1))

    return jax.vmap(one)(jnp.asarray(seeds, jnp.uint32), jnp.asarray(counters, jnp.int32))


def _settings(n, temperature=1.0):
    return (
        jnp.full(n, temperature, jnp.float32),
        jnp.zeros(n, jnp.int32),
        jnp.ones(n, jnp.float32),
        jnp.zeros(n, jnp.float32),
    )


def _reference_greedy(logits, drafts, num_draft):
    """Longest prefix of drafts equal to the target's argmax, then the argmax there."""
    out = []
    for s in range(logits.shape[0]):
        best = logits[s].argmax(-1)
        emitted = []
        for j in range(num_draft[s]):
            if drafts[s, j] != best[j]:
                break
            emitted.append(int(drafts[s, j]))
        emitted.append(int(best[len(emitted)]))
        out.append(emitted)
    return out


def _chi_square_p(observed_tokens, probs):
    counts = np.bincount(observed_tokens, minlength=VOCAB).astype(np.float64)
    probs = np.asarray(probs, np.float64)
    expected = probs / probs.sum() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of zero target probability was emitted"
    return stats.chisquare(counts[keep], expected[keep]).pvalue


@pytest.mark.parametrize("draft", ["probs", "point_mass"])
def test_emitted_distribution_matches_target(draft):
    """Position 0 (always emitted) follows p_0, and position 1 given an accepted x_0
    follows p_1, with drafts drawn from a q that differs from p. The point-mass batch
    also carries greedy rows, checked against a plain-Python reference."""
    n = 4000
    rng = np.random.default_rng(1)
    target_logits = rng.normal(size=(K + 1, VOCAB)).astype(np.float32) * 1.5
    draft_logits = rng.normal(size=(K, VOCAB)).astype(np.float32)
    temperature, top_k, top_p, min_p = 0.8, 6, 0.95, 0.0
    settings = (
        jnp.full(n, temperature, jnp.float32),
        jnp.full(n, top_k, jnp.int32),
        jnp.full(n, top_p, jnp.float32),
        jnp.full(n, min_p, jnp.float32),
    )
    p = np.stack(
        [
            np.asarray(
                filtered_probs(jnp.asarray(target_logits[j]), temperature, top_k, top_p, min_p)
            )
            for j in range(K + 1)
        ]
    )
    q = np.exp(draft_logits) / np.exp(draft_logits).sum(-1, keepdims=True)
    if draft == "probs":
        drafts = np.stack([rng.choice(VOCAB, size=n, p=q[j]) for j in range(K)], axis=1)
        draft_probs = jnp.asarray(np.broadcast_to(q, (n, K, VOCAB)).copy())
    else:  # a deterministic proposer: the same tokens everywhere
        drafts = np.tile(np.array([[int(p[0].argmin() if p[0].min() > 0 else 1), 2]]), (n, 1))
        drafts[:, 0] = int(np.argsort(p[0])[-2])  # a likely but not the likeliest token
        draft_probs = None
    logits = np.broadcast_to(target_logits, (n, K + 1, VOCAB)).copy()
    num_draft = np.full(n, K, np.int32)
    g = 64 if draft == "point_mass" else 0  # greedy rows after the sampled ones
    if g:
        greedy_logits = rng.normal(size=(g, K + 1, VOCAB)).astype(np.float32)
        best = greedy_logits.argmax(-1)
        greedy_drafts = best[:, :K].copy()
        cut = rng.integers(0, K + 1, g)
        for s in range(g):  # drafts that match the argmax for a random prefix
            if cut[s] < K:
                greedy_drafts[s, cut[s]] = (best[s, cut[s]] + 1) % VOCAB
        greedy_num = rng.integers(0, K + 1, g).astype(np.int32)
        logits = np.concatenate([logits, greedy_logits])
        drafts = np.concatenate([drafts, greedy_drafts])
        num_draft = np.concatenate([num_draft, greedy_num])
        settings = tuple(
            jnp.concatenate([x, jnp.full(g, 0 if i != 2 else 1, x.dtype)])
            for i, x in enumerate(settings)
        )
    tokens, emitted = jax.jit(rejection_sample)(
        jnp.asarray(logits),
        jnp.asarray(drafts, jnp.int32),
        jnp.asarray(num_draft),
        draft_probs,
        *settings,
        _keys(np.arange(n + g) + 1000, np.zeros(n + g), K + 1),
    )
    tokens, emitted = np.asarray(tokens), np.asarray(emitted)
    if g:
        want = _reference_greedy(logits[n:], drafts[n:], num_draft[n:])
        assert [tokens[n + s, : emitted[n + s]].tolist() for s in range(g)] == want
        tokens, emitted, drafts = tokens[:n], emitted[:n], drafts[:n]
    assert _chi_square_p(tokens[:, 0], p[0]) > P_VALUE_FLOOR
    accepted = (emitted >= 2) & (tokens[:, 0] == drafts[:, 0])
    assert accepted.sum() > 300
    assert _chi_square_p(tokens[accepted, 1], p[1]) > P_VALUE_FLOOR
    # The same check rejects a sampler that would emit the drafts' distribution (power).
    if draft == "probs":
        assert _chi_square_p(tokens[:, 0], q[0]) < P_VALUE_FLOOR


def test_no_drafts_equals_plain_sampler():
    """With no drafts the emitted token is the one the plain sampler draws (same keys)."""
    n = 32
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(n, VOCAB)).astype(np.float32)
    meta = SamplingMetadata(
        temperature=jnp.where(jnp.arange(n) % 3 == 0, 0.0, 0.9).astype(jnp.float32),
        top_k=jnp.full(n, 5, jnp.int32),
        top_p=jnp.full(n, 0.9, jnp.float32),
        min_p=jnp.zeros(n, jnp.float32),
        seeds=jnp.arange(n, dtype=jnp.uint32),
        counters=jnp.arange(n, dtype=jnp.int32),
        masked_token_ids=jnp.full((n, 2), -1, jnp.int32),
    )
    plain = sample(jnp.asarray(logits), meta)
    spec = SpecDecodeInput(
        draft_token_ids=jnp.zeros((n, K), jnp.int32),
        num_draft=jnp.zeros(n, jnp.int32),
        ban_positions=jnp.zeros(n, jnp.int32),
    )
    flat = jnp.repeat(jnp.asarray(logits), K + 1, axis=0)
    out = jax.jit(sample_speculative)(flat, meta, spec)
    assert np.asarray(out.num_emitted).tolist() == [1] * n
    np.testing.assert_array_equal(np.asarray(out.token_ids)[:, 0], np.asarray(plain.token_ids))
    np.testing.assert_allclose(
        np.asarray(out.logprobs)[:, 0], np.asarray(plain.logprobs), rtol=1e-6
    )
