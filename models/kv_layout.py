"""Which KV-cache group and which device tensor each layer uses (host side, no jax).

    Gemma-2-like, 4 layers (even layers slide):   groups: full (1, 3), window (0, 2)
    layer      0       1       2       3
    group      window  full    window  full
    tensor     0       0       1       1          -> 2 tensors instead of 4

Block ids of different groups never overlap (one shared BlockPool), so layer k of every
group can share tensor k: a block id's page in tensor k holds layer k of the group that
owns the block. This is vLLM V1's layout (tensor i shared by layer i of every group).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from paged_jax.core.kv_cache_spec import KVCacheGroupSpec, kv_cache_groups_for_layers


@dataclasses.dataclass(frozen=True)
class KVCacheLayout:
    """Per-layer KV-cache group and device tensor.

    Attributes:
        groups: one KVCacheGroupSpec per group (full attention first).
        group_of_layer: per layer, its group index.
        tensor_of_layer: per layer, its KV tensor (its index within its group).
        num_tensors: the largest group's layer count.
    """

    groups: tuple[KVCacheGroupSpec, ...]
    group_of_layer: tuple[int, ...]
    tensor_of_layer: tuple[int, ...]
    num_tensors: int


def kv_cache_layout(layer_windows: Sequence[int | None]) -> KVCacheLayout:
    """The layout for per-layer windows (None = full attention)."""
    groups = kv_cache_groups_for_layers(layer_windows)
    group_of_layer = [0] * len(layer_windows)
    tensor_of_layer = [0] * len(layer_windows)
    for g, group in enumerate(groups):
        for k, layer in enumerate(group.layer_ids):
            group_of_layer[layer] = g
            tensor_of_layer[layer] = k
    return KVCacheLayout(
        groups,
        tuple(group_of_layer),
        tuple(tensor_of_layer),
        max(len(g.layer_ids) for g in groups),
    )
