"""Device sampling: penalties, greedy, temperature, top-k, top-p, min-p with per-request seeds.

Every row draws with its own key, fold_in(PRNGKey(seed), num_generated), and noise keyed
by token id (race), so a request's samples depend only on its seed, how many tokens it
has made and each token's own logit, never on what else shares the batch or how tokens
rank. A row whose raw logits are not all finite gets NONFINITE_TOKEN_ID, NaN
log-probabilities and top ids 0: one reduction per step, carried in the sampled ids the
host copies anyway."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from paged_jax.constants import NONFINITE_TOKEN_ID
from paged_jax.sampling_params import MAX_LOGPROBS
from paged_jax.worker.step_input import SamplingMetadata

__all__ = [
    "SamplerOutput",
    "apply_bitmask",
    "SamplingMetadata",
    "TokenLogprobs",
    "apply_penalties",
    "ban_tokens",
    "filter_row",
    "processed_logits",
    "race",
    "sample_row",
    "sample",
    "token_logprobs",
    "with_fed_last_token",
]


class SamplerOutput(NamedTuple):
    """The sampler's per-row outputs; a row with a non-finite logit has the values noted."""

    token_ids: jax.Array  # i32[S]; NONFINITE_TOKEN_ID on a non-finite row
    logprobs: jax.Array  # f32[S]; sampled token's log-prob (logprobs_mode's); NaN there
    top_token_ids: jax.Array  # i32[S, MAX_LOGPROBS]; 0 there
    top_logprobs: jax.Array  # f32[S, MAX_LOGPROBS]; NaN there
    ranks: jax.Array  # i32[S]; sampled token's 1-based rank (see token_logprobs); 0 there


class TokenLogprobs(NamedTuple):
    """Chosen tokens' log-probabilities in their rows' distributions, ranks, and the top ones."""

    logprobs: jax.Array  # f32[N]
    ranks: jax.Array  # i32[N]; 1-based
    top_token_ids: jax.Array  # i32[N, min(MAX_LOGPROBS, V)]
    top_logprobs: jax.Array  # f32[N, min(MAX_LOGPROBS, V)]


def token_logprobs(raw_logprobs: jax.Array, token_ids: jax.Array) -> TokenLogprobs:
    """Each row's log-probability of ``token_ids[n]``, its rank and the row's top entries.

    The rank counts the tokens at least as likely as the chosen one (vLLM's rule), so
    the most likely token has rank 1 and ties share the larger rank.

    Args:
        raw_logprobs: f32[N, V] log-softmax of the rows' logits.
        token_ids: i32[N] one token per row.
    """
    chosen = jnp.take_along_axis(raw_logprobs, token_ids[:, None], axis=-1)[:, 0]
    ranks = jnp.sum(raw_logprobs >= chosen[:, None], axis=-1, dtype=jnp.int32)
    k = min(MAX_LOGPROBS, raw_logprobs.shape[-1])
    top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, k)
    return TokenLogprobs(chosen, ranks, top_ids.astype(jnp.int32), top_logprobs)


def apply_bitmask(logits: jax.Array, words: jax.Array) -> jax.Array:
    """Logits with -inf where a structured-outputs bitmask disallows the token.

    Args:
        logits: f32[S, V].
        words: i32[S, W]; bit t % 32 of word t // 32 allows token t; columns past 32 * W
            are disallowed. An all-ones row (-1 words) leaves its logits as they are.
    """
    vocab = logits.shape[-1]
    num_words = words.shape[-1]
    col = jnp.arange(vocab, dtype=jnp.int32)
    word = col // 32
    inside = word < num_words
    picked = words[:, jnp.minimum(word, num_words - 1)]  # i32[S, V]
    # A logical shift reads bit 31 (the sign bit) like the others.
    bits = jax.lax.shift_right_logical(picked, jnp.broadcast_to(col % 32, picked.shape)) & 1
    return jnp.where((bits != 0) & inside[None, :], logits, -jnp.inf)


def ban_tokens(logits: jax.Array, banned: jax.Array) -> jax.Array:
    """Set logits of banned ids to -inf; -1 entries ban nothing."""
    num_rows, vocab = logits.shape
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], banned.shape)
    # Unused entries point past the vocabulary and are dropped by the scatter.
    cols = jnp.where(banned >= 0, banned, vocab)
    return logits.at[rows, cols].set(-jnp.inf, mode="drop")


def apply_penalties(
    logits: jax.Array,
    history: jax.Array,
    history_lens: jax.Array,
    num_output: jax.Array,
    presence: jax.Array,
    frequency: jax.Array,
    repetition: jax.Array,
) -> jax.Array:
    """Repetition, frequency and presence penalties, in that order (vLLM's order).

    Args:
        logits: f32[S, V].
        history: i32[S, L] token ids; only the first history_lens[s] of a row count.
        history_lens: i32[S]; prompt + output tokens of each row.
        num_output: i32[S]; the last num_output[s] history tokens are the output.
        presence, frequency: f32[S]; subtracted once per distinct output token /
            once per output occurrence.
        repetition: f32[S]; every token seen in the prompt or output has its logit
            divided by it if positive, multiplied if not (Hugging Face's rule).

    Returns:
        f32[S, V] penalised logits. The per-row token counts are built on device
        from the history by scatter-add (fixed shapes, no host-side vocab arrays).
    """
    num_rows, vocab = logits.shape
    pos = jnp.arange(history.shape[1])[None, :]
    valid = pos < history_lens[:, None]
    is_output = valid & (pos >= (history_lens - num_output)[:, None])
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], history.shape)
    # Invalid positions scatter past the vocabulary and are dropped.
    seen = (
        jnp.zeros((num_rows, vocab), bool)
        .at[rows, jnp.where(valid, history, vocab)]
        .set(True, mode="drop")
    )
    counts = (
        jnp.zeros((num_rows, vocab), jnp.float32)
        .at[rows, jnp.where(is_output, history, vocab)]
        .add(1.0, mode="drop")
    )
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * (counts > 0)


def with_fed_last_token(
    meta: SamplingMetadata, token_ids: jax.Array, logits_indices: jax.Array
) -> SamplingMetadata:
    """The history with each row's last position set to the token the step really read.

    With async scheduling the host packs a row's history before it has the row's newest
    token (the step reads it from the device slot instead), so position history_lens - 1
    may hold a stale id; the step's own input token at logits_indices is the right one.

    Args:
        token_ids: i32[T] the step's input tokens after the device feed.
        logits_indices: i32[S] index of each row's last scheduled token.
    """
    if meta.history_token_ids is None:
        return meta
    history = meta.history_token_ids
    rows = jnp.arange(history.shape[0])
    # Padding rows (length 0) point past the end and are dropped.
    cols = jnp.where(meta.history_lens > 0, meta.history_lens - 1, history.shape[1])
    last = token_ids[logits_indices]
    return meta._replace(history_token_ids=history.at[rows, cols].set(last, mode="drop"))


def _maybe_penalize(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """apply_penalties when the metadata carries them and some row uses one (run-time cond)."""
    if meta.history_token_ids is None:
        return logits
    active = jnp.any(
        (meta.presence_penalty != 0)
        | (meta.frequency_penalty != 0)
        | (meta.repetition_penalty != 1)
    )
    return jax.lax.cond(
        active,
        lambda: apply_penalties(
            logits,
            meta.history_token_ids,
            meta.history_lens,
            meta.counters,
            meta.presence_penalty,
            meta.frequency_penalty,
            meta.repetition_penalty,
        ),
        lambda: logits,
    )


def _filter_active(temperature, top_k, top_p, min_p, vocab: int) -> jax.Array:
    """bool[...]: a sampled row whose top-k, top-p or min-p removes anything."""
    k_on = (top_k > 0) & (top_k < vocab)
    return (temperature > 0) & (k_on | (top_p < 1) | (min_p > 0))


def filter_row(scaled: jax.Array, top_k, top_p, min_p) -> jax.Array:
    """f32[V] temperature-scaled logits with -inf outside the top-k, top-p and min-p set.

    The three filters each keep a prefix of the tokens sorted by probability, so the kept
    set is every token at least as likely as the shortest prefix's last one: one sort of
    the values (no ids) finds that threshold, and the mask is applied in id order. Top-k
    and top-p read the whole distribution (the token that crosses top_p stays in), min-p
    keeps p >= min_p * p_max; the most likely token always stays, a tie at the cut stays
    too, and top_k = 0, top_p >= 1, min_p = 0 remove nothing (bitwise).
    """
    vocab = scaled.shape[0]
    ranked = jnp.sort(scaled, descending=True)
    probs = jax.nn.softmax(ranked)
    mass_before = jnp.cumsum(probs) - probs
    num_k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    # mass_before can round up to 1 before the end of the vocabulary: top_p = 1 is off.
    num_p = jnp.where(top_p < 1, jnp.sum(mass_before < top_p), vocab)
    num_min_p = jnp.sum(probs >= min_p * probs[0])
    num_kept = jnp.clip(jnp.minimum(jnp.minimum(num_k, num_p), num_min_p), 1, vocab)
    keep = (num_kept >= vocab) | (scaled >= ranked[num_kept - 1])
    return jnp.where(keep, scaled, -jnp.inf)


def processed_logits(logits: jax.Array, temperature, top_k, top_p, min_p) -> jax.Array:
    """f32[S, V] the logits every row samples from: scaled by its temperature (rows with
    temperature 0 as they are), -inf outside its top-k / top-p / min-p set.

    The sort behind the filters runs only when some sampled row has one (a run-time
    cond; both branches compile once); a row without a filter gets the same bits on
    either branch, so its draw does not depend on what shares the batch.
    """
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    vocab = logits.shape[-1]
    return jax.lax.cond(
        jnp.any(_filter_active(temperature, top_k, top_p, min_p, vocab)),
        lambda: jax.vmap(filter_row)(scaled, top_k, top_p, min_p),
        lambda: scaled,
    )


def race(logits: jax.Array, key: jax.Array) -> jax.Array:
    """i32 index of one draw from softmax(logits) [V], keyed by token id.

    An exponential race: token i arrives at q_i / p_i with q_i ~ Exp(1) drawn at index
    i of the key's stream, and the first arrival wins (argmax of log p_i - log q_i). Token
    i's noise depends on the key and i alone, so no other token's logit can move it: a
    last-bit change between two nearly tied logits leaves every draw but a near tie of
    the winner's race as it was. q comes from 32 random bits (-log1p(-u), u = bits/2^32),
    so an exact 0 has probability 2^-32 per token, not the 2^-23 of a float uniform.
    """
    bits = jax.random.bits(key, logits.shape, jnp.uint32)
    u = bits.astype(jnp.float32) * jnp.float32(2.0**-32)
    arrival = -jnp.log1p(-u)  # Exp(1); u rounds to 1 (arrival inf) only for the slowest
    # Tokens at -inf never win (and -inf + inf must not make a NaN).
    score = jnp.where(logits > -jnp.inf, logits - jnp.log(arrival), -jnp.inf)
    return jnp.argmax(score).astype(jnp.int32)


def sample_row(logits: jax.Array, temperature, top_k, top_p, min_p, key) -> jax.Array:
    """Sample one token id from f32[V] logits after temperature, top-k, top-p, min-p
    (temperature > 0): filter_row, then race with the row's key."""
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    return race(filter_row(scaled, top_k, top_p, min_p), key)


def sample(logits: jax.Array, meta: SamplingMetadata) -> SamplerOutput:
    """Choose the next token of every row.

    Args:
        logits: f[S, V] logits at each sequence's last scheduled token.
        meta: per-row settings (padding rows may hold anything finite).

    Returns:
        SamplerOutput with the sampled ids, their log-probabilities (of the distribution
        the bitmask leaves, if any, before bans and penalties; with
        meta.processed_logprobs, of the distribution sampled from on those rows) and ranks,
        plus the top MAX_LOGPROBS log-probabilities of each row. A row whose raw logits hold a
        NaN or an infinity (checked before bans, which add -inf on purpose) gets
        NONFINITE_TOKEN_ID and NaN log-probabilities instead, whatever it would have drawn.
    """
    logits = logits.astype(jnp.float32)
    # One reduction per step, over the rows the log-softmax reads anyway.
    nonfinite = ~jnp.isfinite(logits).all(axis=-1)  # bool[S]
    if meta.bitmask is not None:
        # Structured outputs: before everything else, so every mode and the logprobs
        # (the masked distribution) see only the tokens the grammar allows.
        logits = apply_bitmask(logits, meta.bitmask)
        raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
        allowed = logits
        banned = ban_tokens(logits, meta.masked_token_ids)
        # A min_tokens ban of EOS on a row whose grammar allows only EOS leaves nothing:
        # the grammar wins there.
        logits = jnp.where(jnp.isfinite(banned).any(axis=-1, keepdims=True), banned, allowed)
    else:
        raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
        logits = ban_tokens(logits, meta.masked_token_ids)
    logits = _maybe_penalize(logits, meta)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(
        meta.seeds, meta.counters
    )
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def processed() -> jax.Array:
        return processed_logits(logits, meta.temperature, meta.top_k, meta.top_p, meta.min_p)

    if meta.processed_logprobs is None:
        # An all-greedy batch skips the race (one [S, V] random draw) and the filters at
        # run time (both branches are compiled once, so shapes stay static).
        sampled = jax.lax.cond(
            jnp.any(meta.temperature > 0),
            lambda: jax.vmap(race)(processed(), keys),
            lambda: greedy,
        )
        stats_logprobs = raw_logprobs
    else:
        # logprobs_mode="processed_logprobs" on some row: its logprobs are the log-softmax
        # of the very logits its race reads (greedy rows: after bans and penalties).
        sampling_logits = processed()
        sampled = jax.lax.cond(
            jnp.any(meta.temperature > 0),
            lambda: jax.vmap(race)(sampling_logits, keys),
            lambda: greedy,
        )
        stats_logprobs = jnp.where(
            meta.processed_logprobs[:, None],
            jax.nn.log_softmax(sampling_logits, axis=-1),
            raw_logprobs,
        )
    token_ids = jnp.where(meta.temperature > 0, sampled, greedy)
    stats = token_logprobs(stats_logprobs, token_ids)
    bad = nonfinite[:, None]
    return SamplerOutput(
        jnp.where(nonfinite, NONFINITE_TOKEN_ID, token_ids),
        jnp.where(nonfinite, jnp.nan, stats.logprobs),
        jnp.where(bad, 0, stats.top_token_ids),
        jnp.where(bad, jnp.nan, stats.top_logprobs),
        jnp.where(nonfinite, 0, stats.ranks),
    )
