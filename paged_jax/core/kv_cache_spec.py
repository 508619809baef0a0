"""KV-cache groups: which layers share a block table, and how that table ages (full or window).

One group per attention type (vLLM V1's KV-cache groups): every full-attention layer in
one group, every sliding-window layer of window W in another. All groups draw blocks from
one BlockPool; a request holds one block table per group. Pure Python; never imports jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from paged_jax.constants import cdiv, is_int


@dataclasses.dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group.

    Args:
        sliding_window: None for full attention; else the window W in tokens (a query at
            position q sees keys q - W + 1 .. q), so blocks wholly below it can be freed.
        layer_ids: the model layers in this group (their order is the device-tensor order).
    """

    sliding_window: int | None = None
    layer_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        w = self.sliding_window
        if w is not None and (not is_int(w) or w < 1):
            raise ValueError(f"KVCacheGroupSpec.sliding_window={w!r} must be None or an int >= 1")
        object.__setattr__(self, "layer_ids", tuple(int(i) for i in self.layer_ids))

    @property
    def kind(self) -> str:
        """ "full_attention" or "sliding_attention"."""
        return "full_attention" if self.sliding_window is None else "sliding_attention"

    def max_blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks a request holds in this group once its table covers num_tokens tokens
        and its newest query is the last of them (a decode step).

        Full attention: every block. Sliding window: only blocks touching the last W
        positions, at most cdiv(W - 1, block_size) + 1.
        """
        num_blocks = cdiv(num_tokens, block_size)
        if self.sliding_window is None or num_tokens == 0:
            return num_blocks
        first_needed = max(0, num_tokens - self.sliding_window) // block_size
        return num_blocks - first_needed


FULL_ATTENTION = KVCacheGroupSpec()


def kv_cache_groups_for_layers(
    layer_windows: Sequence[int | None],
) -> tuple[KVCacheGroupSpec, ...]:
    """Groups layers by attention type: full attention first, then windows ascending.

    Args:
        layer_windows: per layer, None (full attention) or its sliding window.

    Returns:
        One KVCacheGroupSpec per distinct window, e.g. Gemma 2 with 4 layers and W=4096:
        (KVCacheGroupSpec(None, (1, 3)), KVCacheGroupSpec(4096, (0, 2))).

    Raises:
        ValueError: if there are no layers or a window is not a positive int.
    """
    if not layer_windows:
        raise ValueError(f"layer_windows={layer_windows!r} must name at least one layer")
    by_window: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        by_window.setdefault(w, []).append(i)
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    return tuple(KVCacheGroupSpec(w, tuple(by_window[w])) for w in order)
