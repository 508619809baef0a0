"""StepInput: what one jitted step reads, as host-built numpy, grouped by who reads it.

    StepInput
      token_ids i32[T], positions i32[T]   the model's embedding
      attention: AttentionMetadata         the model's layers (attention_metadata.py)
      sampling:  SamplingMetadata          the sampler (sampling.py)
      feed:      TokenFeed                 the async token feed (token_feed.py)
      copies:    StepCopies                copy-on-write, first in the step (block_copies.py)

Every group is a pytree (NamedTuples of arrays; AttentionMetadata is registered by
paged_jax.models.attention), so the runner passes them to the jitted step as they are.
This module never imports jax: the input batch builds all of it with numpy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from paged_jax.worker.attention_metadata import AttentionMetadata


class SamplingMetadata(NamedTuple):
    """Per-row sampling settings, padded to the step's num_seqs bucket S."""

    temperature: Any  # f32[S]; 0 = greedy
    top_k: Any  # i32[S]; 0 = off
    top_p: Any  # f32[S]; 1 = off
    min_p: Any  # f32[S]; 0 = off
    seeds: Any  # u32[S]
    counters: Any  # i32[S]; tokens generated so far (the key's fold-in)
    masked_token_ids: Any  # i32[S, K]; tokens banned this step (-1 = unused); min_tokens
    # Penalties (None = all off). A row's history is its prompt then its output tokens:
    # positions [0, history_lens) are valid, the last `counters` of them are output.
    presence_penalty: Any = None  # f32[S]; 0 = off
    frequency_penalty: Any = None  # f32[S]; 0 = off
    repetition_penalty: Any = None  # f32[S]; 1 = off
    history_token_ids: Any = None  # i32[S, L]; L = max_model_len
    history_lens: Any = None  # i32[S]; tokens in the history (prompt + output)


class TokenFeed(NamedTuple):
    """Where a step's placeholder tokens come from and where its samples go."""

    token_rows: Any  # i32[T]; row whose last sample is this token, -1 = host token
    sample_rows: Any  # i32[S]; row that keeps this sequence's sample, >= R = dropped


class StepCopies(NamedTuple):
    """The step's copy-on-write block copies as device arrays, padded to C = max_num_seqs.

    The host's decision is ``paged_jax.core.copy_on_write.BlockCopies`` (pairs and the
    table slots they fill); this is its fixed-shape form for the jitted step.
    """

    src: Any  # i32[C]; source block ids
    dst: Any  # i32[C]; destination block ids, -1 = padding (no copy)


@dataclasses.dataclass(frozen=True)
class StepInput:
    """Everything one jitted step reads, padded to a (num_tokens, num_seqs) bucket.

    T = padded num_tokens, S = padded num_seqs (see the module docstring for the groups).
    ``sampling``'s penalty fields are None when no scheduled request uses a penalty: the
    runner then feeds a resident all-zero history of the same shape, so nothing is
    copied per step and no second compile happens.
    """

    token_ids: Any  # i32[T]
    positions: Any  # i32[T]
    attention: AttentionMetadata
    sampling: SamplingMetadata
    feed: TokenFeed
    copies: StepCopies
    num_tokens: int  # real (unpadded) tokens
    num_seqs: int  # real (unpadded) sequences

    @property
    def bucket(self) -> tuple[int, int]:
        """The (num_tokens, num_seqs) bucket of this step."""
        return int(self.token_ids.shape[0]), int(self.attention.seq_lens.shape[0])
