"""A minimal paged driver without a scheduler: block tables, step metadata, greedy decoding.

For parity checks (scripts/compare_hf.py, tests) before and besides the engine. It packs
steps exactly as the engine's StepInput does (padded T/S, slot -1, null block 0) and runs
the paged forward through `jit_forward_paged`, the split/merge + donation pattern.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from paged_jax.constants import NULL_BLOCK_ID, cdiv
from paged_jax.models.attention import AttentionMetadata, KVCache
from paged_jax.models.decoder import CausalLM


def make_attn_metadata(
    block_tables: Sequence[Sequence[int]],
    num_computed: Sequence[int],
    num_new: Sequence[int],
    *,
    block_size: int,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    max_blocks_per_seq: int | None = None,
) -> tuple[np.ndarray, AttentionMetadata]:  # i32[T] positions, metadata
    """Packs one step: sequence i has num_computed[i] cached tokens and num_new[i] new ones.

    Args:
        block_tables: per sequence, its block ids in token order (enough for all its tokens).
        num_computed: tokens of each sequence already in the cache.
        num_new: tokens of each sequence in this step.
        block_size: tokens per block.
        num_tokens: padded T (default: sum of num_new).
        num_seqs: padded S (default: number of sequences).
        max_blocks_per_seq: padded table width W (default: the longest table).

    Returns:
        positions i32[T] and the AttentionMetadata of one KV-cache group, padded as the
        engine pads.
    """
    total = int(sum(num_new))
    num_tokens = num_tokens or total
    num_seqs = num_seqs or len(block_tables)
    width = max_blocks_per_seq or max(len(table) for table in block_tables)
    if total > num_tokens or len(block_tables) > num_seqs:
        raise ValueError(f"num_tokens={num_tokens}, num_seqs={num_seqs} too small for the step")
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.full(num_tokens, -1, np.int32)
    tables = np.full((num_seqs, width), NULL_BLOCK_ID, np.int32)
    seq_lens = np.zeros(num_seqs, np.int32)
    query_start_loc = np.full(num_seqs + 1, total, np.int32)
    logits_indices = np.zeros(num_seqs, np.int32)
    start = 0
    for i, (table, computed, new) in enumerate(zip(block_tables, num_computed, num_new)):
        pos = np.arange(computed, computed + new, dtype=np.int32)
        assert len(table) * block_size >= computed + new, "block table too short: caller bug"
        positions[start : start + new] = pos
        slot_mapping[start : start + new] = np.asarray(table)[pos // block_size] * block_size + (
            pos % block_size
        )
        tables[i, : len(table)] = table
        seq_lens[i] = computed + new
        query_start_loc[i] = start
        start += new
        logits_indices[i] = max(start - 1, 0)  # a sequence with no new tokens: ignored
    metadata = AttentionMetadata(
        (slot_mapping,), (tables,), seq_lens, query_start_loc, logits_indices
    )
    return positions, metadata


def jit_forward_paged(
    model: CausalLM, *, attention_backend: str | None = None
) -> Callable[..., tuple[jax.Array, list[KVCache]]]:
    """The engine's pattern: split once, jit a pure function that merges, donate the caches.

    Returns:
        step(token_ids, positions, kv_caches, attn_metadata, kv_scales=None) -> (logits,
        kv_caches); the kv_caches passed in are donated (invalid after the call);
        kv_scales f32[num_layers, 2] for fp8 caches is a traced argument.
    """
    graphdef, state = nnx.split(model)

    def pure_step(state, token_ids, positions, kv_caches, attn_metadata, kv_scales):
        extra = {} if kv_scales is None else {"kv_scales": kv_scales}
        return nnx.merge(graphdef, state).forward_paged(
            token_ids,
            positions,
            kv_caches,
            attn_metadata,
            attention_backend=attention_backend,
            **extra,
        )

    jitted = jax.jit(pure_step, donate_argnums=(3,))
    return lambda *args, kv_scales=None: jitted(state, *args, kv_scales)


def greedy_generate_paged(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    block_size: int = 4,
    prefill_chunk: int | None = None,
    attention_backend: str | None = None,
    seed: int = 0,
    kv_cache_dtype: Any = None,
    kv_scales: np.ndarray | None = None,
    forced_tokens: Sequence[Sequence[int]] | None = None,
) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy continuation of every prompt: chunked prefill of all prompts, then decode.

    Blocks are handed out from a seeded permutation of ids 1..num_blocks-1, so tables are
    not contiguous; block 0 stays the null block. kv_cache_dtype (None: the model's) and
    kv_scales f32[num_layers, 2] select an fp8 cache; forced_tokens (per prompt, at least
    max_new_tokens ids) are fed instead of the argmax (teacher forcing), so the logits of
    two caches can be compared along one token path. A model with several KV-cache groups
    (full + sliding window) gets one table per group from the same pool (no recycling:
    the kernels read only the window).

    Returns:
        (generated token ids per prompt, per prompt f32[max_new_tokens, vocab] the logits
        each generated token was picked from).
    """
    lengths = [len(p) + max_new_tokens for p in prompts]
    blocks_needed = [cdiv(n, block_size) for n in lengths]
    num_groups = len(model.kv_cache_groups())
    num_blocks = num_groups * sum(blocks_needed) + 1
    free = list(np.random.default_rng(seed).permutation(np.arange(1, num_blocks)))
    group_tables = [
        [[int(free.pop()) for _ in range(n)] for n in blocks_needed] for _ in range(num_groups)
    ]
    width = max(blocks_needed)
    step = jit_forward_paged(model, attention_backend=attention_backend)
    kv_caches = model.init_kv_caches(num_blocks, block_size, kv_cache_dtype)
    if kv_scales is not None:
        kv_scales = jax.numpy.asarray(kv_scales, jax.numpy.float32)
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    logits_seen: list[list[np.ndarray]] = [[] for _ in prompts]
    chunk = prefill_chunk or max(len(p) for p in prompts)
    # One padded T for every step (one compilation, as an engine bucket); decode steps
    # exercise the padding rows.
    num_tokens = cdiv(chunk * len(prompts), 8) * 8
    while min(len(t) - len(p) for t, p in zip(tokens, prompts)) < max_new_tokens:
        new = [min(len(t) - c, chunk) for t, c in zip(tokens, computed)]
        step_ids = np.zeros(num_tokens, np.int32)
        step_ids[: sum(new)] = np.concatenate(
            [np.asarray(t[c : c + n], np.int32) for t, c, n in zip(tokens, computed, new)]
        )
        packed = [
            make_attn_metadata(
                tables,
                computed,
                new,
                block_size=block_size,
                num_tokens=num_tokens,
                max_blocks_per_seq=width,
            )
            for tables in group_tables
        ]
        positions, metadata = packed[0]
        metadata = dataclasses.replace(  # one slot mapping and table per group
            metadata,
            slot_mappings=tuple(m.slot_mappings[0] for _, m in packed),
            block_tables=tuple(m.block_tables[0] for _, m in packed),
        )
        logits, kv_caches = step(step_ids, positions, kv_caches, metadata, kv_scales=kv_scales)
        logits = np.asarray(logits)
        for i, n in enumerate(new):
            computed[i] += n
            if computed[i] == len(tokens[i]) and len(tokens[i]) < lengths[i]:
                logits_seen[i].append(logits[i])
                j = len(tokens[i]) - len(prompts[i])
                forced = forced_tokens is not None
                tokens[i].append(int(forced_tokens[i][j] if forced else np.argmax(logits[i])))
    generated = [t[len(p) :] for t, p in zip(tokens, prompts)]
    return generated, [np.stack(seen) for seen in logits_seen]
