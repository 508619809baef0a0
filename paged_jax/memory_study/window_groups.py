"""Blocks held per request vs context length: full attention, a pure window, a Gemma-2-like hybrid.

Driven through the real KVCacheManager (SlidingWindowManager, HybridKVCacheCoordinator):
one request is prefilled in chunks, then decoded token by token; after every decode step
we record the real (non-null) blocks it holds per group. KV bytes follow the device
layout of paged_jax.models (layer k of every group shares tensor k), so one block id
costs `num_tensors` layers' worth of K and V.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from paged_jax.constants import cdiv
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.kv_cache_spec import KVCacheGroupSpec, kv_cache_groups_for_layers
from paged_jax.core.request import Request


@dataclasses.dataclass(frozen=True)
class Variant:
    """One attention layout: a name and its per-layer windows (None = full attention)."""

    name: str
    layer_windows: tuple[int | None, ...]

    @property
    def groups(self) -> tuple[KVCacheGroupSpec, ...]:
        return kv_cache_groups_for_layers(self.layer_windows)

    @property
    def num_tensors(self) -> int:
        """KV tensors on device (the largest group's layer count)."""
        return max(len(g.layer_ids) for g in self.groups)


def default_variants(num_layers: int, window: int) -> tuple[Variant, ...]:
    """Full attention, every layer windowed (Mistral), even layers windowed (Gemma 2)."""
    return (
        Variant("full attention", (None,) * num_layers),
        Variant(f"sliding window W={window}", (window,) * num_layers),
        Variant(
            f"Gemma-2-like hybrid (1:1, W={window})",
            tuple(window if i % 2 == 0 else None for i in range(num_layers)),
        ),
    )


def blocks_held_curve(
    variant: Variant,
    *,
    block_size: int,
    prompt_len: int,
    max_len: int,
    chunk: int,
    record_every: int = 1,
) -> dict[str, list[int]]:
    """Prefill prompt_len tokens in chunks of `chunk`, then decode to max_len.

    Every decode step is checked; the curve keeps context lengths that are multiples of
    record_every (and the last one).

    Returns:
        {"context_len": [...], "blocks_held": [...], "prefill_peak": [peak]}: after each
        decode step, the context length (tokens with KV) and the real blocks the request
        holds over all groups; and the most blocks held during the prefill.
    """
    num_blocks = len(variant.groups) * cdiv(max_len, block_size) + 2
    kv = KVCacheManager(
        num_blocks,
        block_size,
        max_model_len=max_len,
        enable_prefix_caching=False,
        kv_cache_groups=variant.groups,
    )
    req = Request("r", list(range(prompt_len)))
    prefill_peak = 0
    while req.num_computed_tokens < prompt_len:
        num_new = min(chunk, prompt_len - req.num_computed_tokens)
        assert kv.allocate_slots(req, num_new) is not None, "the pool is sized to fit"
        req.num_computed_tokens += num_new
        prefill_peak = max(prefill_peak, kv.get_num_blocks_held(req))
    context, held = [], []
    while req.num_tokens < max_len:
        req.append_output_token_ids(0)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        n = req.num_computed_tokens
        if n % record_every == 0 or req.num_tokens == max_len:
            context.append(n)
            held.append(kv.get_num_blocks_held(req))
    kv.check_invariants()
    return {"context_len": context, "blocks_held": held, "prefill_peak": [prefill_peak]}


def study(
    *,
    num_layers: int,
    window: int,
    block_size: int,
    prompt_len: int,
    max_len: int,
    chunk: int,
    table_lengths: Sequence[int],
    record_every: int = 64,
) -> dict:
    """Runs every variant; returns a JSON-ready dict with curves and a table.

    Table rows: per context length, blocks held and KV bytes relative to full attention
    (blocks x num_tensors / (full blocks x num_layers)).
    """
    variants = default_variants(num_layers, window)
    curves = {
        v.name: blocks_held_curve(
            v,
            block_size=block_size,
            prompt_len=prompt_len,
            max_len=max_len,
            chunk=chunk,
            record_every=record_every,
        )
        for v in variants
    }
    full_name = variants[0].name
    table = []
    for length in table_lengths:
        row: dict = {"context_len": length}
        full_blocks = _held_at(curves[full_name], length)
        for v in variants:
            blocks = _held_at(curves[v.name], length)
            row[v.name] = {
                "blocks_held": blocks,
                "kv_bytes_vs_full": blocks * v.num_tensors / (full_blocks * num_layers),
            }
        table.append(row)
    return {
        "params": dict(
            num_layers=num_layers,
            window=window,
            block_size=block_size,
            prompt_len=prompt_len,
            max_len=max_len,
            chunk=chunk,
            record_every=record_every,
        ),
        "variants": {
            v.name: {
                "layer_windows": list(v.layer_windows),
                "num_tensors": v.num_tensors,
                "bound_after_prefill": _window_bound(v, block_size, max_len),
            }
            for v in variants
        },
        "curves": curves,
        "table": table,
    }


def _held_at(curve: dict[str, list[int]], length: int) -> int:
    if length not in curve["context_len"]:
        raise ValueError(f"table length {length!r} must be a recorded context length")
    return curve["blocks_held"][curve["context_len"].index(length)]


def _window_bound(variant: Variant, block_size: int, max_len: int) -> int:
    """cdiv(W, bs) + 1 per window group plus every block of a full group at max_len."""
    total = 0
    for g in variant.groups:
        if g.sliding_window is None:
            total += cdiv(max_len, block_size)
        else:
            total += cdiv(g.sliding_window, block_size) + 1
    return total


def plot(result: dict, path) -> None:
    """Blocks held per request vs context length, one line per variant (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = result["params"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, curve in result["curves"].items():
        ax.plot(curve["context_len"], curve["blocks_held"], label=name)
        n_tensors = result["variants"][name]["num_tensors"]
        rel = [
            b * n_tensors / (f * p["num_layers"])
            for b, f in zip(curve["blocks_held"], result["curves"]["full attention"]["blocks_held"])
        ]
        ax2.plot(curve["context_len"], rel, label=name)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("KV blocks held by the request")
    ax.set_title(f"blocks held (block_size={p['block_size']}, W={p['window']})")
    ax.legend(fontsize=8)
    ax2.set_xlabel("context length (tokens)")
    ax2.set_ylabel("KV bytes / full attention's")
    ax2.set_title(f"KV bytes vs full attention ({p['num_layers']} layers)")
    ax2.set_ylim(0, 1.05)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
