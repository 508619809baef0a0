"""StepInput: what one jitted step reads, as host-built numpy, grouped by who reads it.

    StepInput
      token_ids i32[T], positions i32[T]   the model's embedding
      attention: AttentionMetadata         the model's layers
      sampling:  SamplingMetadata          the sampler (sampling.py)
      feed:      TokenFeed                 the async token feed (runner.py)
      copies:    StepCopies                copy-on-write, its own call before the step
                                           (runner.py; skipped when all padding)
      spec:      SpecDecodeInput | None    speculative decoding's drafts (rejection_sampler.py)
      lora_slots i32[T] | None             each token row's LoRA slot (models/lora.py)

Every group is a pytree (NamedTuples of arrays; AttentionMetadata is registered by
paged_jax.models.attention), so the runner passes them to the jitted step as they are.
This module never imports jax: the input batch builds all of it with numpy.

AttentionMetadata is the part a model's layers read under jit (the PagedModel contract).
A model with several KV-cache groups (full attention and sliding windows) has one block
table and one slot mapping per group, and a layer reads its own group's through
``for_group``:

    slot_mappings = (i32[T] group 0, i32[T] group 1, ...)
    block_tables  = (i32[S, W] group 0, i32[S, W] group 1, ...)
    layer of group g:  slot_mapping, block_table = attn_metadata.for_group(g)

Its flags (decode_only, validate, ragged_only) are static pytree metadata. The contract's earlier
single-group spelling (``attn_metadata.slot_mapping``) still reads group 0's for a
one-group step, with a DeprecationWarning (docs/research_integration.md, "Model contract
versions").
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple

# Pytree metadata, not leaves: a jitted step compiles once per (bucket, flags) and may
# branch on them in Python.
_STATIC = {"static": True}


class GroupTables(NamedTuple):
    """One KV-cache group's part of a step: where its new K/V go and which blocks it reads."""

    slot_mapping: Any  # i32[T]; block_id * block_size + offset, -1 = padding (write dropped)
    block_table: Any  # i32[S, W]; 0 = null block


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where the new tokens of one paged step go and what they attend to (a pytree).

    Shapes are fixed per bucket: T tokens (padded), S sequences (padded), W block-table
    width, G KV-cache groups.

    Attributes:
        slot_mappings: G x i32[T] cache slot (block_id * block_size + offset) of each
            token in each group; -1 for padding rows, whose K/V are dropped.
        block_tables: G x i32[S, W] block ids of each sequence in token order, per group;
            0 (null block) pads. A window group's table holds 0 for blocks wholly below
            the window (they were freed).
        seq_lens: i32[S] context length of each sequence including its new tokens; 0 pads.
        query_start_loc: i32[S + 1] offsets of each sequence's new tokens in the token rows.
        logits_indices: i32[S] token row whose logits are returned for each sequence
            (usually query_start_loc[1:] - 1); any valid row for padding sequences.
        decode_only: every sequence has exactly one new token and row i is sequence i's
            (query_start_loc = [0, 1, ..., n, n, ...]): attention may use the decode
            kernel (pallas_kernels.step_attention).
        validate: range-check block ids, slots and lengths on device (debug; the caller
            functionalizes the checks with checkify, as Runner does).
        ragged_only: every row through the ragged attention kernel, a single-token
            sequence's too (``pallas_kernels.step_attention``): the steps of a
            batch-invariant engine (EngineConfig.batch_invariant), never decode_only.

    A single array given for ``slot_mappings`` or ``block_tables`` (a model with one
    KV-cache group) is taken as that one group's; a tuple always lists the groups.
    """

    slot_mappings: tuple[Any, ...]
    block_tables: tuple[Any, ...]
    seq_lens: Any
    query_start_loc: Any
    logits_indices: Any
    decode_only: bool = dataclasses.field(default=False, metadata=_STATIC)
    validate: bool = dataclasses.field(default=False, metadata=_STATIC)
    ragged_only: bool = dataclasses.field(default=False, metadata=_STATIC)

    def __post_init__(self):
        for name in ("slot_mappings", "block_tables"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                object.__setattr__(self, name, (value,))
        if len(self.slot_mappings) != len(self.block_tables):
            raise ValueError(
                f"len(slot_mappings)={len(self.slot_mappings)} must equal "
                f"len(block_tables)={len(self.block_tables)} (one of each per KV-cache group)"
            )

    @property
    def num_groups(self) -> int:
        """G, the number of KV-cache groups this step carries tables for."""
        return len(self.block_tables)

    def for_group(self, group: int) -> GroupTables:
        """The slot mapping and block table a layer of KV-cache group `group` reads."""
        if not 0 <= group < self.num_groups:
            raise ValueError(
                f"kv_cache_group={group} must be in [0, {self.num_groups}): attn_metadata "
                f"carries block tables for {self.num_groups} KV-cache group(s)"
            )
        return GroupTables(self.slot_mappings[group], self.block_tables[group])

    # -- contract v1's single-group spelling (docs/research_integration.md) -------------
    @property
    def slot_mapping(self) -> Any:  # i32[T]
        """Deprecated: group 0's slot mapping; use ``for_group(0).slot_mapping``.

        Contract v1 carried one slot mapping under this name. It still reads group 0's
        for a one-group step (with a DeprecationWarning); a step with several KV-cache
        groups raises AttributeError naming ``for_group(g)``.
        """
        return self._only_group("slot_mapping").slot_mapping

    @property
    def block_table(self) -> Any:  # i32[S, W]
        """Deprecated: group 0's block table; use ``for_group(0).block_table``.

        Contract v1 called it ``block_tables``, now the tuple of every group's tables;
        like ``slot_mapping``, this reads group 0's for a one-group step only.
        """
        return self._only_group("block_table").block_table

    @property
    def extra_slot_mappings(self) -> tuple[Any, ...]:
        """Removed (contract v1's groups 1..G-1): raises AttributeError naming for_group."""
        raise AttributeError(self._removed("extra_slot_mappings", "slot_mapping"))

    @property
    def extra_block_tables(self) -> tuple[Any, ...]:
        """Removed (contract v1's groups 1..G-1): raises AttributeError naming for_group."""
        raise AttributeError(self._removed("extra_block_tables", "block_table"))

    def _removed(self, name: str, field: str) -> str:
        return (
            f"attn_metadata.{name} was removed in model contract v2: this step carries "
            f"{self.num_groups} KV-cache group(s); a layer of group g reads "
            f"attn_metadata.for_group(g).{field} (docs/research_integration.md, "
            '"Model contract versions")'
        )

    def _only_group(self, name: str) -> GroupTables:
        if self.num_groups != 1:
            raise AttributeError(
                f"attn_metadata.{name} is contract v1's single-group spelling, but this step "
                f"carries {self.num_groups} KV-cache groups: a layer of group g reads "
                f"attn_metadata.for_group(g).{name} (docs/research_integration.md, "
                '"Model contract versions")'
            )
        warnings.warn(
            f"attn_metadata.{name} is deprecated (model contract v1): read "
            f"attn_metadata.for_group(0).{name}, which also serves models with several "
            "KV-cache groups",
            DeprecationWarning,
            stacklevel=3,
        )
        return self.for_group(0)


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
    # Structured outputs (None = no row constrained): bit t % 32 of word t // 32 of row s
    # allows token t (paged_jax.structured_outputs); all ones (-1) constrains nothing.
    bitmask: Any = None  # i32[S, W]; W = cdiv(vocab_size, 32)
    # SamplingParams.logprobs_mode (None = every row "raw_logprobs"): True where the row's
    # logprobs are read from the distribution it samples from (processed_logits).
    processed_logprobs: Any = None  # bool[S]


class TokenFeed(NamedTuple):
    """Where a step's placeholder tokens come from and where its samples go."""

    token_rows: Any  # i32[T]; row whose last sample is this token, -1 = host token
    sample_rows: Any  # i32[S]; row that keeps this sequence's sample, >= R = dropped


class SpecDecodeInput(NamedTuple):
    """A speculative step's drafts: k fixed per engine, padded to the num_seqs bucket S.

    Sequence s verifies its num_draft[s] drafts, its step tokens after the first; the
    step's ``attention.logits_indices`` then holds S * (k + 1) rows, sequence-major:
    row s * (k + 1) + j is the token whose logits predict position j (the last
    confirmed token for j = 0, draft j for j >= 1; repeated past num_draft[s]).
    """

    draft_token_ids: Any  # i32[S, k]; 0 pads
    num_draft: Any  # i32[S] in [0, k]
    ban_positions: Any  # i32[S]; positions j < this ban masked_token_ids (min_tokens)


class StepCopies(NamedTuple):
    """The step's copy-on-write block copies as device arrays, padded to a fixed width C.

    C = max_num_seqs x the number of KV-cache groups (``max_copies_per_step``): a
    scheduled sequence copies at most its shared partial block in each group.

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
    spec: SpecDecodeInput | None = None  # speculative engines: every step carries one
    # Multi-LoRA (EngineConfig.enable_lora): i32[T] adapter slot of each token row, -1 =
    # the base model; None = every row on the base model (the runner feeds a resident -1).
    lora_slots: Any = None
    # EngineConfig.steering_layers: per steerable layer and sequence the vector added to
    # the residual stream (zero rows: unsteered); None: no row steered (paged_jax.activations).
    steering: Any = None  # f32[J, S, hidden]
    # EngineConfig.enable_prompt_embeds: (f32[T, embed] rows, bool[T] mask) replacing the
    # embedding table's rows of prompt positions given as embeddings; None: no such row.
    prompt_embeds: Any = None

    @property
    def bucket(self) -> tuple[int, int]:
        """The (num_tokens, num_seqs) bucket of this step."""
        return int(self.token_ids.shape[0]), int(self.attention.seq_lens.shape[0])
