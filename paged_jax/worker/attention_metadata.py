"""AttentionMetadata: where a paged step's new tokens go and what they attend to.

The input batch builds it as numpy on the host (this module never imports jax); the
model's layers read it under jit. A model with several KV-cache groups (full attention
and sliding windows) has one block table and one slot mapping per group, and a layer
reads its own group's through ``for_group``:

    slot_mappings = (i32[T] group 0, i32[T] group 1, ...)
    block_tables  = (i32[S, W] group 0, i32[S, W] group 1, ...)
    layer of group g:  slot_mapping, block_table = attn_metadata.for_group(g)

It is a pytree whose flags are static (``paged_jax.models.attention`` registers it).
"""

from __future__ import annotations

import dataclasses
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
