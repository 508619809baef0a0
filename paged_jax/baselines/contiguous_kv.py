"""Contiguous-KV baseline: the pre-PagedAttention design, for the engine benchmark.

Each admitted request reserves one contiguous run of token slots up front, sized by a
reservation policy (the paper's Orca baselines): "max" = max_model_len, "pow2" = the
next power of two >= its prompt + output, "oracle" = exactly prompt + output. The
reservations are placed first-fit in a KV address space of the budget's size
(`paged_jax.memory_study.allocators.FirstFitSpace`), so external fragmentation is real.
Batching is continuous: a request is admitted when its reservation fits.

    cache per layer: k, v f[rows, max_model_len, num_kv_heads, head_dim]
    row r: |prompt ... generated ...|... unused ...|
           ^ 0                      ^ kv_len

A request's reservation decides admission; its tokens live in its own cache row (for
"max" the rows are exactly the budget; for "pow2"/"oracle" the rows are padded to
max_model_len, which costs memory here but no time, see below).

Attention reads only the live context, the same bound the paged engine's CPU path
uses: decode attends over the first ceil((longest kv_len + 1) / 128) * 128 slots of the
first (power-of-two bucket of) occupied rows, prefill over its prompt's bucket. Prefill
runs one admitted request at a time (prompt padded to a power-of-two bucket). Both are
jitted once per shape and reuse the paged_jax model's own embedding, layers
(projections, rotary, norms, MLP) and head; only the attention core reads the dense cache.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.baselines.workload import TraceRequest
from paged_jax.memory_study.allocators import POLICIES, FirstFitSpace, reservation_size

MIN_PREFILL_BUCKET = 16
KV_CHUNK = 128  # decode reads the live context rounded up to this many slots
MIN_DECODE_ROWS = 8


def max_concurrent_for_budget(budget_bytes: int, max_model_len: int, bytes_per_token: int) -> int:
    """Requests a contiguous cache holds at once: each reserves max_model_len token slots."""
    per_request = max_model_len * bytes_per_token
    if budget_bytes < per_request:
        raise ValueError(
            f"budget_bytes={budget_bytes!r} must hold one request's reservation of "
            f"max_model_len={max_model_len} x {bytes_per_token} bytes = {per_request}"
        )
    return budget_bytes // per_request


def kv_bytes_per_token(model: Any) -> int:
    """Bytes one token's K and V take across all layers (the paged pool's per-token cost)."""
    return int(model.kv_bytes_per_block(1))


def _dense_cached_attention(
    q: jax.Array,  # f[batch, q_len, num_heads, head_dim]
    k_cache: jax.Array,  # f[batch, max_len, num_kv_heads, head_dim]
    v_cache: jax.Array,  # f[batch, max_len, num_kv_heads, head_dim]
    q_pos: jax.Array,  # i32[batch, q_len]
    *,
    scale: float,
    sliding_window: int | None,
) -> jax.Array:  # f[batch, q_len, num_heads, head_dim]
    """Query at position p sees cache rows j <= p (and p - j < window); rows past it are stale."""
    batch, q_len, num_heads, head_dim = q.shape
    max_len, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(batch, q_len, num_kv_heads, num_heads // num_kv_heads, head_dim)
    s = jnp.einsum("bqkgd,bmkd->bkgqm", qg, k_cache, preferred_element_type=jnp.float32) * scale
    key_pos = jnp.arange(max_len, dtype=jnp.int32)
    visible = key_pos[None, None, :] <= q_pos[:, :, None]  # bool[batch, q_len, max_len]
    if sliding_window is not None:
        visible &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(visible[:, None, None], p, 0.0)  # all-masked padding rows: 0, not NaN
    o = jnp.einsum("bkgqm,bmkd->bqkgd", p, v_cache.astype(jnp.float32))
    return o.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)


def _forward_dense_cache(
    model: Any,
    token_ids: jax.Array,  # i32[batch, q_len]
    positions: jax.Array,  # i32[batch, q_len]; >= max_len: padding (write dropped)
    kv_caches: list[tuple[jax.Array, jax.Array]],  # per layer f[slots, max_len, kv_heads, dim]
    rows: jax.Array | None,  # i32[batch] cache slot of each batch row; None: row b = slot b
    logits_index: jax.Array,  # i32[batch] query row whose logits are returned
    bound: int,  # static: attention reads only cache columns [0, bound)
) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:  # f32[batch, vocab], caches
    """The model's forward with each layer's attention reading/writing a dense slot cache."""
    x = model.embed(token_ids, positions)
    write_rows = (rows if rows is not None else jnp.arange(token_ids.shape[0]))[:, None]
    new_caches = []
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
        attn = layer.attn

        def attend(h, attn=attn, k_cache=k_cache, v_cache=v_cache):
            q, k, v = attn.qkv(h, positions)
            k_cache = k_cache.at[write_rows, positions].set(k.astype(k_cache.dtype), mode="drop")
            v_cache = v_cache.at[write_rows, positions].set(v.astype(v_cache.dtype), mode="drop")
            if rows is None:  # decode: the first `batch` rows
                k_rows = k_cache[: token_ids.shape[0], :bound]
                v_rows = v_cache[: token_ids.shape[0], :bound]
            else:
                k_rows, v_rows = k_cache[rows, :bound], v_cache[rows, :bound]
            out = _dense_cached_attention(
                q,
                k_rows,
                v_rows,
                positions,
                scale=attn.scale,
                sliding_window=attn.sliding_window,
            )
            out = attn.o_proj(out.reshape(*h.shape[:-1], attn.num_heads * attn.head_dim))
            return out, (k_cache, v_cache)

        x, cache = layer.apply(x, attend)
        new_caches.append(cache)
    last = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]
    return model.logits(last), new_caches


class ContiguousKVRunner:
    """Dense per-slot KV caches on device and the jitted greedy prefill / decode steps.

    Args:
        model: a paged_jax.models model (its weights are shared, not copied).
        max_concurrent: cache slots (requests that can run at once).
        max_model_len: token slots reserved per request.
    """

    def __init__(self, model: Any, max_concurrent: int, max_model_len: int):
        cfg = model.config
        self.max_concurrent = max_concurrent
        self.max_model_len = max_model_len
        dtype = jnp.dtype(cfg.dtype)
        shape = (max_concurrent, max_model_len, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_hidden_layers)
        ]
        self.cache_bytes = 2 * cfg.num_hidden_layers * int(np.prod(shape)) * dtype.itemsize
        graphdef, self.weights = nnx.split(model)

        def prefill(weights, kv_caches, token_ids, positions, slot, last):
            m = nnx.merge(graphdef, weights)
            logits, kv_caches = _forward_dense_cache(
                m, token_ids, positions, kv_caches, slot[None], last[None], token_ids.shape[1]
            )
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)[0], kv_caches

        def decode(weights, kv_caches, token_ids, positions, bound):
            m = nnx.merge(graphdef, weights)
            zeros = jnp.zeros(token_ids.shape[0], jnp.int32)
            logits, kv_caches = _forward_dense_cache(
                m, token_ids[:, None], positions[:, None], kv_caches, None, zeros, bound
            )
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), kv_caches

        # The jitted steps (prefill/decode below pad and call them); caches donated.
        self.prefill_step = jax.jit(prefill, donate_argnums=(1,))
        self.decode_step = jax.jit(decode, donate_argnums=(1,), static_argnums=(4,))

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """Padded prompt lengths: powers of two from 16, then max_model_len."""
        buckets, b = [], MIN_PREFILL_BUCKET
        while b < self.max_model_len:
            buckets.append(b)
            b *= 2
        return (*buckets, self.max_model_len)

    def prefill(self, slot: int, prompt_token_ids: list[int] | tuple[int, ...]) -> int:
        """Writes the prompt's K/V into `slot`; returns the greedy next token."""
        n = len(prompt_token_ids)
        bucket = next(b for b in self.prefill_buckets if b >= n)
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :n] = prompt_token_ids
        positions = np.full((1, bucket), self.max_model_len, np.int32)  # padding: dropped
        positions[0, :n] = np.arange(n)
        token, self.kv_caches = self.prefill_step(
            self.weights, self.kv_caches, tokens, positions, np.int32(slot), np.int32(n - 1)
        )
        return int(token)

    @property
    def decode_row_buckets(self) -> tuple[int, ...]:
        """Rows a decode step computes: powers of two from 8, then all rows."""
        buckets, b = [], MIN_DECODE_ROWS
        while b < self.max_concurrent:
            buckets.append(b)
            b *= 2
        return (*buckets, self.max_concurrent)

    @property
    def decode_bounds(self) -> tuple[int, ...]:
        """Cache columns a decode step reads: multiples of KV_CHUNK, then max_model_len."""
        return tuple(
            sorted(
                {
                    min(c, self.max_model_len)
                    for c in range(KV_CHUNK, self.max_model_len + KV_CHUNK, KV_CHUNK)
                }
            )
        )

    def decode(
        self,
        token_ids: np.ndarray,  # i32[n]; n = the number of leading rows decoded
        positions: np.ndarray,  # i32[n]; max_model_len for idle rows
    ) -> np.ndarray:  # i32[n]
        """One token for each of the first n rows; idle rows' results are garbage, writes dropped.

        n is padded to a decode row bucket and the attention reads only the columns up to
        the longest live position, rounded up to a KV_CHUNK multiple.
        """
        n = len(token_ids)
        rows = next(b for b in self.decode_row_buckets if b >= n)
        live = positions[positions < self.max_model_len]
        top = int(live.max()) + 1 if live.size else 1
        bound = next(b for b in self.decode_bounds if b >= top)
        tok = np.zeros(rows, np.int32)
        pos = np.full(rows, self.max_model_len, np.int32)
        tok[:n], pos[:n] = token_ids, positions
        tokens, self.kv_caches = self.decode_step(self.weights, self.kv_caches, tok, pos, bound)
        return np.asarray(jax.device_get(tokens))[:n]

    def warmup(self) -> int:
        """Compiles every prefill bucket and every decode (rows, bound) shape; returns the count."""
        for rows in self.decode_row_buckets:
            for bound in self.decode_bounds:
                idle = np.full(rows, self.max_model_len, np.int32)
                _, self.kv_caches = self.decode_step(
                    self.weights, self.kv_caches, np.zeros(rows, np.int32), idle, bound
                )
        for bucket in self.prefill_buckets:
            tokens = np.zeros((1, bucket), np.int32)
            positions = np.full((1, bucket), self.max_model_len, np.int32)  # all writes dropped
            _, self.kv_caches = self.prefill_step(
                self.weights, self.kv_caches, tokens, positions, np.int32(0), np.int32(0)
            )
        jax.block_until_ready(self.kv_caches)
        return len(self.decode_row_buckets) * len(self.decode_bounds) + len(self.prefill_buckets)


@dataclasses.dataclass
class _Slot:
    req: TraceRequest
    output: list[int]
    first_token_time: float
    start: int  # first token slot of its reservation in the address space

    @property
    def kv_len(self) -> int:
        """Tokens whose K/V are in the cache (the newest sampled token is not yet)."""
        return self.req.num_prompt_tokens + len(self.output) - 1


@dataclasses.dataclass
class ContiguousOutput:
    """One finished request of the contiguous baseline."""

    request_id: str
    token_ids: list[int]
    first_token_time: float
    finish_time: float


class ContiguousKVEngine:
    """FCFS continuous batching over contiguous reservations; greedy, fixed output lengths.

    Each step admits waiting requests, in order, while their reservations fit the address
    space (head-of-line blocking; one prefill each), then decodes one token for every
    running request. Utilization is sampled after every step.

    Args:
        model: a paged_jax.models model.
        budget_bytes: KV memory budget: budget // bytes_per_token token slots.
        max_model_len: the longest request (prompt + output).
        policy: reservation size, one of POLICIES ("max", "pow2", "oracle").
        max_num_seqs: most requests running at once (cache rows) for "pow2"/"oracle";
            "max" gets exactly the budget's budget // (max_model_len * bytes) rows.
        runner: a compiled runner to reuse (repeated benchmark runs).
    """

    def __init__(
        self,
        model: Any,
        budget_bytes: int,
        max_model_len: int,
        *,
        policy: str = "max",
        max_num_seqs: int = 64,
        runner: ContiguousKVRunner | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} must be one of {POLICIES}")
        self.bytes_per_token = kv_bytes_per_token(model)
        self.policy = policy
        if policy == "max":
            self.max_concurrent = max_concurrent_for_budget(
                budget_bytes, max_model_len, self.bytes_per_token
            )
        else:
            self.max_concurrent = max_num_seqs
        self.max_model_len = max_model_len
        self.space = FirstFitSpace(budget_bytes // self.bytes_per_token)
        if runner is None:
            runner = ContiguousKVRunner(model, self.max_concurrent, max_model_len)
        assert runner.max_concurrent == self.max_concurrent, "a reused runner must match"
        self.runner = runner  # reusable across engines: its caches are overwritten per request
        self.waiting: collections.deque[TraceRequest] = collections.deque()
        self.slots: list[_Slot | None] = [None] * self.max_concurrent
        self.num_steps = 0
        self.max_running = 0
        self.used_token_slots = 0  # summed over steps
        self.reserved_token_slots = 0  # summed over steps
        self.num_computed_tokens = 0  # real token rows through the model
        self.num_padded_tokens = 0  # rows including bucket padding and idle decode slots

    def reservation(self, req: TraceRequest) -> int:
        """Token slots the policy reserves for the request (its K/V: prompt + output - 1)."""
        kv_len = req.num_prompt_tokens + req.num_output_tokens - 1
        return reservation_size(
            self.policy, kv_len, self.max_model_len, output_len=req.num_output_tokens
        )

    def add_request(self, req: TraceRequest) -> None:
        """Queues a request; its prompt + output must fit max_model_len."""
        if req.num_prompt_tokens + req.num_output_tokens > self.max_model_len:
            raise ValueError(
                f"request {req.request_id!r} needs {req.num_prompt_tokens} + "
                f"{req.num_output_tokens} tokens: must be <= max_model_len={self.max_model_len}"
            )
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self.slots)

    def reserved_tokens(self) -> int:
        """Token slots reserved now by running requests."""
        return self.space.num_allocated

    def used_tokens(self) -> int:
        """Token slots holding a token's K/V now."""
        return sum(s.kv_len for s in self.slots if s is not None)

    def _finish_done(self, finished: list[ContiguousOutput]) -> None:
        now = time.perf_counter()
        for i, s in enumerate(self.slots):
            if s is not None and len(s.output) >= s.req.num_output_tokens:
                finished.append(
                    ContiguousOutput(s.req.request_id, s.output, s.first_token_time, now)
                )
                self.space.free(s.start)
                self.slots[i] = None

    def _admit(self) -> None:
        while self.waiting and None in self.slots:
            req = self.waiting[0]
            start = self.space.alloc(self.reservation(req))
            if start is None:
                return  # head-of-line blocking, as the paged scheduler
            self.waiting.popleft()
            i = self.slots.index(None)
            token = self.runner.prefill(i, req.prompt_token_ids)
            self.num_computed_tokens += req.num_prompt_tokens
            self.num_padded_tokens += next(
                b for b in self.runner.prefill_buckets if b >= req.num_prompt_tokens
            )
            self.slots[i] = _Slot(req, [token], time.perf_counter(), start)

    def step(self) -> list[ContiguousOutput]:
        """Admits and prefills what fits, then one decode step; returns finished requests."""
        finished: list[ContiguousOutput] = []
        self._admit()
        self._finish_done(finished)
        self.max_running = max(self.max_running, self.num_running)
        if self.num_running:
            n = 1 + max(i for i, s in enumerate(self.slots) if s is not None)
            tokens = np.zeros(n, np.int32)
            positions = np.full(n, self.max_model_len, np.int32)
            for i, s in enumerate(self.slots[:n]):
                if s is not None:
                    tokens[i], positions[i] = s.output[-1], s.kv_len
            sampled = self.runner.decode(tokens, positions)
            self.num_computed_tokens += self.num_running
            self.num_padded_tokens += next(b for b in self.runner.decode_row_buckets if b >= n)
            for i, s in enumerate(self.slots[:n]):
                if s is not None:
                    s.output.append(int(sampled[i]))
        self.used_token_slots += self.used_tokens()
        self.reserved_token_slots += self.reserved_tokens()
        self._finish_done(finished)
        self.num_steps += 1
        return finished

    @property
    def kv_utilization(self) -> float:
        """Token slots holding tokens / token slots reserved, both summed over steps."""
        return self.used_token_slots / max(1, self.reserved_token_slots)
