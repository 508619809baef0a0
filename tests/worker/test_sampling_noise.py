"""Sampling noise is keyed by token id: a row's draw depends only on its seed, its output
position and each token's own id, never on where a token ranks among the others."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from paged_jax.worker.rejection_sampler import rejection_sample
from paged_jax.worker.sampling import SamplingMetadata
from paged_jax.worker.sampling import sample as _sample

# One compiled program per batch shape (faster here than op-by-op dispatch).
sample = jax.jit(_sample)

# Fixed seeds make every run identical; for random seeds the floor makes a false failure
# of a fair sampler a 1-in-10^6 event per check.
P_VALUE_FLOOR = 1e-6

# Four levels of tied logits (3 + 4 + 4 + 5 tokens, ids interleaved): each filter below
# cuts between two levels, so a few ulps of change to any logit leave the kept set as it
# is, while the ties make a rank-keyed sampler's noise move between tokens.
LEVELS = np.array([3.0, 2.0, 1.0, 0.0], np.float32)
TIED = LEVELS[np.array([0, 1, 2, 3, 1, 0, 2, 3, 3, 1, 2, 0, 3, 2, 1, 3])]
VOCAB = TIED.size
FILTERS = {  # (top_k, top_p, min_p)
    "none": (0, 1.0, 0.0),
    "top_k": (7, 1.0, 0.0),  # the 3 + 4 best
    "top_p": (0, 0.5, 0.0),  # the best level holds 57% of the mass
    "min_p": (0, 1.0, 0.2),  # e^-1 = 0.37 of the best stays, e^-2 = 0.14 goes
}


def meta(rows: int, **overrides) -> SamplingMetadata:
    base = dict(
        temperature=np.ones(rows, np.float32),
        top_k=np.zeros(rows, np.int32),
        top_p=np.ones(rows, np.float32),
        min_p=np.zeros(rows, np.float32),
        seeds=np.arange(rows, dtype=np.uint32),
        counters=np.zeros(rows, np.int32),
        masked_token_ids=np.full((rows, 4), -1, np.int32),
    )
    base.update({k: np.asarray(v, dtype=base[k].dtype) for k, v in overrides.items()})
    return SamplingMetadata(**{k: jnp.asarray(v) for k, v in base.items()})


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The filtered softmax in float64, by the definitions (top-k and top-p over the
    temperature-scaled distribution, the token crossing top_p kept, min-p relative to the
    most likely token); the logits here have no ties at a cut."""
    scaled = np.asarray(logits, np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(probs.size, bool)
    mass_before = np.cumsum(probs[order]) - probs[order]
    ranked = (np.arange(probs.size) < (top_k or probs.size)) & (mass_before < top_p)
    keep[order] = ranked
    keep &= probs >= min_p * probs.max()
    keep[order[0]] = True
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def chi_square_p(tokens, probs):
    counts = np.bincount(tokens, minlength=probs.size).astype(np.float64)
    expected = probs / probs.sum() * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, "a token of zero probability was drawn"
    return stats.chisquare(counts[support], expected[support]).pvalue


def nudged(row: np.ndarray, keep_id: int, rng: np.random.Generator) -> np.ndarray:
    """``row`` with every logit but ``keep_id``'s moved by 1-3 ulps either way."""
    out = row.copy()
    for i in range(row.size):
        if i != keep_id:
            for _ in range(rng.integers(1, 4)):
                out[i] = np.nextafter(out[i], np.float32(np.inf if rng.random() < 0.5 else -np.inf))
    return out


@pytest.mark.parametrize("name", FILTERS)
def test_nudging_other_tokens_never_moves_the_draw(name):
    """Each row draws t from the tied logits; the same (seed, position) over logits where
    every other token moved by a few ulps (t's own logit and the kept set unchanged)
    draws t again. Rank-keyed noise fails this: the nudges reorder the tied tokens and
    hand their noise to one another."""
    top_k, top_p, min_p = FILTERS[name]
    rows = 256
    settings = dict(top_k=[top_k] * rows, top_p=[top_p] * rows, min_p=[min_p] * rows)
    m = meta(rows, seeds=np.arange(rows) + 7, counters=np.arange(rows) % 5, **settings)
    drawn = np.asarray(sample(jnp.asarray(np.tile(TIED, (rows, 1))), m).token_ids)
    rng = np.random.default_rng(0)
    moved = np.stack([nudged(TIED, int(t), rng) for t in drawn])
    again = np.asarray(sample(jnp.asarray(moved), m).token_ids)
    assert len(set(drawn.tolist())) >= 3, "the rows must draw several different tokens"
    np.testing.assert_array_equal(again, drawn)


def test_draw_depends_on_seed_and_position_only():
    """A row draws the same token alone as at its place in a larger batch beside greedy
    and filtered rows (an unfiltered row alone skips the filters' branch, which the
    batch runs)."""
    rng = np.random.default_rng(3)
    vocab = 40
    logits = rng.normal(size=(9, vocab)).astype(np.float32) * 2
    settings = dict(
        seeds=[5, 6, 7, 8, 9, 10, 11, 12, 13],
        counters=[4, 0, 1, 2, 3, 9, 5, 6, 7],
        temperature=[0.8, 0.0, 1.0, 1.2, 0.7, 1.0, 0.0, 1.0, 0.9],
        top_k=[0, 0, 5, 0, 0, 0, 0, 3, 0],
        top_p=[1.0, 1.0, 1.0, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0],
        min_p=[0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0],
    )
    full = np.asarray(sample(jnp.asarray(logits), meta(9, **settings)).token_ids)
    for i in range(9):
        alone = {k: [v[i]] for k, v in settings.items()}
        got = sample(jnp.asarray(logits[i : i + 1]), meta(1, **alone)).token_ids
        assert int(got[0]) == full[i], f"row {i} alone"


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 0, 1.0, 0.0), (0.7, 4, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.15)],
)
def test_draws_follow_the_filtered_softmax(temperature, top_k, top_p, min_p):
    """Seeded draws (one per seed) over fixed logits follow the filtered softmax."""
    n, vocab = 4000, 10
    logits = np.random.default_rng(4).normal(size=vocab).astype(np.float32) * 1.5
    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    m = meta(n, seeds=np.arange(n) + 100, **{k: [v] * n for k, v in settings.items()})
    tokens = np.asarray(sample(jnp.asarray(np.tile(logits, (n, 1))), m).token_ids)
    want = reference_probs(logits, **settings)
    assert chi_square_p(tokens, want) > P_VALUE_FLOOR
    if (top_k, top_p, min_p) != (0, 1.0, 0.0):
        assert (want == 0).any(), "the filter must remove some tokens"


def _keys(seeds, counters, k1):
    def one(s, c):
        return jax.vmap(lambda j: jax.random.fold_in(jax.random.PRNGKey(s), c + j))(jnp.arange(k1))

    return jax.vmap(one)(jnp.asarray(seeds, jnp.uint32), jnp.asarray(counters, jnp.int32))


def _settings(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    return (
        jnp.full(n, temperature, jnp.float32),
        jnp.full(n, top_k, jnp.int32),
        jnp.full(n, top_p, jnp.float32),
        jnp.full(n, min_p, jnp.float32),
    )


@pytest.mark.parametrize("draft", ["probs", "point_mass"])
def test_recovered_tokens_follow_the_residual(draft):
    """One draft per row, rejected or not: a rejected row's recovered token follows
    normalise(max(0, p - q)) (p without the draft for a point-mass proposal)."""
    n, vocab = 4000, 8
    rng = np.random.default_rng(5)
    target = rng.normal(size=vocab).astype(np.float32) * 1.5
    p = reference_probs(target)
    q = np.exp(rng.normal(size=vocab))
    q /= q.sum()
    if draft == "probs":
        drafts = rng.choice(vocab, size=n, p=q)
        draft_probs = jnp.asarray(np.broadcast_to(q, (n, 1, vocab)).astype(np.float32))
    else:
        drafts = np.full(n, int(np.argmax(p)))
        draft_probs = None
    logits = np.broadcast_to(target, (n, 2, vocab)).copy()
    tokens, emitted = jax.jit(rejection_sample)(
        jnp.asarray(logits),
        jnp.asarray(drafts[:, None], jnp.int32),
        jnp.ones(n, jnp.int32),
        draft_probs,
        *_settings(n),
        _keys(np.arange(n) + 2000, np.zeros(n), 2),
    )
    tokens, emitted = np.asarray(tokens), np.asarray(emitted)
    rejected = emitted == 1
    assert rejected.sum() > 500
    for d in np.unique(drafts) if draft == "probs" else drafts[:1]:
        rows = rejected & (drafts == d)
        if draft == "probs" and rows.sum() < 200:
            continue
        one_hot = np.eye(vocab)[d]
        residual = np.maximum(p - (q if draft == "probs" else one_hot), 0.0)
        assert chi_square_p(tokens[rows, 0], residual) > P_VALUE_FLOOR


def test_rejection_sampler_draws_are_keyed_by_token_id():
    """The bonus token (all drafts accepted) and the recovered token (draft rejected)
    stay when every other token's logit moves by a few ulps, as in the plain sampler."""
    rows = 256
    rng = np.random.default_rng(6)
    # Position 0 verifies a draft that is always rejected (a banned-level token with
    # q = 1 and p small but positive); position 1 is the bonus after an accepted draft.
    low = int(np.flatnonzero(TIED == 0.0)[0])
    top = int(np.flatnonzero(TIED == 3.0)[0])
    keys = _keys(np.arange(rows) + 11, np.arange(rows) % 3, 2)
    base = np.broadcast_to(TIED, (rows, 2, VOCAB)).copy()

    def run(logits, drafts):
        tokens, emitted = rejection_sample(
            jnp.asarray(logits), jnp.asarray(drafts), jnp.ones(rows, jnp.int32), None,
            *_settings(rows), keys,
        )  # fmt: skip
        return np.asarray(tokens), np.asarray(emitted)

    # Recovered: draft = a low token, point mass; rejected unless u < p(low) (~1%).
    drafts = np.full((rows, 1), low, np.int32)
    tokens, emitted = run(base, drafts)
    rej = emitted == 1
    moved = base.copy()
    for s in range(rows):
        moved[s, 0] = nudged(TIED, int(tokens[s, 0]) if rej[s] else low, rng)
    again, emitted2 = run(moved, drafts)
    assert rej.sum() > 200 and len(set(tokens[rej, 0].tolist())) > 3
    np.testing.assert_array_equal(emitted2, emitted)
    np.testing.assert_array_equal(again[rej, 0], tokens[rej, 0])
    # Bonus: the draft is the best token; with probability p(top) it is accepted.
    drafts = np.full((rows, 1), top, np.int32)
    tokens, emitted = run(base, drafts)
    acc = emitted == 2
    moved = base.copy()
    for s in range(rows):
        moved[s, 1] = nudged(TIED, int(tokens[s, 1]) if acc[s] else top, rng)
    again, emitted2 = run(moved, drafts)
    assert acc.sum() > 20 and len(set(tokens[acc, 1].tolist())) > 3
    np.testing.assert_array_equal(emitted2, emitted)
    np.testing.assert_array_equal(again[acc, 1], tokens[acc, 1])
