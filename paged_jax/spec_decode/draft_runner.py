"""DraftRunner: a small draft model's weights, its own paged KV cache, and its two jitted programs.

The draft keeps a KV cache of its own (same block count and block size as the target's
pool) and is addressed by the target's block tables and slot mappings, so the host
side (scheduler, block pool) serves both models with one set of tables:

    target step t   tokens [x d1 .. dk] at positions p .. p+k   (target KV written)
    catch_up(step)  the same StepInput through the draft          (draft KV written)
    propose(...)    from each row's next token b at position q:
                    k one-token draft steps at q, q+1, .. q+k-1  (draft KV written at
                    the lookahead slots the scheduler allocated) -> d'1 .. d'k

Both programs take fixed shapes (catch_up: the step's (T, S) bucket, its block copies
first; propose: R = max_num_seqs rows, one per input-batch row) and are built in
``warmup``; the caches are donated to each call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.config import EngineConfig
from paged_jax.models.attention import AttentionMetadata  # registered as a pytree there
from paged_jax.spec_decode.proposer import DRAFT_KEY_TAG
from paged_jax.worker.rejection_sampler import filtered_probs
from paged_jax.worker.runner import copy_kv_blocks, counting_compiles, feed_tokens
from paged_jax.worker.step_input import StepInput


class DraftSampling(NamedTuple):
    """Per-row settings the draft samples with, one per input-batch row (a pytree of arrays)."""

    temperature: Any  # f32[R]; 0 = greedy (argmax; q is then one-hot)
    top_k: Any  # i32[R]; 0 = off
    top_p: Any  # f32[R]; 1 = off
    min_p: Any  # f32[R]; 0 = off
    seeds: Any  # u32[R]


class DraftProposal(NamedTuple):
    """What ``DraftRunner.propose`` returns, on device."""

    token_ids: jax.Array  # i32[R, k]; 0 on rows without a proposal
    probs: jax.Array  # f32[R, k, V]; q, the distribution each token was drawn from


def draft_distribution(
    logits: jax.Array,  # f32[S, V]
    temperature: jax.Array,  # f32[S]
    top_k: jax.Array,  # i32[S]
    top_p: jax.Array,  # f32[S]
    min_p: jax.Array,  # f32[S]
) -> jax.Array:  # f32[S, V], rows sum to 1
    """The distribution the target's sampler would draw from, applied to draft logits.

    Temperature, top-k, top-p and min-p by the engine sampler's rule
    (rejection_sampler.filtered_probs); a greedy row (temperature 0) is one-hot at its
    argmax. Penalties, bans and grammar masks are left out on purpose: the proposal may
    be any distribution, rejection sampling against the target's p keeps the output exact.
    """
    logits = logits.astype(jnp.float32)
    # The per-row sort behind the filters is skipped at run time on an all-greedy batch
    # (both branches compile once), as the engine's sampler does.
    sampled_q = jax.lax.cond(
        jnp.any(temperature > 0),
        lambda: jax.vmap(filtered_probs)(logits, temperature, top_k, top_p, min_p),
        lambda: jnp.zeros_like(logits),
    )
    greedy_q = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where((temperature > 0)[:, None], sampled_q, greedy_q)


def lookahead_slots(
    block_table: jax.Array,  # i32[S, W]
    positions: jax.Array,  # i32[S]
    active: jax.Array,  # bool[S]
    block_size: int,
) -> jax.Array:  # i32[S]
    """Cache slot of each row's token at ``positions``, -1 (write dropped) where the row
    has no proposal, the position is past the table or its block is not allocated (the
    null block 0 stands there)."""
    width = block_table.shape[1]
    index = positions // block_size
    block = jnp.take_along_axis(block_table, jnp.clip(index, 0, width - 1)[:, None], axis=1)[:, 0]
    ok = active & (index < width) & (block > 0)
    return jnp.where(ok, block * block_size + positions % block_size, -1).astype(jnp.int32)


def draft_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """One PRNG key per row for the draft token at ``positions`` (a function of the
    request's seed and the position only: the same request proposes the same way in
    any batch)."""

    def key(seed, pos):
        return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), pos), DRAFT_KEY_TAG)

    return jax.vmap(key)(seeds, positions)


class DraftRunner:
    """A draft model on device: weights, its own paged KV caches, catch-up and propose.

    Args:
        model: the draft, a ``paged_jax.models`` model (an NNX module) with one
            full-attention KV-cache group.
        config: the target's resolved EngineConfig (block size, max_num_seqs, backend).
        num_kv_blocks: the target's pool size: the draft cache has as many blocks, so
            the target's block ids address it.
        num_speculative_tokens: k, draft tokens per proposal.
        replicated: a sharding (the target's mesh, replicated) that the weights, the
            caches and every output live on under tensor parallelism; None: one device.
            The draft is small, so it is replicated rather than split.

    ``propose`` runs over R = max_num_seqs rows indexed by input-batch row, the layout
    the rejection sampler reads draft_probs in: one program, whatever the batch.
    """

    def __init__(
        self,
        model: Any,
        config: EngineConfig,
        num_kv_blocks: int,
        num_speculative_tokens: int,
        *,
        replicated: Any = None,
    ):
        if not isinstance(model, nnx.Module):
            raise ValueError(f"draft model={type(model).__name__} must be a Flax NNX module")
        self.config = config
        self.num_speculative_tokens = k = int(num_speculative_tokens)
        self.num_kv_blocks = int(num_kv_blocks)
        self.num_rows = int(config.max_num_seqs)
        self.vocab_size = int(model.config.vocab_size)
        self.num_compiles = 0  # counting_compiles: backend compiles of this runner's calls
        self.programs: dict[Any, Any] = {}
        block_size = config.block_size
        graphdef, weights = nnx.split(model)
        caches = model.init_kv_caches(self.num_kv_blocks, block_size)
        # The catch-up's fed-token slots: the engine speculates synchronously, so every
        # token is a host token (token_rows -1) and this never changes.
        row_tokens = np.zeros(self.num_rows, np.int32)
        if replicated is not None:
            weights = jax.device_put(weights, replicated)
            caches = jax.device_put(caches, replicated)
        self.weights, self.kv_caches = weights, caches
        # sleep / wake_up: the caches are rebuilt by the calls that built them (no compile).
        self._replicated = replicated
        self._make_caches = lambda: model.init_kv_caches(self.num_kv_blocks, block_size)
        self._host_weights: Any = None  # the weights while asleep
        self.row_tokens = jax.device_put(row_tokens, replicated)
        backend = config.attention_backend
        out = {} if replicated is None else dict(out_shardings=replicated)

        def catch_up_fn(
            weights, kv_caches, row_tokens, token_ids, positions, attention, rows, copies
        ):
            # The step's copy-on-write copies first, as in the target's cache (padding
            # entries, dst -1, copy nothing): a block a fork copied holds draft KV too.
            kv_caches = copy_kv_blocks(kv_caches, copies, attention_backend=backend)
            m = nnx.merge(graphdef, weights)
            token_ids = feed_tokens(row_tokens, token_ids, rows)
            hidden, kv_caches = m.forward_paged_hidden(
                token_ids, positions, kv_caches, attention, attention_backend=backend
            )
            del hidden  # only the KV it wrote is wanted
            return kv_caches

        def propose_fn(weights, kv_caches, tokens, positions, block_table, active, sampling):
            # tokens i32[R] (each row's next token), positions i32[R] (its position),
            # block_table i32[R, W], active bool[R], sampling DraftSampling of [R].
            m = nnx.merge(graphdef, weights)
            num_rows = tokens.shape[0]
            rows = jnp.arange(num_rows, dtype=jnp.int32)
            start = jnp.where(active, positions, 0)

            def one_step(carry, i):  # draft token i: one new token per row
                kv_caches, tokens = carry
                pos = start + i
                slot = lookahead_slots(block_table, pos, active, block_size)
                attention = AttentionMetadata(
                    slot_mappings=(slot,),
                    block_tables=(block_table,),
                    # A row without a proposal attends to its one slot (finite, unused).
                    seq_lens=jnp.where(active, pos + 1, 1).astype(jnp.int32),
                    query_start_loc=jnp.arange(num_rows + 1, dtype=jnp.int32),
                    logits_indices=rows,
                    decode_only=True,
                )
                logits, kv_caches = m.forward_paged(
                    tokens, pos, kv_caches, attention, attention_backend=backend
                )
                q = draft_distribution(
                    logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p
                )
                keys = draft_keys(sampling.seeds, pos)
                drawn = jax.vmap(jax.random.categorical)(keys, jnp.log(q)).astype(jnp.int32)
                tokens = jnp.where(active, drawn, 0)
                return (kv_caches, tokens), (tokens, q)

            # A scan: one traced body whatever k (compile time does not grow with k).
            (kv_caches, _), (drafted, dists) = jax.lax.scan(
                one_step, (kv_caches, tokens), jnp.arange(k, dtype=jnp.int32)
            )
            proposal = DraftProposal(jnp.swapaxes(drafted, 0, 1), jnp.swapaxes(dists, 0, 1))
            return kv_caches, proposal

        self.jitted_catch_up = jax.jit(catch_up_fn, donate_argnums=(1,), **out)
        self.jitted_propose = jax.jit(propose_fn, donate_argnums=(1,), **out)

    # ------------------------------------------------------------------ calls
    @staticmethod
    def catch_up_attention(step: StepInput) -> AttentionMetadata:
        """The step's attention for the draft: one program per bucket (decode_only off, so
        the target's decode-only variants need no draft program of their own; the range checks
        of EngineConfig.validate stay with the target, which reads the same tables)."""
        return dataclasses.replace(step.attention, decode_only=False, validate=False)

    def catch_up_args(self, step: StepInput) -> tuple:
        return (
            self.weights,
            self.kv_caches,
            self.row_tokens,
            step.token_ids,
            step.positions,
            self.catch_up_attention(step),
            step.feed.token_rows,
            step.copies,
        )

    @counting_compiles
    def catch_up(self, step: StepInput) -> None:
        """Runs a target step's tokens through the draft, writing its KV at the step's slots
        (after the step's copy-on-write copies, as in the target's cache)."""
        program = self.programs.get(("catch_up", *step.bucket), self.jitted_catch_up)
        self.kv_caches = program(*self.catch_up_args(step))

    @counting_compiles
    def propose(
        self,
        tokens: Any,  # i32[R]
        positions: Any,  # i32[R]
        block_table: Any,  # i32[R, W]
        active: Any,  # bool[R]
        sampling: DraftSampling,  # [R]
    ) -> DraftProposal:
        """k draft tokens per active row, from its next token at its position (on device).

        The draft's KV of positions ``positions .. positions + k - 1`` is written at the
        slots the rows' tables give (the scheduler's lookahead); rows with ``active``
        False write nothing and propose zeros.
        """
        program = self.programs.get("propose", self.jitted_propose)
        self.kv_caches, proposal = program(
            self.weights, self.kv_caches, tokens, positions, block_table, active, sampling
        )
        return proposal

    # ------------------------------------------------------------------ sleep
    @counting_compiles
    def sleep(self) -> None:
        """Hands the device memory back: the weights to host memory (the target's
        update_weights never supplies a draft's), the KV caches deleted."""
        self._host_weights = jax.device_get(self.weights)
        for x in jax.tree.leaves((self.weights, self.kv_caches)):
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
        self.weights = self.kv_caches = None

    @counting_compiles
    def wake_up(self) -> None:
        """The weights back on the device (as they were placed) and zeroed KV caches."""
        if self._host_weights is None:
            return
        replicated = self._replicated
        caches = self._make_caches()
        if replicated is None:
            self.weights = jax.device_put(self._host_weights)
        else:
            self.weights = jax.device_put(self._host_weights, replicated)
            caches = jax.device_put(caches, replicated)
        self.kv_caches, self._host_weights = caches, None

    # ------------------------------------------------------------------ warm-up
    def padding_propose_args(self) -> tuple:
        """All-padding propose inputs over the R rows (nothing is written)."""
        r, width = self.num_rows, self.config.max_blocks_per_seq
        zeros = np.zeros(r, np.int32)
        sampling = DraftSampling(
            np.zeros(r, np.float32),
            zeros,
            np.ones(r, np.float32),
            np.zeros(r, np.float32),
            np.zeros(r, np.uint32),
        )
        return (zeros, zeros, np.zeros((r, width), np.int32), np.zeros(r, bool), sampling)

    @counting_compiles
    def warmup(self, steps: Iterable[StepInput]) -> list[str]:
        """Compiles and runs, on padding (no KV changes), catch_up for every step bucket
        among ``steps`` and propose; returns the programs' names."""
        names = []
        steps = list(steps)
        for step in steps:
            key = ("catch_up", *step.bucket)
            if key not in self.programs:
                self.programs[key] = self.jitted_catch_up.lower(*self.catch_up_args(step)).compile()
                self.catch_up(step)
                names.append(f"draft catch-up tokens={step.bucket[0]} seqs={step.bucket[1]}")
        if "propose" not in self.programs:
            args = self.padding_propose_args()
            self.programs["propose"] = self.jitted_propose.lower(
                self.weights, self.kv_caches, *args
            ).compile()
            jax.block_until_ready(self.propose(*args))
            names.append(f"draft propose rows={self.num_rows} k={self.num_speculative_tokens}")
        return names
