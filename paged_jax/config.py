"""EngineConfig: the engine's settings, validated once at construction (host side)."""

from __future__ import annotations

import dataclasses

# Re-exported: callers import these from paged_jax.config; their home is paged_jax.constants.
from paged_jax.constants import (
    ATTENTION_BACKENDS,
    COARSE_TOKEN_BUCKETS_UP_TO,
    DTYPES,
    HASH_ALGOS,
    KV_CACHE_DTYPES,
    MIN_SEQ_BUCKET,
    MIN_TOKEN_BUCKET,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    SCAN_LAYERS,
    SCHEDULING_POLICIES,
    AttentionBackend,
    Dtype,
    HashAlgo,
    KVCacheDtype,
    PreemptionMode,
    Quantization,
    ScanLayers,
    SchedulingPolicy,
    cdiv,
    fail,
    is_int,
    is_number,
)
from paged_jax.spec_decode.proposer import SpeculativeConfig


def _power_of_two_buckets(smallest: int, largest: int, coarse_up_to: int = 0) -> tuple[int, ...]:
    """Powers of two from `smallest` while below `largest`, then `largest` itself; below
    `coarse_up_to` every other power is skipped (4x steps)."""
    buckets = []
    b = smallest
    while b < largest:
        buckets.append(b)
        b *= 4 if b < coarse_up_to else 2
    buckets.append(largest)
    return tuple(buckets)


# Why each activation option refuses speculative decoding (docs/research_integration.md,
# "Activations", limits).
_NOT_WITH_SPEC = {
    "hidden_state_layers": "a verify step runs draft tokens that may be rejected, and "
    "capture keeps rows by position: the rejected rows would need rolling back; not built",
    "steering_layers": "the proposer (n-gram or draft model) and the verify step run "
    "without the steering rows; not built",
    "enable_prompt_embeds": "a draft model would read its own table for placeholder ids, "
    "and the verify step carries no embedding rows; not built",
}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine settings; the field names are also the keyword arguments of `LLM(...)`.

    Args:
        block_size: tokens per KV block.
        num_kv_blocks: KV blocks in the pool, the null block included. None sizes
            the pool from kv_cache_memory (or a default, see Runner).
        kv_cache_memory: KV budget: bytes (int) or a fraction in (0, 1] of the
            device memory left free after the weights.
        gpu_memory_utilization: vLLM's setting: the fraction in (0, 1] of the device's
            memory this engine may use for its weights, KV cache and activations; the
            KV pool gets that share less the weights and an activation estimate (see
            paged_jax.worker.kv_pool_sizing.resolve_num_kv_blocks). "The device's memory" is
            what jax's allocator may use (memory_stats' bytes_limit: on GPU
            XLA_PYTHON_CLIENT_MEM_FRACTION of it, 75% by default). A ValueError when
            that share cannot hold the weights, activations and 2 blocks, or when other
            arrays leave less free than it asks. On CPU, which reports no device
            memory, it is ignored with a warning and the pool is sized as without it
            (vLLM's CPU backend ignores it too). Not with kv_cache_memory or
            num_kv_blocks (set one of them).
        max_num_seqs: most requests scheduled in one step.
        max_num_batched_tokens: token budget of one step (chunked prefill splits
            longer prompts across steps).
        max_model_len: longest context (prompt + output). None takes the model's
            max_position_embeddings.
        enable_prefix_caching: share full blocks of equal prefixes between requests.
        preemption_mode: "recompute" or "swap" (KV blocks copied to host memory).
        scheduling_policy: "fcfs" or "priority" (lower value = served first).
        attention_backend: "auto" (Pallas on GPU, pure-JAX reference elsewhere),
            "pallas", "pallas_interpret" (Pallas in interpret mode, for tests),
            "mosaic_gpu" (Mosaic GPU attention kernels: Hopper or newer, jax >= 0.11.2,
            bf16/f16 models), "mosaic_gpu_interpret" (the same in GPU interpret mode on
            CPU, for tests) or "reference".
        dtype: weights and KV dtype: "auto" (bfloat16 on GPU, float32 elsewhere),
            "float32", "bfloat16" or "float16".
        kv_cache_dtype: "auto" (the model dtype), "fp8_e4m3" (alias "fp8") or
            "fp8_e5m2": an fp8 pool holds 2x the bf16 blocks (4x f32) in the same
            kv_cache_memory; per-layer K/V scales come from the checkpoint's
            k_scale/v_scale or are 1.0 (docs/fp8_kv_cache.md).
        quantization: None (weights in dtype), "int8" or "fp8": every linear layer of
            attention and MLP (MoE experts included) quantized on load to 8 bits, one
            scale per output channel, and kept 8-bit on the device (weight-only, W8A16:
            activations stay in dtype). A checkpoint quantized block-wise in fp8
            (quantization_config quant_method "fp8") is served 8-bit whatever this says
            (docs/quantization.md).
        quantize_embeddings: with quantization, the token embedding and the LM head are
            8-bit too, by the same rule with one scale per vocab row (a tied head shares
            the one table); they stay in dtype otherwise. Needs quantization.
        seed: engine seed; requests without their own seed draw one from it.
        hash_algo: prefix-cache block hash, "sha256" or "xxhash".
        async_scheduling: keep one device step in flight: the host schedules and packs
            step N+1 while step N runs and reads step N's tokens afterwards (sampled
            ids reach step N+1 on device). Outputs equal the synchronous engine's; a
            request ended by a stop token or string costs one discarded extra token.
        tensor_parallel_size: devices the model and KV caches are split over (a 1-D
            mesh over the first N devices; docs/scale_out.md). 1: one device, no mesh.
        validate: debug: range-check block ids, slot mappings, lengths and copy pairs
            on device in every step (checkify); a bad id raises instead of reading or
            writing the wrong block. Costs a sync and extra compiles; tests turn it on.
        scan_layers: "on" runs layers that repeat (every layer, or Gemma's window/full
            pattern) as one lax.scan over stacked weights, so a step's program and its
            compile time do not grow with depth (paged_jax.models.layer_scan); "off"
            unrolls them; "auto" scans on accelerators and unrolls on CPU, where XLA
            copies each layer's weight slice out of the stack every step (docs/models.md).
            True/False are taken as "on"/"off".
        distributed_coordinator_address: "host:port" of process 0's coordinator for a
            multi-process (multi-host) engine; None reads $JAX_COORDINATOR_ADDRESS, and
            without either the engine is one process. Every process then runs the same
            engine in lockstep over a mesh of all processes' devices
            (paged_jax.distributed, docs/scale_out.md).
        distributed_num_processes: processes in the job (None: $JAX_NUM_PROCESSES).
        distributed_process_id: this process's rank in [0, num_processes) (None:
            $JAX_PROCESS_ID).
        distributed_heartbeat_timeout_s: seconds after which the survivors of a process
            that died stop with an error instead of waiting for it.
        distributed_init_timeout_s: seconds jax.distributed.initialize waits for every
            process of the job to join before it fails (a peer that never starts).
        lockstep_check_interval: with several processes, compare a checksum of each
            process's schedule every this many steps (and at every step that admits
            requests; every step under validate): a divergence stops every process with
            LockstepError before its step runs.
        speculative_config: speculative decoding (docs/speculative_decoding.md): None
            (off), a SpeculativeConfig or vLLM's dict, e.g. {"method": "ngram",
            "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
            or {"method": "draft_model", "model": PATH, "num_speculative_tokens": 3}.
            Steps then run synchronously (async_scheduling gives the same outputs).
        batch_invariant: a request's tokens and logprobs are bitwise the same whatever
            runs beside it (other requests, how its prompt is chunked, prefix-cache hits,
            async or sync scheduling): every step runs the one token bucket
            max_num_batched_tokens through the general (ragged) attention path, and the
            built-in models multiply in fixed row tiles (paged_jax.models.batch_invariant).
            Costs throughput (docs/research_integration.md, "Batch invariance"); not with
            speculative_config, enable_lora, 8-bit weights or mixture-of-experts models.
        enable_lora: serve LoRA adapters (paged_jax.LoRARequest per request;
            docs/lora.md): adapter stacks on the device and a slot per token row.
        max_loras: adapters resident on the device at once (one batch may mix them);
            requests of other adapters wait until a slot frees.
        max_lora_rank: the largest adapter rank served; smaller ranks are zero-padded.
        hidden_state_layers: the layers whose residual stream the compiled step can
            return (SamplingParams.return_hidden_states; docs/research_integration.md,
            "Activations"): ``i`` is the output of decoder layer ``i`` (transformers'
            ``hidden_states[i + 1]``, before any final norm), ``-1`` the final-norm
            output. () (the default) builds programs without capture.
        steering_layers: the decoder layers whose output SamplingParams.steering_vectors
            may add a vector to (indices in [0, num_hidden_layers)); () builds programs
            without steering.
        enable_prompt_embeds: accept prompts given as embeddings ({"prompt_embeds":
            f32[T, hidden_size]}, vLLM's names): their rows replace the embedding table's
            output for the prompt; generation continues from token ids.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | float | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: PreemptionMode = "recompute"
    scheduling_policy: SchedulingPolicy = "fcfs"
    attention_backend: AttentionBackend = "auto"
    dtype: Dtype = "auto"
    kv_cache_dtype: KVCacheDtype = "auto"
    quantization: Quantization | None = None
    quantize_embeddings: bool = False
    seed: int = 0
    hash_algo: HashAlgo = "sha256"
    async_scheduling: bool = True
    tensor_parallel_size: int = 1
    validate: bool = False
    scan_layers: ScanLayers = "auto"
    distributed_coordinator_address: str | None = None
    distributed_num_processes: int | None = None
    distributed_process_id: int | None = None
    distributed_heartbeat_timeout_s: int = 30
    distributed_init_timeout_s: int = 120
    lockstep_check_interval: int = 16
    speculative_config: SpeculativeConfig | None = None
    batch_invariant: bool = False
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    hidden_state_layers: tuple[int, ...] = ()
    steering_layers: tuple[int, ...] = ()
    enable_prompt_embeds: bool = False

    def __post_init__(self) -> None:
        if (
            not is_int(self.block_size)
            or self.block_size < 1
            or self.block_size & (self.block_size - 1)
        ):
            fail(self, "block_size", "a power of two >= 1")
        if self.num_kv_blocks is not None and (
            not is_int(self.num_kv_blocks) or self.num_kv_blocks < 2
        ):
            fail(self, "num_kv_blocks", "None or an int >= 2 (block 0 is the null block)")
        if self.kv_cache_memory is not None:
            m = self.kv_cache_memory
            if not is_number(m):
                fail(self, "kv_cache_memory", "None, bytes (int > 0) or a fraction in (0, 1]")
            if isinstance(m, float) and not 0.0 < m <= 1.0:
                fail(self, "kv_cache_memory", "a fraction in (0, 1] when given as a float")
            if isinstance(m, int) and m <= 0:
                fail(self, "kv_cache_memory", "a positive number of bytes when given as an int")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            fail(self, "kv_cache_memory", "None when num_kv_blocks is given (set one of them)")
        utilization = self.gpu_memory_utilization
        if utilization is not None:
            if not is_number(utilization) or not 0.0 < utilization <= 1.0:
                fail(self, "gpu_memory_utilization", "None or a fraction in (0, 1]")
            object.__setattr__(self, "gpu_memory_utilization", float(utilization))
            for other in ("kv_cache_memory", "num_kv_blocks"):
                if getattr(self, other) is not None:
                    fail(
                        self,
                        "gpu_memory_utilization",
                        f"None when {other}={getattr(self, other)!r} is given (set one of "
                        "them: both size the KV pool)",
                    )
        if not is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            fail(self, "max_num_seqs", "an int >= 1")
        if (
            not is_int(self.max_num_batched_tokens)
            or self.max_num_batched_tokens < self.max_num_seqs
        ):
            fail(self, "max_num_batched_tokens", f"an int >= max_num_seqs={self.max_num_seqs}")
        if self.max_model_len is not None and (
            not is_int(self.max_model_len) or self.max_model_len < 2
        ):
            fail(self, "max_model_len", "None or an int >= 2")
        if isinstance(self.scan_layers, bool):  # LLM(scan_layers=True) reads naturally
            object.__setattr__(self, "scan_layers", "on" if self.scan_layers else "off")
        for name in (
            "enable_prefix_caching",
            "async_scheduling",
            "validate",
            "batch_invariant",
            "enable_lora",
            "enable_prompt_embeds",
            "quantize_embeddings",
        ):
            if not isinstance(getattr(self, name), bool):
                fail(self, name, "a bool")
        for name, allowed in (
            ("preemption_mode", PREEMPTION_MODES),
            ("scheduling_policy", SCHEDULING_POLICIES),
            ("attention_backend", ATTENTION_BACKENDS),
            ("dtype", DTYPES),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("hash_algo", HASH_ALGOS),
            ("scan_layers", SCAN_LAYERS),
        ):
            if getattr(self, name) not in allowed:
                fail(self, name, f"one of {allowed}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            fail(self, "quantization", f"None or one of {QUANTIZATIONS}")
        if self.quantize_embeddings and self.quantization is None:
            fail(
                self,
                "quantize_embeddings",
                "False without quantization (set quantization='int8' | 'fp8' for 8-bit "
                "embedding and LM head)",
            )
        if not is_int(self.seed) or not 0 <= self.seed < 2**32:
            fail(self, "seed", "an int in [0, 2**32)")
        if not is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            fail(self, "tensor_parallel_size", "an int >= 1")
        address = self.distributed_coordinator_address
        if address is not None and (
            not isinstance(address, str) or not address.rpartition(":")[2].isdigit()
        ):
            fail(self, "distributed_coordinator_address", "None or a 'host:port' string")
        n = self.distributed_num_processes
        if n is not None and (not is_int(n) or n < 1):
            fail(self, "distributed_num_processes", "None or an int >= 1")
        rank = self.distributed_process_id
        if rank is not None and (not is_int(rank) or rank < 0 or (n is not None and rank >= n)):
            want = "None or an int >= 0" + ("" if n is None else f" and < {n}")
            fail(self, "distributed_process_id", want)
        for name in (
            "distributed_heartbeat_timeout_s",
            "distributed_init_timeout_s",
            "lockstep_check_interval",
        ):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                fail(self, name, "an int >= 1")
        for name in ("max_loras", "max_lora_rank"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                fail(self, name, "an int >= 1")
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig | dict):
            fail(self, "speculative_config", "None, a SpeculativeConfig or a dict of vLLM's keys")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.coerce(spec))
        if self.batch_invariant and self.speculative_config is not None:
            fail(
                self,
                "batch_invariant",
                "False with speculative_config (a verified step's rows and draws depend on "
                "the proposals: not made batch-invariant)",
            )
        if self.batch_invariant and self.enable_lora:
            fail(
                self,
                "batch_invariant",
                "False with enable_lora=True (the adapters' low-rank products are not "
                "row-tiled: not made batch-invariant)",
            )
        for name, lowest, what in (
            ("hidden_state_layers", -1, "a tuple of distinct ints >= -1 (-1 = final norm)"),
            ("steering_layers", 0, "a tuple of distinct ints >= 0 (decoder layers)"),
        ):
            layers = getattr(self, name)
            if isinstance(layers, list | tuple) and all(is_int(i) for i in layers):
                layers = tuple(int(i) for i in layers)
                object.__setattr__(self, name, layers)
            if (
                not isinstance(layers, tuple)
                or not all(is_int(i) and i >= lowest for i in layers)
                or len(set(layers)) != len(layers)
            ):
                fail(self, name, what)
            if layers and self.speculative_config is not None:
                fail(self, name, f"() with speculative_config ({_NOT_WITH_SPEC[name]})")
        if self.enable_prompt_embeds and self.speculative_config is not None:
            fail(
                self,
                "enable_prompt_embeds",
                f"False with speculative_config ({_NOT_WITH_SPEC['enable_prompt_embeds']})",
            )

    def fitted_to(self, max_position_embeddings: int) -> EngineConfig:
        """This config as an engine over a model with ``max_position_embeddings`` runs it:
        max_model_len None becomes the model's limit (a larger one is a ValueError), and
        speculative decoding runs its steps synchronously (its proposals for step t + 1
        need step t's tokens on the host; async_scheduling=True gives the same outputs)."""
        limit = int(max_position_embeddings)
        config = self
        if config.max_model_len is None:
            config = dataclasses.replace(config, max_model_len=limit)
        elif config.max_model_len > limit:
            raise ValueError(
                f"EngineConfig.max_model_len={config.max_model_len!r} must be <= the model's "
                f"max_position_embeddings={limit}"
            )
        if config.speculative_config is not None and config.async_scheduling:
            config = dataclasses.replace(config, async_scheduling=False)
        return config

    @property
    def num_speculative_tokens(self) -> int:
        """k, the drafts a step verifies per sequence (0: no speculative decoding)."""
        spec = self.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table width: enough blocks for max_model_len tokens."""
        if self.max_model_len is None:
            raise ValueError("EngineConfig.max_model_len=None must be resolved before use")
        return cdiv(self.max_model_len, self.block_size)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """Padded num_tokens sizes: 16, 64, 256, then powers of two, up to
        max_num_batched_tokens (4x steps up to COARSE_TOKEN_BUCKETS_UP_TO, then 2x).

        A step's program is chosen by its token count alone (step_shapes), so this tuple is
        also the list of programs warm-up builds. batch_invariant: max_num_batched_tokens
        alone (every step runs one program).
        """
        if self.batch_invariant:
            return (self.max_num_batched_tokens,)
        return _power_of_two_buckets(
            min(MIN_TOKEN_BUCKET, self.max_num_batched_tokens),
            self.max_num_batched_tokens,
            COARSE_TOKEN_BUCKETS_UP_TO,
        )

    @property
    def seq_buckets(self) -> tuple[int, ...]:
        """Padded num_seqs sizes: 8, 16, 32, ... up to max_num_seqs (see seq_bucket)."""
        return _power_of_two_buckets(min(MIN_SEQ_BUCKET, self.max_num_seqs), self.max_num_seqs)

    def seq_bucket(self, num_tokens_bucket: int) -> int:
        """The padded num_seqs of every step in token bucket T: the seq bucket of min(T,
        max_num_seqs). A step has at least one token per sequence, so it always fits."""
        return bucket_for(min(num_tokens_bucket, self.max_num_seqs), self.seq_buckets)

    def step_shapes(self) -> list[tuple[int, int]]:
        """The (num_tokens, num_seqs) shape of every step program: one per token bucket.

        The sequence dimension follows from the token bucket (seq_bucket), as vLLM sizes
        its CUDA graphs by token count alone: a T x S grid would compile every pair,
        while padding a step's sequence dimension costs little next to its tokens.
        """
        return [(t, self.seq_bucket(t)) for t in self.token_buckets]


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"n={n!r} must be <= the largest bucket {buckets[-1]}")
