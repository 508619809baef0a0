"""Token feed: sampled ids stay on device and become the next step's input tokens.

Async scheduling packs step N+1 before step N's samples reach the host, so a
request's newest token is a placeholder in step N+1's host-built token_ids. The
device keeps one slot per input-batch row (a request holds its row for its whole
stay in the batch, so a slot is never shared or overwritten by another request's
sample while it is still needed, unlike a ring buffer):

    step N:    sample -> row_tokens[sample_rows[s]] = sampled[s]
    step N+1:  token_ids[t] = row_tokens[token_rows[t]] where token_rows[t] >= 0

Both are fixed-shape gathers/scatters inside the jitted step: no new shapes, no
host round trip. The synchronous engine passes token_rows = -1 everywhere. The two
row arrays travel in the StepInput's TokenFeed (paged_jax.worker.step_input).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def init_row_tokens(num_rows: int) -> jax.Array:
    """i32[num_rows] zeros: one last-sampled-token slot per input-batch row."""
    return jnp.zeros(num_rows, jnp.int32)


def feed_tokens(row_tokens: jax.Array, token_ids: jax.Array, token_rows: jax.Array) -> jax.Array:
    """i32[T] token ids with every placeholder (token_rows >= 0) taken from row_tokens."""
    from_device = row_tokens[jnp.maximum(token_rows, 0)]
    return jnp.where(token_rows >= 0, from_device, token_ids)


def record_tokens(row_tokens: jax.Array, sampled: jax.Array, sample_rows: jax.Array) -> jax.Array:
    """row_tokens with each sequence's sample stored at its row (out-of-range rows dropped)."""
    return row_tokens.at[sample_rows].set(sampled, mode="drop")
