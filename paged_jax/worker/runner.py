"""Runner: owns the model's weights and the paged KV caches on device; runs one jitted step.

The step is one jitted function whose arguments follow the data flow: device state
(weights, kv_caches, kv_scales, row_tokens), then the StepInput's parts (token_ids,
positions, attention, sampling, feed). It runs the model's paged forward (write_kv,
then paged attention, per layer: the decode kernel on decode-only steps, else ragged)
and the sampler. A step's copy-on-write copies (StepInput.copies) are a second jitted
call, dispatched before the step only when it has a real copy, so the many steps with
none launch no copy kernel. The KV caches are donated to both so XLA updates them in
place. Every input has a bucketed shape, so `warmup()` builds each bucket's program
(and each decode-only one, and the copy's) once ahead of time, or loads it from the
executable cache (paged_jax.worker.executable_cache); dispatch calls those programs and
serving never compiles. A listener on jax's compile events counts, per Runner, the
compiles its own calls make (``Runner.num_compiles``), not those of other code. With
`EngineConfig.validate` both are checkified: a bad block id, slot or copy pair raises
instead of corrupting the cache.
Non-finite logits are flagged per sequence inside the step (StepResult.nonfinite).
Prompt logprobs: the step also returns the last layer's output in fixed-size chunks,
and one more program turns a chunk into each row's logprobs (dispatch's prompt_rows).
The weights being step arguments, new ones of the same shapes never recompile
(paged_jax.worker.live_weights replaces them; the pool's sizing: worker/kv_pool_sizing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import checkify

import pallas_kernels
from paged_jax.config import EngineConfig
from paged_jax.constants import NONFINITE_TOKEN_ID, cdiv
from paged_jax.model_api import PagedModel
from paged_jax.models.attention import AttentionMetadata  # registered as a pytree there
from paged_jax.models.batch_invariant import set_row_tiled_matmuls
from paged_jax.models.layer_scan import (
    StackedLayers,
    ids_in_every_tensor,
    plan_layer_scan,
    split_without_layers,
)
from paged_jax.models.lora import DeviceLoRA, lora_module_shapes, lora_stack_specs
from paged_jax.worker.capture import PendingCapture, activation_hooks
from paged_jax.worker.executable_cache import ExecutableCache, WarmupReport
from paged_jax.worker.input_batch import PAD_SLOT_ID, decode_step_shapes
from paged_jax.worker.kv_cache_dtype import check_kv_scales, initial_kv_scales, kv_cache_jnp_dtype
from paged_jax.worker.kv_pool_sizing import (  # the pool's sizing; some names re-exported
    PROMPT_LOGPROBS_CHUNK,  # noqa: F401
    DeviceMemory,  # noqa: F401
    activation_bytes_estimate,
    cap_kv_blocks,  # noqa: F401
    device_memory,
    kv_block_arrays,
    model_weight_bytes,
    prompt_chunk_size,
    resolve_num_kv_blocks,
)
from paged_jax.worker.rejection_sampler import SpecSamplerOutput, sample_speculative
from paged_jax.worker.sampling import (
    SamplerOutput,
    TokenLogprobs,
    sample,
    token_logprobs,
    with_fed_last_token,
)
from paged_jax.worker.sharding import TensorParallel, per_device_bytes
from paged_jax.worker.step_input import (
    SamplingMetadata,
    SpecDecodeInput,
    StepCopies,
    StepInput,
    TokenFeed,
)

logger = logging.getLogger(__name__)

# Speculative methods whose proposals are point masses (no draft distribution).
POINT_MASS_METHODS = ("ngram",)

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compile_lock = threading.Lock()
_compile_count = 0
_listener_installed = False
# The Runner whose own programs this thread is running or building (counting_compiles):
# jax reports a compile in the thread that compiles, so a thread-local scope tells the
# engine's compiles from those of other code in the process (a user's eager jnp ops).
_compile_scope = threading.local()


def _on_event(name: str, *_args: Any, **_kwargs: Any) -> None:
    global _compile_count
    if name == _COMPILE_EVENT:
        runner = getattr(_compile_scope, "runner", None)
        with _compile_lock:
            _compile_count += 1
            if runner is not None:
                runner.num_compiles += 1


def num_backend_compiles() -> int:
    """XLA backend compilations in this process (any code's) since the first Runner was built."""
    return _compile_count


@contextlib.contextmanager
def compiles_counted_by(runner: Any) -> Iterator[None]:
    """Counts the backend compiles this thread makes inside the block in ``runner.num_compiles``."""
    outer = getattr(_compile_scope, "runner", None)
    _compile_scope.runner = runner
    try:
        yield
    finally:
        _compile_scope.runner = outer


def counting_compiles(method):
    """Counts the backend compiles this thread makes inside ``method`` in ``self.num_compiles``."""

    @functools.wraps(method)
    def counted(self, *args, **kwargs):
        with compiles_counted_by(self):
            return method(self, *args, **kwargs)

    return counted


def _install_compile_listener() -> None:
    global _listener_installed
    with _compile_lock:
        if not _listener_installed:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _listener_installed = True


def device_lora(model: Any, config: EngineConfig, tp: tuple[Any, Any] | None) -> DeviceLoRA:
    """The adapter stacks of an engine with enable_lora (models.lora.DeviceLoRA).

    Args:
        model: the model as the runner was given it.
        tp: (mesh, sharded model) under tensor parallelism: the stacks take the sharded
            model's shapes and are split like its projections.
    """
    served = model if tp is None else tp[1]
    shapes, refused = lora_module_shapes(served)
    mesh = specs = None
    repeated = {}
    if tp is not None:
        mesh = tp[0]
        specs = lora_stack_specs(served, shapes)
        repeats = kv_head_repeats(
            int(model.config.num_key_value_heads),
            int(served.config.num_key_value_heads),
            config.tensor_parallel_size,
        )
        if repeats:
            head_dim = int(served.config.head_dim)
            options = {heads * head_dim: r for heads, r in repeats.items()}
            repeated = {m: (head_dim, options) for m in ("k_proj", "v_proj") if m in shapes}
    return DeviceLoRA(
        shapes,
        int(served.config.num_hidden_layers),
        config.max_loras,
        config.max_lora_rank,
        served.config.dtype,
        refused=refused,
        repeated_heads=repeated,
        mesh=mesh,
        specs=specs,
    )


def kv_head_repeats(given: int, served: int, tp: int) -> dict[int, int]:
    """{checkpoint KV heads: repeats} an adapter's k/v may have been written for, when the
    served model holds ``served`` KV heads over ``tp`` devices.

    A model handed over unsharded (``given`` < ``served``) says its count; one loaded
    already sharded (LLM(path, tensor_parallel_size=N) repeats the heads while loading)
    does not, so every count whose repetition over ``tp`` devices gives ``served`` heads
    is accepted (the adapter's B rows say which it is).
    """
    if given < served:
        return {given: served // given}
    return {
        heads: served // heads
        for heads in range(1, served)
        if served % heads == 0 and max(1, tp // heads) == served // heads
    }


def scans_layers(config: EngineConfig) -> bool:
    """Whether EngineConfig.scan_layers asks for the scan on this backend ("auto": not on
    CPU, where the scan's per-step copy of each layer's weight slice costs more than the
    compile time it saves on small models; docs/models.md)."""
    if config.scan_layers == "auto":
        return jax.default_backend() != "cpu"
    return config.scan_layers == "on"


# ---------------------------------------------------------------- the jitted calls
# Copy-on-write runs first: ``cache[dst] = cache[src]`` for every layer's K and V. The
# host schedules the copies (KVCacheManager.take_pending_copies) and the StepInput
# carries them as a fixed-width StepCopies padded with dst = -1, so the copy keeps one
# shape (one compile). It is its own jitted call, dispatched only for a step with a real
# copy: it consumes the donated caches and returns them, so the step that follows reads
# the copied blocks by data dependency, however far ahead async scheduling dispatches.
# Destinations are distinct and never a source (the block manager's holds), so the
# copies may run in any order.
#
# Token feed: sampled ids stay on device and become the next step's input tokens.
# Async scheduling packs step N+1 before step N's samples reach the host, so a
# request's newest token is a placeholder in step N+1's host-built token_ids. The
# device keeps one slot per input-batch row (a request holds its row for its whole stay
# in the batch, so no other request's sample overwrites a slot still needed):
#
#     step N:    sample -> row_tokens[sample_rows[s]] = sampled[s]
#     step N+1:  token_ids[t] = row_tokens[token_rows[t]] where token_rows[t] >= 0
#
# Both are fixed-shape gathers/scatters: no new shapes, no host round trip. The
# synchronous engine passes token_rows = -1 everywhere. A non-finite row's sample
# (NONFINITE_TOKEN_ID) is stored as token 0, so the next step always reads a real id.


def copy_kv_blocks(
    kv_caches: list[tuple[jax.Array, jax.Array]],
    copies: StepCopies,  # src i32[C], dst i32[C] (-1 = padding)
    *,
    attention_backend: Any = "auto",  # a backend name or AttentionOps (per shard under TP)
) -> list[tuple[jax.Array, jax.Array]]:
    """Copies whole blocks (all heads) of every layer's K and V cache from src to dst ids."""
    copy = pallas_kernels.get_attention_ops(attention_backend).copy_blocks
    return [tuple(copy(k, v, copies.src, copies.dst)) for k, v in kv_caches]


def init_row_tokens(num_rows: int) -> jax.Array:
    """i32[num_rows] zeros: one last-sampled-token slot per input-batch row."""
    return jnp.zeros(num_rows, jnp.int32)


def feed_tokens(row_tokens: jax.Array, token_ids: jax.Array, token_rows: jax.Array) -> jax.Array:
    """i32[T] token ids with every placeholder (token_rows >= 0) taken from row_tokens."""
    from_device = row_tokens[jnp.maximum(token_rows, 0)]
    return jnp.where(token_rows >= 0, from_device, token_ids)


def record_tokens(row_tokens: jax.Array, sampled: jax.Array, sample_rows: jax.Array) -> jax.Array:
    """row_tokens with each sequence's sample stored at its row (out-of-range rows dropped).

    A NONFINITE_TOKEN_ID sample is stored as token 0.
    """
    return row_tokens.at[sample_rows].set(jnp.maximum(sampled, 0), mode="drop")


def split_rows(x: jax.Array, rows: int) -> tuple[jax.Array, ...]:
    """f[T, D] as ceil(T / rows) arrays f[rows, D] (the last zero-padded): one fixed shape
    for every bucket T, so one compiled program reads any chunk of any step."""
    num_chunks = cdiv(x.shape[0], rows)
    x = jnp.pad(x, ((0, num_chunks * rows - x.shape[0]), (0, 0)))
    return tuple(x[c * rows : (c + 1) * rows] for c in range(num_chunks))


def program_key(step: StepInput) -> tuple[int, int, bool]:
    """What selects a step's program: its (num_tokens, num_seqs) shape and decode_only."""
    num_tokens, num_seqs = step.bucket
    return num_tokens, num_seqs, step.attention.decode_only


def program_name(step: StepInput) -> str:
    """A step program's name, as progress lines and cache entries show it."""
    num_tokens, num_seqs, decode_only = program_key(step)
    return f"step tokens={num_tokens} seqs={num_seqs}" + (" decode-only" if decode_only else "")


class PendingPromptLogprobs:
    """Prompt-logprob programs dispatched for one step, their outputs being copied to the host.

    ``parts`` holds, per chunk of hidden states run: the indices of the requested rows
    it serves, their rows within the chunk, and the program's TokenLogprobs.
    """

    def __init__(self, num_rows: int, parts: list[tuple[np.ndarray, np.ndarray, TokenLogprobs]]):
        for _, _, out in parts:
            for array in out:
                array.copy_to_host_async()
        self._num_rows = num_rows
        self._parts = parts

    def result(self) -> TokenLogprobs:
        """Host arrays in the order the rows were requested: f32[N], i32[N], i32[N, K], f32[N, K]."""
        host = [(sel, local, jax.device_get(out)) for sel, local, out in self._parts]
        k = host[0][2].top_token_ids.shape[1]
        n = self._num_rows
        result = TokenLogprobs(
            np.zeros(n, np.float32),
            np.zeros(n, np.int32),
            np.zeros((n, k), np.int32),
            np.zeros((n, k), np.float32),
        )
        for sel, local, out in host:
            for dst, src in zip(result, out):
                dst[sel] = np.asarray(src)[local]
        return result


class PendingStep:
    """A dispatched step whose sampler outputs are being copied to the host.

    with_logprobs=False copies only the sampled ids (each copied output costs host
    time every step); the result's logprob fields are then None. The non-finite flags
    ride in those ids (NONFINITE_TOKEN_ID), so they cost no copy of their own.
    ``prompt`` holds the step's prompt-logprob programs, if it asked for any.
    """

    def __init__(
        self,
        out: SamplerOutput | SpecSamplerOutput,
        num_seqs: int,
        with_logprobs: bool = True,
        prompt: PendingPromptLogprobs | None = None,
        captured: PendingCapture | None = None,
    ):
        self._captured = captured
        self._spec = isinstance(out, SpecSamplerOutput)
        if with_logprobs:
            for array in out:
                array.copy_to_host_async()
        else:
            out.token_ids.copy_to_host_async()
            if self._spec:
                out.num_emitted.copy_to_host_async()
        self._out = out
        self._num_seqs = num_seqs
        self._with_logprobs = with_logprobs
        self._prompt = prompt

    def result(self) -> StepResult:
        """Waits for the step and returns the samples of its real sequences."""
        n = self._num_seqs
        prompt = None if self._prompt is None else self._prompt.result()
        captured = None if self._captured is None else self._captured.result()
        emitted = np.asarray(self._out.num_emitted)[:n] if self._spec else None
        if not self._with_logprobs:
            token_ids, nonfinite = _split_nonfinite(np.asarray(self._out.token_ids)[:n])
            return StepResult(
                token_ids,
                None,
                None,
                None,
                nonfinite,
                prompt_logprobs=prompt,
                num_emitted=emitted,
                hidden_states=captured,
            )
        out = jax.device_get(self._out)
        token_ids, nonfinite = _split_nonfinite(np.asarray(out.token_ids[:n]))
        return StepResult(
            token_ids,
            np.asarray(out.logprobs[:n]),
            np.asarray(out.top_token_ids[:n]),
            np.asarray(out.top_logprobs[:n]),
            nonfinite,
            np.asarray(out.ranks[:n]),
            prompt,
            emitted,
            captured,
        )


def _split_nonfinite(sampled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids with token 0 on non-finite rows, bool flags) from the sampler's marked ids."""
    nonfinite = sampled == NONFINITE_TOKEN_ID
    if nonfinite.any():  # rare: copy only then (the host copy may be read-only)
        sampled = np.where(nonfinite, 0, sampled).astype(sampled.dtype)
    return sampled, nonfinite


@dataclasses.dataclass
class StepResult:
    """Host copies of the sampler's outputs for the real (unpadded) sequences.

    The logprob fields (ranks included) are None for a step dispatched with
    with_logprobs=False. ``nonfinite[s]`` is True where sequence s's logits held a NaN
    or an infinity (broken weights or config); its token is then 0 and its logprobs
    NaN, and the request should end with an error rather than keep the token. The
    runner always sets it (all False on a healthy step); None only in a result built
    without a runner. ``prompt_logprobs`` holds the requested prompt rows' next-token
    logprobs (Runner.dispatch's prompt_rows, in that order), else None.

    A speculative step (StepInput.spec) has K1 = k + 1 entries per sequence: the
    arrays gain a K1 axis after num_seqs, and ``num_emitted[s]`` says how many of
    sequence s's are real (its accepted drafts, then one token of the target's).
    """

    token_ids: np.ndarray  # i32[num_seqs]
    logprobs: np.ndarray | None  # f32[num_seqs]
    top_token_ids: np.ndarray | None  # i32[num_seqs, MAX_LOGPROBS]
    top_logprobs: np.ndarray | None  # f32[num_seqs, MAX_LOGPROBS]
    nonfinite: np.ndarray | None = None  # bool[num_seqs]
    ranks: np.ndarray | None = None  # i32[num_seqs]; sampled token's 1-based rank
    prompt_logprobs: TokenLogprobs | None = None  # [N] rows asked for
    num_emitted: np.ndarray | None = None  # i32[num_seqs]; speculative steps only
    # f32[K, M, hidden]: the captured layers' rows of dispatch's hidden_state_rows
    hidden_states: np.ndarray | None = None


class Runner:
    """Device state (weights, KV caches, swapped blocks) and the jitted step.

    Args:
        model: a ``paged_jax.PagedModel``. An NNX module is split so its weights are
            step arguments; any other object is closed over by the jitted step.
        config: a resolved EngineConfig. With tensor_parallel_size > 1 the model's
            weights and the KV caches are split over a mesh (paged_jax.worker.sharding).
            With scan_layers (scans_layers), a model whose layers repeat runs them as a lax.scan over
            stacked weights and keeps its KV tensors in one stacked (K, V) pair
            (paged_jax.models.layer_scan).
        owns_model: the caller hands the model over: its per-layer weights are freed
            once stacked for the scan, so they are not held twice (LLM does this for the
            models it loads). False keeps the model usable as it was.
        extra_kv_bytes_per_block: another cache's bytes per block per device that shares
            the pool's block ids (a speculative draft model's), counted when the pool is
            sized from memory.
    """

    # The compiled programs warmup() built (None before it): program_key(step) -> that
    # step's program, "copy" -> the block copy's. Dispatch calls these.
    programs: dict[tuple[int, int, bool] | str, Any] | None = None

    def __init__(
        self,
        model: PagedModel,
        config: EngineConfig,
        *,
        owns_model: bool = False,
        extra_kv_bytes_per_block: int = 0,
    ):
        _install_compile_listener()
        # Backend compiles of this runner's own programs (counting_compiles): its calls
        # count, other code's compiles in the process never do.
        self.num_compiles = 0
        self.config = config
        tp = config.tensor_parallel_size
        kv_dtype = kv_cache_jnp_dtype(config.kv_cache_dtype)  # None: the model's dtype
        if kv_dtype is not None and tp > 1:
            raise ValueError(
                f"kv_cache_dtype={config.kv_cache_dtype!r} must be 'auto' with "
                f"tensor_parallel_size={tp} (fp8 KV is single-device for now)"
            )
        if config.batch_invariant and isinstance(model, nnx.Module):
            # Fixed row tiles for every matmul (the model object itself is changed: its
            # dense forward multiplies the same way). A custom PagedModel keeps its own.
            set_row_tiled_matmuls(model)
        self.tp = TensorParallel(model, tp) if tp > 1 else None
        # Multi-LoRA: the adapter stacks, shaped by the unsharded model's projections and
        # split like the sharded model's (before the scan may release the layers).
        self.lora = (
            device_lora(model, config, None if self.tp is None else (self.tp.mesh, self.tp.model))
            if config.enable_lora
            else None
        )
        model = model if self.tp is None else self.tp.model
        # Layers that repeat run as one scanned body over stacked weights (built before
        # the pool is sized from free memory, so a freed original leaves room for KV).
        plan = plan_layer_scan(model) if scans_layers(config) else None
        # The structure of the model's state (every layer's own), whatever the step holds:
        # the canonical weights of LLM.get_weights (paged_jax.worker.live_weights).
        self.canonical_treedef = (
            jax.tree.structure(nnx.state(model)) if isinstance(model, nnx.Module) else None
        )
        self.layer_scan: StackedLayers | None = (
            None if plan is None else StackedLayers.from_model(model, plan, release=owns_model)
        )
        # One device's share of a block: the pool is sized from per-device memory.
        self.bytes_per_block = int(model.kv_bytes_per_block(config.block_size, kv_dtype)) // tp
        arrays = kv_block_arrays(model, config.block_size, kv_dtype, tensor_parallel_size=tp)
        if plan is not None:  # one array of num_tensors * num_blocks blocks per K and V
            arrays = sorted({(elems * plan.num_tensors, size) for elems, size in arrays})
        # A speculative draft model keeps KV for the same blocks (extra_kv_bytes_per_block
        # per device), so a pool sized from memory budgets both.
        sizing = {}
        if config.gpu_memory_utilization is not None:  # vLLM's: weights + activations + KV
            sizing = dict(
                weight_bytes=model_weight_bytes(model, self.layer_scan),
                activation_bytes=activation_bytes_estimate(config, model.config),
                memory=device_memory(),
            )
        self.num_kv_blocks = resolve_num_kv_blocks(
            config, self.bytes_per_block + int(extra_kv_bytes_per_block), arrays, **sizing
        )
        self.num_kv_tensors = 1 if plan is None else plan.num_tensors
        stacked = self.layer_scan

        def init_caches():
            if stacked is None:
                return model.init_kv_caches(self.num_kv_blocks, config.block_size, kv_dtype)
            return stacked.init_kv_caches(model, self.num_kv_blocks, config.block_size, kv_dtype)

        def make_kv_caches():
            if self.tp is None:
                return init_caches()
            return self.tp.init_kv_caches(self.num_kv_blocks, config.block_size, init_caches)

        # Zeroed KV caches of the pool's shapes: built here, and again by the same calls
        # (the same cached programs: no compile) when an engine wakes up (live_weights).
        self.make_kv_caches = make_kv_caches
        self.kv_caches = make_kv_caches()
        # fp8: per-layer (k_scale, v_scale), a step argument (new values never recompile).
        # Per layer, not per KV tensor (hybrid-group models share tensors between layers).
        self._num_layers = int(model.config.num_hidden_layers)
        self.kv_scales = (
            None
            if kv_dtype is None
            else jax.numpy.asarray(initial_kv_scales(model, self._num_layers))
        )
        self.attention_backend = config.attention_backend
        backend = self.attention_backend
        if self.tp is not None:  # the kernels run per shard, on each device's heads
            backend = self.tp.attention_ops(backend)
        gather = (lambda x: x) if self.tp is None else self.tp.gather
        if stacked is not None:  # the model without its layers, and the stacked layers
            graphdef, rest = split_without_layers(model)
            self.weights = (rest, stacked)

            def merge(weights):
                return nnx.merge(graphdef, weights[0]), {"layers": weights[1]}
        elif isinstance(model, nnx.Module):
            graphdef, self.weights = nnx.split(model)

            def merge(weights):
                return nnx.merge(graphdef, weights), {}
        else:  # a plain object: its arrays are baked into the step as constants
            self.weights = None

            def merge(weights):
                del weights
                return model, {}

        # Prompt logprobs read the last layer's output at every token: a model with
        # forward_paged_hidden and logits (every paged_jax.models model) has the step
        # return it, cut into chunks of prompt_chunk rows, and one program of that fixed
        # shape (prompt_logprobs_program) turns a chunk into logprobs.
        self.supports_prompt_logprobs = callable(
            getattr(model, "forward_paged_hidden", None)
        ) and callable(getattr(model, "logits", None))
        self.prompt_chunk = prompt_chunk_size(config)
        chunk, hidden_path = self.prompt_chunk, self.supports_prompt_logprobs
        # Activations (EngineConfig.hidden_state_layers, steering_layers): the step runs
        # the model with hooks after its layers; it also returns the captured layers' rows
        # in chunks of `chunk` rows, and dispatch copies only the chunks holding requested
        # rows (paged_jax.worker.capture).
        self.activations = activation_hooks(model, config, hidden_path)
        hooks = self.activations

        def step_fn(
            weights: Any,
            kv_caches: list,  # donated
            kv_scales: jax.Array | None,  # f32[num_layers, 2]; fp8 caches only
            row_tokens: jax.Array,  # i32[max_num_seqs]; donated
            token_ids: jax.Array,  # i32[T]
            positions: jax.Array,  # i32[T]
            attention: AttentionMetadata,
            sampling: SamplingMetadata,
            feed: TokenFeed,
            spec: SpecDecodeInput | None = None,
            draft_probs: jax.Array | None = None,  # f32[max_num_seqs, k, V] by row
            lora: Any = None,  # models.lora.LoRAStep (enable_lora)
            steering: jax.Array | None = None,  # f32[J, S, hidden]; steering_layers only
            embeds: Any = None,  # (f32[T, embed], bool[T]); enable_prompt_embeds only
        ) -> tuple[SamplerOutput, list, jax.Array, tuple[jax.Array, ...]]:
            m, extra = merge(weights)
            token_ids = feed_tokens(row_tokens, token_ids, feed.token_rows)
            if kv_scales is not None:
                extra["kv_scales"] = kv_scales
            if lora is not None:
                extra["lora"] = lora
            hidden_chunks = ((), ())  # (last layer's, captured layers') row chunks
            if hooks is not None:
                hidden, kv_caches, captured = hooks.forward(
                    m, steering, token_ids, positions, kv_caches, attention, backend, extra, embeds
                )
                logits = m.logits(hidden[attention.logits_indices])
                hidden_chunks = (split_rows(hidden, chunk), hooks.chunks(captured, chunk))
            elif hidden_path:
                hidden, kv_caches = m.forward_paged_hidden(
                    token_ids, positions, kv_caches, attention, attention_backend=backend, **extra
                )
                logits = m.logits(hidden[attention.logits_indices])
                hidden_chunks = (split_rows(hidden, chunk), ())
            else:
                logits, kv_caches = m.forward_paged(
                    token_ids, positions, kv_caches, attention, attention_backend=backend, **extra
                )
            if spec is not None:
                # Speculative steps are synchronous (the host has every token): no feed
                # fix-up of the history; logits come k + 1 per sequence.
                q = None
                if draft_probs is not None:
                    q = draft_probs[jnp.minimum(feed.sample_rows, draft_probs.shape[0] - 1)]
                out = sample_speculative(gather(logits), sampling, spec, q)
                rows = jnp.arange(out.num_emitted.shape[0])
                last = out.token_ids[rows, out.num_emitted - 1]
                row_tokens = record_tokens(row_tokens, last, feed.sample_rows)
                return out, kv_caches, row_tokens, hidden_chunks
            sampling = with_fed_last_token(sampling, token_ids, attention.logits_indices)
            out = sample(gather(logits), sampling)
            row_tokens = record_tokens(row_tokens, out.token_ids, feed.sample_rows)
            return out, kv_caches, row_tokens, hidden_chunks

        def prompt_fn(
            weights: Any,
            hidden: jax.Array,  # f[prompt_chunk, hidden] one chunk of a step's hidden states
            targets: jax.Array,  # i32[prompt_chunk] the token each row's logprob is read at
        ) -> TokenLogprobs:
            m, _ = merge(weights)
            logits = gather(m.logits(hidden)).astype(jnp.float32)
            return token_logprobs(jax.nn.log_softmax(logits, axis=-1), targets)

        if config.validate:  # the kernels' checkify.checks become an error output
            step_fn = checkify.checkify(step_fn)
        # Speculative decoding with a draft distribution: its q, by input-batch row, is a
        # step argument (the engine sets it from each Proposal); zeros until then.
        spec = config.speculative_config
        self.draft_probs: jax.Array | None = None
        if spec is not None and spec.method not in POINT_MASS_METHODS:
            shape = (config.max_num_seqs, spec.num_speculative_tokens, int(model.config.vocab_size))
            self.draft_probs = jnp.zeros(shape, jnp.float32)
        # Last sampled id per input-batch row: the device half of async scheduling.
        self.row_tokens = init_row_tokens(config.max_num_seqs)
        tp_out = {}
        if self.tp is not None:
            # Donated caches come back with their input sharding (jax#25346); row tokens
            # live replicated from the start, so the first step sees the same shardings.
            rep = self.tp.replicated
            shardings = (rep, self.tp.kv_sharding, rep, rep)
            if config.validate:  # checkify's (error, outputs): the error is replicated
                shardings = (rep, shardings)
            tp_out = dict(out_shardings=shardings)
            self.row_tokens = jax.device_put(self.row_tokens, rep)
        # The jitted step; step_args(step) are its arguments for one StepInput.
        self.jitted_step = jax.jit(step_fn, donate_argnums=(1, 3), **tp_out)
        tp_rep = {} if self.tp is None else dict(out_shardings=self.tp.replicated)
        self.jitted_prompt_logprobs = jax.jit(prompt_fn, **tp_rep)
        # The copy-on-write copies of a step (run_copies): bound with validate like the
        # model's ops (a per-shard AttentionOps under tensor parallelism is used as is).
        copy_ops = (
            backend
            if self.tp is not None
            else pallas_kernels.get_attention_ops(backend, validate=config.validate)
        )

        every_tensor = self.block_ids_in_every_tensor

        def copy_fn(kv_caches: list, copies: StepCopies) -> list:  # kv_caches donated
            copies = StepCopies(every_tensor(copies.src), every_tensor(copies.dst))
            return copy_kv_blocks(kv_caches, copies, attention_backend=copy_ops)

        if config.validate:
            copy_fn = checkify.checkify(copy_fn)
        copy_out = {}
        if self.tp is not None:  # the caches keep their sharding, as through the step
            kv = self.tp.kv_sharding
            copy_out = dict(out_shardings=(self.tp.replicated, kv) if config.validate else kv)
        self.jitted_copy = jax.jit(copy_fn, donate_argnums=(0,), **copy_out)
        self.num_decode_only_steps = 0  # real steps that took the decode kernel path
        width = config.max_blocks_per_seq
        self._swap_width = width

        def gather_blocks(kv_caches, ids):  # ids i32[W]
            ids = every_tensor(ids)
            return [(k[ids], v[ids]) for k, v in kv_caches]

        def scatter_blocks(kv_caches, ids, blocks):  # ids i32[W]; out of range = dropped
            ids = every_tensor(ids)
            return [
                (k.at[ids].set(bk, mode="drop"), v.at[ids].set(bv, mode="drop"))
                for (k, v), (bk, bv) in zip(kv_caches, blocks)
            ]

        self._gather = jax.jit(gather_blocks)
        tp_out = {} if self.tp is None else dict(out_shardings=self.tp.kv_sharding)
        self._scatter = jax.jit(scatter_blocks, donate_argnums=(0,), **tp_out)
        self._host_blocks: dict[str, tuple[int, list[tuple[np.ndarray, np.ndarray]]]] = {}
        self._zero_history: dict[int, jax.Array] = {}  # num_seqs bucket -> i32[S, L] zeros
        self._zero_steering: dict[int, jax.Array] = {}  # num_seqs bucket -> f32[J, S, H]
        self._no_embeds: dict[int, Any] = {}  # num_tokens bucket -> (f32[T, E], bool[T])
        self._neutral_penalties: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # Structured outputs: words per bitmask row (cdiv(V, 32)), and the all-ones
        # bitmask of each num_seqs bucket.
        self.bitmask_width = cdiv(int(model.config.vocab_size), 32)
        self._all_ones_bitmask: dict[int, jax.Array] = {}

    def block_ids_in_every_tensor(self, ids: jax.Array) -> jax.Array:
        """Inside jit: block ids i32[n] as rows of every KV tensor's cache (a copy or a swap
        moves a block in every layer); unchanged unless the tensors are stacked (scan)."""
        if self.layer_scan is None:
            return ids
        return ids_in_every_tensor(jnp.asarray(ids), self.num_kv_blocks, self.num_kv_tensors)

    # ------------------------------------------------------------------ step
    def execute(self, step: StepInput) -> StepResult:
        """Runs one bucketed step; returns the samples of the real sequences."""
        return self.dispatch(step).result()

    def step_args(self, step: StepInput) -> tuple:
        """The jitted step's arguments for one StepInput: the device state, then the step's
        parts as the input batch built them (the one place they are assembled: dispatch
        calls the step with them, the CUDA lowering test lowers it with them)."""
        assert step.attention.validate == self.config.validate, (
            "the StepInput's validate flag differs from the runner's EngineConfig.validate: "
            "the input batch and the runner were built from different configs"
        )
        return (
            self.weights,
            self.kv_caches,
            self.kv_scales,
            self.row_tokens,
            step.token_ids,
            step.positions,
            step.attention,
            self._with_bitmask(self._with_penalty_inputs(step.sampling, step.attention.seq_lens)),
            step.feed,
            step.spec,
            self.draft_probs if step.spec is not None else None,
            None if self.lora is None else self.lora.step_input(step.lora_slots, step.bucket[0]),
            self._steering_rows(step),
            self._embed_rows(step),
        )

    def _embed_rows(self, step: StepInput) -> Any:
        """The step's prompt-embedding rows (f32[T, embed], bool[T]) under
        EngineConfig.enable_prompt_embeds; a step without any gets resident padding."""
        if self.activations is None or not self.activations.prompt_embeds:
            return None
        if step.prompt_embeds is not None:
            return step.prompt_embeds
        t = step.token_ids.shape[0]
        if t not in self._no_embeds:
            self._no_embeds[t] = jax.device_put(self.activations.no_embeds(t))
        return self._no_embeds[t]

    def _steering_rows(self, step: StepInput) -> Any:
        """The step's steering vectors f32[J, S, hidden] (EngineConfig.steering_layers); a
        step without a steered row gets a resident zero array of the bucket's shape."""
        if self.activations is None or not self.activations.steer_layers:
            return None
        if step.steering is not None:
            return step.steering
        s = step.attention.seq_lens.shape[0]
        if s not in self._zero_steering:
            self._zero_steering[s] = jax.device_put(self.activations.zero_steering(s))
        return self._zero_steering[s]

    @counting_compiles
    def dispatch(
        self,
        step: StepInput,
        with_logprobs: bool = True,
        *,
        prompt_rows: np.ndarray | None = None,
        prompt_targets: np.ndarray | None = None,
        hidden_state_rows: np.ndarray | None = None,
    ) -> PendingStep:
        """Launches one bucketed step without waiting for it (JAX async dispatch).

        The sampled ids also land in ``row_tokens`` (device), where the next step's
        placeholder tokens read them; the host copy starts now and is read by
        ``PendingStep.result()`` (the logprob outputs too unless with_logprobs=False).
        The step's block copies, if it has any, are dispatched first (run_copies).

        Args:
            step: the packed step.
            with_logprobs: copy the sampled tokens' logprobs, ranks and top entries too.
            prompt_rows: i32[N] token rows of the step (indices into step.token_ids)
                whose next-token distribution is wanted (prompt logprobs), or None. Only
                for a model with supports_prompt_logprobs; the programs run right after
                the step, one per chunk of prompt_chunk rows holding any of them.
            prompt_targets: i32[N] the token each of those rows' logprob and rank are
                read at (the prompt's next token).
            hidden_state_rows: i32[M] token rows whose captured hidden states
                (EngineConfig.hidden_state_layers) are copied to the host, or None: only
                the fixed-size chunks holding them leave the device
                (StepResult.hidden_states).
        """
        out, (hidden_chunks, captured_chunks) = self._launch(step)
        prompt = None
        if prompt_rows is not None and len(prompt_rows):
            assert self.supports_prompt_logprobs, "prompt logprobs asked of a model without them"
            prompt = self._dispatch_prompt_logprobs(hidden_chunks, prompt_rows, prompt_targets)
        captured = None
        if hidden_state_rows is not None and len(hidden_state_rows):
            assert self.activations is not None and self.activations.capture_layers, (
                "hidden states asked of an engine without hidden_state_layers"
            )
            captured = PendingCapture(captured_chunks, hidden_state_rows, self.prompt_chunk)
        return PendingStep(out, step.num_seqs, with_logprobs, prompt, captured)

    def _launch(self, step: StepInput) -> tuple[SamplerOutput, tuple[tuple[jax.Array, ...], ...]]:
        """Dispatches the step's copies and the step; the sampler's outputs and the row
        chunks (the last layer's, the captured layers')."""
        self.run_copies(step.copies)
        result = self.step_program(step)(*self.step_args(step))
        err, result = result if self.config.validate else (None, result)
        out, self.kv_caches, self.row_tokens, hidden_chunks = result
        if err is not None:
            err.throw()  # debug path (syncs): checkify.JaxRuntimeError naming the bad id
        self.num_decode_only_steps += step.attention.decode_only and step.num_seqs > 0
        return out, hidden_chunks

    def _dispatch_prompt_logprobs(
        self,
        hidden_chunks: tuple[jax.Array, ...],  # f[prompt_chunk, hidden] each
        rows: np.ndarray,  # i32[N] token rows of the step
        targets: np.ndarray,  # i32[N]
    ) -> PendingPromptLogprobs:
        """One prompt-logprobs program call per chunk that holds any of ``rows``."""
        programs = self.programs or {}
        program = programs.get("prompt_logprobs", self.jitted_prompt_logprobs)
        rows = np.asarray(rows, np.int64)
        size = self.prompt_chunk
        chunk_of = rows // size
        parts = []
        for c in np.unique(chunk_of).tolist():
            sel = np.flatnonzero(chunk_of == c)
            local = rows[sel] - c * size
            chunk_targets = np.zeros(size, np.int32)
            chunk_targets[local] = np.asarray(targets)[sel]
            parts.append((sel, local, program(self.weights, hidden_chunks[c], chunk_targets)))
        return PendingPromptLogprobs(len(rows), parts)

    @counting_compiles
    def run_copies(self, copies: StepCopies, *, always: bool = False) -> None:
        """Dispatches the copy-on-write copies into the donated caches, without waiting.

        Skipped when every entry is padding (dst -1) unless ``always`` (warm-up), so a
        step without copies launches no copy kernel.
        """
        if not always and not np.any(np.asarray(copies.dst) != PAD_SLOT_ID):
            return
        copy = self.jitted_copy if self.programs is None else self.programs["copy"]
        result = copy(self.kv_caches, copies)
        err, self.kv_caches = result if self.config.validate else (None, result)
        if err is not None:
            err.throw()  # debug path (syncs): checkify.JaxRuntimeError naming the bad pair

    def step_program(self, step: StepInput) -> Any:
        """The program warm-up built for this step's shape and flags (a compiled
        executable), else the jitted step itself, which compiles on a shape it has not seen."""
        programs = self.programs
        program = None if programs is None else programs.get(program_key(step))
        return self.jitted_step if program is None else program

    @counting_compiles
    def write_lora_slot(self, slot: int, weights: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Writes an adapter's stacks into device LoRA slot ``slot`` (enable_lora engines)."""
        self.lora.write_slot(slot, weights)

    @counting_compiles
    def replace_lost_device_state(self) -> bool:
        """After a failed step: zeroed KV caches and row tokens wherever the old are gone.

        A step that raised may have consumed its donated buffers without handing the
        new ones back (an interrupt inside dispatch) or left them holding a device
        error. Swapped-out host copies are kept. Returns True when the KV caches were
        replaced: every block's KV is lost, so the caller must forget the prefix cache.
        """

        def unusable(x: jax.Array) -> bool:
            if x.is_deleted():
                return True
            try:
                x.block_until_ready()
            except Exception:  # noqa: BLE001 - any device error leaves x unusable
                return True
            return False

        def zeros_like(x: jax.Array) -> jax.Array:
            return jnp.zeros(x.shape, x.dtype, device=x.sharding)

        lost = any(map(unusable, jax.tree.leaves(self.kv_caches)))
        if lost:
            self.kv_caches = jax.tree.map(zeros_like, self.kv_caches)
        if unusable(self.row_tokens):
            self.row_tokens = zeros_like(self.row_tokens)
        return lost

    @counting_compiles
    def set_kv_scales(self, scales: Any) -> None:
        """Replaces the fp8 per-layer scales f32[num_layers, 2] (k, v); never recompiles.

        Blocks already written keep the values quantized with the old scales, so set them
        before serving (vLLM fixes its scales after loading or the first forward too).
        """
        if self.kv_scales is None:
            raise ValueError(
                f"kv_cache_dtype={self.config.kv_cache_dtype!r} has no scales (fp8 only)"
            )
        self.kv_scales = jax.numpy.asarray(check_kv_scales(scales, self._num_layers))

    def _with_bitmask(self, sampling: SamplingMetadata) -> SamplingMetadata:
        """The sampler's inputs with a structured-outputs bitmask i32[S, W]. A step without
        a constrained row gets a resident all-ones one (made once per bucket): nothing is
        copied and it shares the program of a step with one."""
        if sampling.bitmask is not None:
            return sampling
        s = sampling.temperature.shape[0]
        ones = self._all_ones_bitmask.get(s)
        if ones is None:
            ones = jax.device_put(np.full((s, self.bitmask_width), -1, np.int32))
            self._all_ones_bitmask[s] = ones
        return sampling._replace(bitmask=ones)

    def _with_penalty_inputs(
        self, sampling: SamplingMetadata, seq_lens: np.ndarray
    ) -> SamplingMetadata:
        """The sampler's inputs with every penalty field set. A step without penalties
        gets neutral values and a resident zero history of the same shape, so its
        history is never copied and it shares the compile of a step with penalties."""
        if sampling.history_token_ids is not None:
            return sampling
        s = seq_lens.shape[0]
        if s not in self._zero_history:
            width = self.config.max_model_len
            self._zero_history[s] = jax.device_put(np.zeros((s, width), np.int32))
        if s not in self._neutral_penalties:  # read-only constants, made once
            self._neutral_penalties[s] = (np.zeros(s, np.float32), np.ones(s, np.float32))
        off, one = self._neutral_penalties[s]
        return sampling._replace(
            presence_penalty=off,
            frequency_penalty=off,
            repetition_penalty=one,
            history_token_ids=self._zero_history[s],
            history_lens=seq_lens,
        )

    @counting_compiles
    def warmup(
        self,
        steps: list[StepInput],
        on_step: Any = None,
        *,
        cache: ExecutableCache | None = None,
    ) -> WarmupReport:
        """Builds every program serving can call, once each, and runs it on padding.

        The programs: one per given step (all-padding inputs change no KV), the
        decode-only variant of each step shape a decode-only step reaches (n tokens for
        n <= max_num_seqs sequences), the block copy, and (supports_prompt_logprobs)
        the prompt-logprobs program of one hidden-state chunk. Each is loaded from ``cache``
        where it holds a valid entry, else traced, lowered and compiled (and saved
        there); a loaded program that fails its first run is compiled afresh. The swaps
        (preemption_mode="swap") compile through jit. Afterwards dispatch calls these
        programs and nothing compiles.

        Args:
            steps: one all-padding StepInput per step shape (InputBatch.dummy_step_input).
            on_step: optional callable(i, num_programs, name, action) before each program;
                action is "loading" or "compiling".
            cache: where programs are loaded from and saved to; None: in memory only.

        Returns:
            What was built, how, and the seconds of each phase.
        """
        cache = ExecutableCache() if cache is None else cache
        variants = []
        decode_shapes = set(decode_step_shapes(self.config))
        for step in steps:
            variants.append(step)
            if step.bucket in decode_shapes and not step.attention.decode_only:
                decode = dataclasses.replace(step.attention, decode_only=True)
                variants.append(dataclasses.replace(step, attention=decode))
        total = len(variants) + bool(steps) + bool(steps and self.supports_prompt_logprobs)
        self.programs = {"copy": self.jitted_copy}  # until its own program is built
        records = []

        def build(i, name, jitted, args_of, run):
            def on_start(action):
                if on_step is not None:
                    on_step(i, total, name, action)

            program, record = cache.build(name, jitted, args_of(), on_start)
            try:
                t0 = time.perf_counter()
                run(program)
            except Exception as err:  # noqa: BLE001 - a loaded program that fails: rebuild
                if record.how != "loaded":
                    raise
                cache.report_problem(
                    name, f"the loaded program failed ({type(err).__name__}: {err})"[:400]
                )
                self.replace_lost_device_state()
                program, record = cache.build(name, jitted, args_of(), on_start, load=False)
                t0 = time.perf_counter()
                run(program)
            record.run_s = time.perf_counter() - t0
            records.append(record)
            return program

        hidden_chunk = []  # one chunk of a step's hidden states: the prompt program's input

        for i, step in enumerate(variants):

            def run_step(program, step=step):
                self.programs[program_key(step)] = program
                out, chunks = self._launch(step)
                result = PendingStep(out, step.num_seqs).result()
                assert result.token_ids.shape[0] == 0, "a padding-only step produced samples"
                hidden_chunk[:] = chunks[0][:1]

            build(
                i, program_name(step), self.jitted_step, lambda s=step: self.step_args(s), run_step
            )
        if steps:  # all padding (dst -1): copies nothing, builds the one copy shape
            copies = steps[0].copies

            def run_copy(program):
                self.programs["copy"] = program
                self.run_copies(copies, always=True)
                jax.block_until_ready(self.kv_caches)

            build(
                len(variants), "copy", self.jitted_copy, lambda: (self.kv_caches, copies), run_copy
            )
        if hidden_chunk:  # the model serves prompt logprobs: their one program
            targets = np.zeros(self.prompt_chunk, np.int32)

            def run_prompt(program):
                self.programs["prompt_logprobs"] = program
                jax.block_until_ready(program(self.weights, hidden_chunk[0], targets))

            build(
                total - 1,
                f"prompt logprobs rows={self.prompt_chunk}",
                self.jitted_prompt_logprobs,
                lambda: (self.weights, hidden_chunk[0], targets),
                run_prompt,
            )
        t0 = time.perf_counter()
        if self.lora is not None:  # the slot write's one program (slot 0 stays all zeros)
            self.lora.write_slot(0, {})
        if self.config.preemption_mode == "swap":
            ids = np.zeros(self._swap_width, np.int32)
            # Host copies, as swap_in passes them: the same input shardings, no recompile.
            blocks = jax.device_get(self._gather(self.kv_caches, ids))
            drop = np.full(self._swap_width, self.num_kv_blocks, np.int32)
            self.kv_caches = self._scatter(self.kv_caches, drop, blocks)
        directory = None if cache.directory is None else str(cache.directory)
        return WarmupReport(records, directory, list(cache.problems), time.perf_counter() - t0)

    def memory_per_device(self) -> dict[str, int]:
        """The most bytes of weights and of KV caches that any one device holds."""
        weights = per_device_bytes(self.weights)
        kv = per_device_bytes(self.kv_caches)
        out = {
            "weight_bytes_per_device": max(weights.values(), default=0),
            "kv_cache_bytes_per_device": max(kv.values(), default=0),
        }
        if self.lora is not None:
            lora = per_device_bytes(self.lora.stacks)
            out["lora_bytes_per_device"] = max(lora.values(), default=0)
        return out

    # ------------------------------------------------------------------ swap
    @counting_compiles
    def swap_out(self, req_id: str, block_ids: list[int]) -> None:
        """Copies the blocks' K/V of every layer to host memory (before they are reused)."""
        ids = np.zeros(self._swap_width, np.int32)
        ids[: len(block_ids)] = block_ids
        blocks = jax.device_get(self._gather(self.kv_caches, ids))
        self._host_blocks[req_id] = (len(block_ids), blocks)

    @counting_compiles
    def swap_in(self, req_id: str, block_ids: list[int]) -> None:
        """Writes a request's host copy into freshly allocated blocks."""
        num, blocks = self._host_blocks.pop(req_id)
        assert num == len(block_ids), "swap-in must restore exactly the swapped-out blocks"
        ids = np.full(self._swap_width, self.num_kv_blocks, np.int32)  # past the end: dropped
        ids[:num] = block_ids
        self.kv_caches = self._scatter(self.kv_caches, ids, blocks)

    def drop_swapped(self, req_id: str) -> None:
        """Forget a swapped request's host copy (it finished or was aborted while swapped)."""
        self._host_blocks.pop(req_id, None)

    @property
    def num_swapped_requests(self) -> int:
        return len(self._host_blocks)
