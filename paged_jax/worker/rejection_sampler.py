"""Rejection sampling of speculative tokens: one target step verifies k drafts per sequence.

For each sequence the step has target logits at k + 1 positions: after the last
confirmed token (position 0) and after each of its d <= k drafts x_1..x_d. Position j's
distribution p_j is the target's after every SamplingParams transform (bans, penalties
over the history with the drafts before j, temperature, top-k/p, min-p), exactly what
the non-speculative sampler draws from there.

    greedy row:   accept x_j while x_j == argmax p_{j-1}; then emit argmax at the stop
    sampled row:  accept x_j with probability min(1, p(x_j) / q(x_j)); on the first
                  rejection emit a draw from normalise(max(0, p - q)) and stop; when all
                  d are accepted emit a bonus draw from p_d

so the emitted tokens follow the target's distribution exactly (Leviathan et al., Chen
et al.). q is the draft's distribution (draft_probs), or a point mass on x_j when
proposals are deterministic (n-gram): accept with probability p(x_j), resample from p
without x_j. Every draw keys on the request's seed and the output position it fills
(fold_in(PRNGKey(seed), num_output_before)), and the recovered and bonus draws key their
noise by token id too (``sampling.race``), so outputs are deterministic per request and
position and no token's rank moves them; with no drafts the emitted token is the one
``sampling.sample`` draws.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from paged_jax.constants import NONFINITE_TOKEN_ID
from paged_jax.worker.sampling import (
    apply_bitmask,
    apply_penalties,
    ban_tokens,
    filter_row,
    processed_logits,
    race,
    token_logprobs,
)
from paged_jax.worker.step_input import SamplingMetadata, SpecDecodeInput

__all__ = [
    "SpecSamplerOutput",
    "expand_positions",
    "filtered_probs",
    "rejection_sample",
    "sample_speculative",
]

# Key fold-ins: position j's acceptance uniform and its residual resample use keys
# derived from the position's own key, so neither reuses the bonus draw's key.
_ACCEPT_TAG = 1
_RESAMPLE_TAG = 2


class SpecSamplerOutput(NamedTuple):
    """Emitted tokens of every sequence; entries past num_emitted[s] are padding."""

    token_ids: jax.Array  # i32[S, K1]; NONFINITE_TOKEN_ID where the position's logits were not
    num_emitted: jax.Array  # i32[S]; accepted drafts + 1
    logprobs: jax.Array  # f32[S, K1]; emitted token's log-prob (raw distribution)
    top_token_ids: jax.Array  # i32[S, K1, MAX_LOGPROBS]
    top_logprobs: jax.Array  # f32[S, K1, MAX_LOGPROBS]
    ranks: jax.Array  # i32[S, K1]


def filtered_probs(logits: jax.Array, temperature, top_k, top_p, min_p) -> jax.Array:
    """The distribution ``sampling.sample_row`` draws from, in vocabulary order.

    Args:
        logits: f32[V] (bans and penalties applied).
        temperature, top_k, top_p, min_p: the row's settings (temperature > 0).

    Returns:
        f32[V] probabilities after temperature, top-k, top-p and min-p (zero outside
        the kept set, renormalised).
    """
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    return jax.nn.softmax(filter_row(scaled, top_k, top_p, min_p))


def rejection_sample(
    logits: jax.Array,
    draft_token_ids: jax.Array,
    num_draft: jax.Array,
    draft_probs: jax.Array | None,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    keys: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Accepts a prefix of each sequence's drafts and emits one more token (module docstring).

    Args:
        logits: f32[S, K1, V] target logits per position (K1 = k + 1), bans and
            penalties applied.
        draft_token_ids: i32[S, k]; entries past num_draft[s] are ignored.
        num_draft: i32[S] in [0, k].
        draft_probs: f32[S, k, V] the draft distribution each draft was drawn from, or
            None for point masses.
        temperature, top_k, top_p, min_p: per-sequence settings [S]; temperature 0 =
            greedy.
        keys: [S, K1] PRNG keys, position j's = fold_in(PRNGKey(seed), counter + j).

    Returns:
        (i32[S, K1] emitted tokens: the accepted drafts, then the recovered or bonus
        token, then zeros; i32[S] how many were emitted, in [1, num_draft + 1]).
    """
    num_seqs, k1, vocab = logits.shape
    k = k1 - 1
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [S, K1]
    pos = jnp.arange(k)[None, :]
    valid = pos < num_draft[:, None]  # [S, k]
    drafts = jnp.where(valid, draft_token_ids, 0)

    def sampled_path():
        # The plain sampler's logits and race, row by row: the bonus draw is its draw.
        processed = processed_logits(
            logits.reshape(num_seqs * k1, vocab),
            *(jnp.repeat(x, k1) for x in (temperature, top_k, top_p, min_p)),
        )
        flat_keys = keys.reshape(num_seqs * k1, *keys.shape[2:])
        bonus = jax.vmap(race)(processed, flat_keys).reshape(num_seqs, k1)
        p = jax.nn.softmax(processed, axis=-1).reshape(num_seqs, k1, vocab)
        p_drafts = p[:, :k]  # [S, k, V]
        p_x = jnp.take_along_axis(p_drafts, drafts[..., None], axis=-1)[..., 0]
        if draft_probs is None:
            q_x = jnp.ones_like(p_x)
            q = jax.nn.one_hot(drafts, vocab, dtype=jnp.float32)
        else:
            q = draft_probs.astype(jnp.float32)
            q_x = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
        draft_keys = keys[:, :k]
        u = jax.vmap(
            jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, _ACCEPT_TAG)))
        )(draft_keys)
        accept = u * q_x < p_x
        residual = jnp.maximum(p_drafts - q, 0.0)
        # p == q leaves nothing to resample from (a rejection then has probability 0
        # up to rounding): fall back to p itself.
        empty = residual.sum(axis=-1, keepdims=True) <= 0
        residual = jnp.where(empty, p_drafts, residual)
        # Zero residual mass is log 0 = -inf: never drawn.
        recovered = jax.vmap(
            jax.vmap(lambda key, r: race(jnp.log(r), jax.random.fold_in(key, _RESAMPLE_TAG)))
        )(draft_keys, residual)
        return accept, recovered, bonus

    def greedy_path():
        accept = drafts == greedy_tokens[:, :k]
        return accept, greedy_tokens[:, :k], greedy_tokens

    accept_s, recovered_s, bonus_s = jax.lax.cond(
        jnp.any(temperature > 0),
        sampled_path,
        lambda: (
            jnp.zeros((num_seqs, k), bool),
            jnp.zeros((num_seqs, k), jnp.int32),
            greedy_tokens,
        ),
    )
    accept_g, recovered_g, bonus_g = greedy_path()
    is_sampled = (temperature > 0)[:, None]
    accept = jnp.where(is_sampled, accept_s, accept_g) & valid
    recovered = jnp.where(is_sampled, recovered_s, recovered_g)
    bonus = jnp.where(is_sampled, bonus_s, bonus_g)
    # Accepted prefix length: the first position that is not accepted.
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1)
    rows = jnp.arange(num_seqs)
    all_accepted = num_accepted == num_draft
    at = jnp.minimum(num_accepted, k - 1) if k > 0 else num_accepted
    last = jnp.where(all_accepted, bonus[rows, num_accepted], recovered[rows, at])
    cols = jnp.arange(k1)[None, :]
    padded_drafts = jnp.concatenate([drafts, jnp.zeros((num_seqs, 1), jnp.int32)], axis=1)
    tokens = jnp.where(cols < num_accepted[:, None], padded_drafts, 0)
    tokens = jnp.where(cols == num_accepted[:, None], last[:, None], tokens)
    return tokens.astype(jnp.int32), (num_accepted + 1).astype(jnp.int32)


def expand_positions(meta: SamplingMetadata, spec: SpecDecodeInput, k1: int) -> SamplingMetadata:
    """The per-sequence metadata as one row per (sequence, position), S * K1 rows.

    Position j of a sequence has j more output tokens before it (the drafts it
    verifies, accepted if position j is reached at all): its counter is counters + j,
    its min_tokens ban applies while j < ban_positions, and its penalty history is
    the confirmed history plus drafts[:j] (the input batch writes the drafts right
    after the confirmed tokens, so history_lens + j covers them).
    """
    num_seqs = meta.temperature.shape[0]
    j = jnp.arange(k1, dtype=jnp.int32)

    def rep(x):
        return None if x is None else jnp.repeat(jnp.asarray(x), k1, axis=0)

    positions = jnp.tile(j, num_seqs)  # [S * K1]
    banned = rep(meta.masked_token_ids)
    active = positions < rep(spec.ban_positions)
    banned = jnp.where(active[:, None], banned, -1)
    out = SamplingMetadata(
        temperature=rep(meta.temperature),
        top_k=rep(meta.top_k),
        top_p=rep(meta.top_p),
        min_p=rep(meta.min_p),
        seeds=rep(meta.seeds),
        counters=rep(meta.counters) + positions,
        masked_token_ids=banned,
        presence_penalty=rep(meta.presence_penalty),
        frequency_penalty=rep(meta.frequency_penalty),
        repetition_penalty=rep(meta.repetition_penalty),
        history_token_ids=rep(meta.history_token_ids),
        history_lens=None if meta.history_lens is None else rep(meta.history_lens) + positions,
        bitmask=rep(meta.bitmask),
    )
    return out


def sample_speculative(
    logits: jax.Array,
    meta: SamplingMetadata,
    spec: SpecDecodeInput,
    draft_probs: jax.Array | None = None,
) -> SpecSamplerOutput:
    """Verifies every sequence's drafts and emits its accepted tokens plus one.

    Args:
        logits: f[S * K1, V] target logits, sequence-major (position j of sequence s
            is row s * K1 + j; the step's logits_indices are laid out so).
        meta: per-sequence settings [S] (SamplingMetadata, penalties filled in).
        spec: the drafts, their counts and the min_tokens ban extents.
        draft_probs: f32[S, k, V] per sequence (already gathered by row), or None.

    Returns:
        SpecSamplerOutput. A position whose raw logits are not all finite emits
        NONFINITE_TOKEN_ID and NaN log-probabilities there.
    """
    num_seqs = meta.temperature.shape[0]
    k1 = logits.shape[0] // num_seqs
    logits = logits.astype(jnp.float32)
    nonfinite = ~jnp.isfinite(logits).all(axis=-1)  # bool[S * K1]
    rows = expand_positions(meta, spec, k1)
    if rows.bitmask is not None:
        logits = apply_bitmask(logits, rows.bitmask)
        raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
        allowed = logits
        banned = ban_tokens(logits, rows.masked_token_ids)
        logits = jnp.where(jnp.isfinite(banned).any(axis=-1, keepdims=True), banned, allowed)
    else:
        raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
        logits = ban_tokens(logits, rows.masked_token_ids)
    if rows.history_token_ids is not None:
        active = jnp.any(
            (rows.presence_penalty != 0)
            | (rows.frequency_penalty != 0)
            | (rows.repetition_penalty != 1)
        )
        logits = jax.lax.cond(
            active,
            lambda: apply_penalties(
                logits,
                rows.history_token_ids,
                rows.history_lens,
                rows.counters,
                rows.presence_penalty,
                rows.frequency_penalty,
                rows.repetition_penalty,
            ),
            lambda: logits,
        )
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(
        rows.seeds, rows.counters
    )
    vocab = logits.shape[-1]
    tokens, num_emitted = rejection_sample(
        logits.reshape(num_seqs, k1, vocab),
        spec.draft_token_ids,
        spec.num_draft,
        draft_probs,
        meta.temperature,
        meta.top_k,
        meta.top_p,
        meta.min_p,
        keys.reshape(num_seqs, k1, *keys.shape[1:]),
    )
    flat = tokens.reshape(-1)
    stats = token_logprobs(raw_logprobs, flat)
    bad = nonfinite[:, None]

    def shaped(x):
        return x.reshape(num_seqs, k1, *x.shape[1:])

    return SpecSamplerOutput(
        shaped(jnp.where(nonfinite, NONFINITE_TOKEN_ID, flat)),
        num_emitted,
        shaped(jnp.where(nonfinite, jnp.nan, stats.logprobs)),
        shaped(jnp.where(bad, 0, stats.top_token_ids)),
        shaped(jnp.where(bad, jnp.nan, stats.top_logprobs)),
        shaped(jnp.where(nonfinite, 0, stats.ranks)),
    )
