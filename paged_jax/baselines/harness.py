"""The engine benchmark's systems: the paged engine, contiguous-KV baselines, HF generate.

Each system is built (and compiled) once and then serves the same trace once per run():
same weights, greedy decoding with EOS ignored (output lengths come from the trace).
Warmup and compilation are excluded from the timings; all requests arrive at time 0.
Import only what a process needs: the HF system never imports jax and the others never
import torch (scripts/bench_engine.py runs each in its own process).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from paged_jax.baselines.workload import TraceRequest

if TYPE_CHECKING:
    from paged_jax.baselines.contiguous_kv import ContiguousKVEngine


def kv_bytes_per_token(model: Any) -> int:
    """Bytes one token's K and V take across all layers (the paged pool's per-token cost)."""
    return int(model.kv_bytes_per_block(1))


@dataclasses.dataclass
class SystemResult:
    """One system's measurements (useful tokens = the trace's requested output tokens).

    Attributes:
        name: system name.
        elapsed_s: serving wall time, warmup excluded.
        num_requests / num_output_tokens: requests served and useful tokens generated.
        max_concurrent_seqs: most sequences in flight in one step (batch rows for HF).
        kv_utilization: token slots holding tokens / token slots reserved, both summed
            over steps (a time average weighted by step, not by wall time).
        outputs: request id -> generated token ids (for the cross-system check).
        extra: system-specific figures (preemptions, compiles, slots, ...).
    """

    name: str
    elapsed_s: float
    num_requests: int
    num_output_tokens: int
    max_concurrent_seqs: int
    kv_utilization: float
    outputs: dict[str, list[int]]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    def summary(self) -> dict[str, Any]:
        """The JSON record (outputs left out)."""
        return {
            "tokens_per_s": self.tokens_per_s,
            "requests_per_s": self.requests_per_s,
            "elapsed_s": self.elapsed_s,
            "num_requests": self.num_requests,
            "num_output_tokens": self.num_output_tokens,
            "max_concurrent_seqs": self.max_concurrent_seqs,
            "kv_utilization": self.kv_utilization,
            **self.extra,
        }


class PagedSystem:
    """The paged engine, built and warmed up once, serving the trace once per run().

    The pool is sized to budget_bytes (null block included). Between runs the prefix
    cache is reset, so no run reuses blocks an earlier run computed. owns_model hands
    the model to the engine (Engine's owns_model: its per-layer weights are freed once
    stacked for the layer scan, so a large model is not held twice); scan_layers is
    EngineConfig's.
    """

    def __init__(
        self,
        model: Any,
        *,
        budget_bytes: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        async_scheduling: bool = True,
        tensor_parallel_size: int = 1,
        num_kv_blocks: int | None = None,
        kv_cache_dtype: str = "auto",
        owns_model: bool = False,
        scan_layers: str = "auto",
    ):
        from paged_jax.config import EngineConfig
        from paged_jax.engine import Engine
        from paged_jax.worker.kv_cache_dtype import kv_cache_jnp_dtype

        self.model = model
        self.block_size = block_size
        # Bytes of one block of the whole model (all devices), in the KV dtype.
        self.block_bytes = int(
            model.kv_bytes_per_block(block_size, kv_cache_jnp_dtype(kv_cache_dtype))
        )
        # num_kv_blocks overrides the budget (a tensor-parallel run keeps the pool of its
        # N=1 twin, so both schedule alike).
        self.num_kv_blocks = (
            budget_bytes // self.block_bytes if num_kv_blocks is None else num_kv_blocks
        )
        self.config = EngineConfig(
            tensor_parallel_size=tensor_parallel_size,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            attention_backend="auto",
            dtype=str(model.config.dtype),
            async_scheduling=async_scheduling,
            scan_layers=scan_layers,
        )
        self.engine = Engine(model, self.config, owns_model=owns_model)
        t0 = time.perf_counter()
        self.num_warmup_shapes = self.engine.warmup()
        self.warmup_s = time.perf_counter() - t0
        self._counts = [0, 0, 0]  # scheduled sequences, real tokens, padded tokens
        dispatch = self.engine.runner.dispatch

        def counted(step_input, **kwargs):
            self._counts[0] += step_input.num_seqs
            self._counts[1] += step_input.num_tokens
            self._counts[2] += step_input.token_ids.shape[0]
            return dispatch(step_input, **kwargs)

        self.engine.runner.dispatch = counted

    def run(self, trace: list[TraceRequest]) -> SystemResult:
        from paged_jax.sampling_params import SamplingParams

        engine, manager, cfg = self.engine, self.engine.kv_cache_manager, self.config
        manager.reset_prefix_cache()
        self._counts[:] = [0, 0, 0]
        steps0, pre0 = engine.get_stats()["num_steps"], engine.scheduler.num_preemptions
        engine.reset_step_times()  # the host times below cover this run's steps only
        step_cpu = 0.0
        start = time.perf_counter()
        for r in trace:
            params = SamplingParams(
                temperature=0.0, max_tokens=r.num_output_tokens, ignore_eos=True
            )
            engine.add_request(r.request_id, list(r.prompt_token_ids), params)
        outputs: dict[str, list[int]] = {}
        max_running = used = reserved = 0
        while engine.has_unfinished():
            c0 = time.thread_time()
            finished = engine.step()
            step_cpu += time.thread_time() - c0
            for out in finished:
                outputs[out.request_id] = out.token_ids
            running = engine.scheduler.running
            max_running = max(max_running, len(running) + len(finished))
            used += sum(req.num_computed_tokens for req in running)
            reserved += (manager.num_usable_blocks - manager.num_free_blocks) * self.block_size
        elapsed = time.perf_counter() - start
        stats = engine.get_stats()
        num_seqs = max(1, self._counts[0])
        return SystemResult(
            name="paged-jax",
            elapsed_s=elapsed,
            num_requests=len(outputs),
            num_output_tokens=sum(map(len, outputs.values())),
            max_concurrent_seqs=max_running,
            kv_utilization=used / max(1, reserved),
            outputs=outputs,
            extra={
                "num_kv_blocks": self.num_kv_blocks,
                "kv_pool_bytes": self.num_kv_blocks * self.block_bytes,
                "kv_cache_dtype": cfg.kv_cache_dtype,
                "tensor_parallel_size": cfg.tensor_parallel_size,
                "weight_bytes_per_device": stats["weight_bytes_per_device"],
                "kv_cache_bytes_per_device": stats["kv_cache_bytes_per_device"],
                "block_size": self.block_size,
                "max_num_seqs": cfg.max_num_seqs,
                "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "enable_prefix_caching": cfg.enable_prefix_caching,
                "async_scheduling": cfg.async_scheduling,
                "warmup_s": self.warmup_s,
                "num_warmup_shapes": self.num_warmup_shapes,
                "num_steps": stats["num_steps"] - steps0,
                "num_scheduled_seqs": self._counts[0],
                "num_computed_tokens": self._counts[1],
                "num_padded_tokens": self._counts[2],
                "host_wall_ms_per_step_median": stats["host_time_ms"],
                "host_wall_us_per_seq": 1e3 * stats["host_time_total_ms"] / num_seqs,
                "host_thread_cpu_us_per_seq": 1e6 * step_cpu / num_seqs,
                "num_preemptions": engine.scheduler.num_preemptions - pre0,
                "kv_cache_usage_peak": stats["kv_cache_usage_peak"],
                "num_compiles_after_warmup": stats["num_compiles_after_warmup"],
            },
        )


def run_paged(model: Any, trace: list[TraceRequest], **kwargs: Any) -> SystemResult:
    """Builds a PagedSystem (keywords as its constructor) and serves the trace once."""
    return PagedSystem(model, **kwargs).run(trace)


class ContiguousSystem:
    """The contiguous-KV baseline under one reservation policy, compiled once."""

    def __init__(
        self,
        model: Any,
        *,
        budget_bytes: int,
        max_model_len: int,
        policy: str,
        max_num_seqs: int,
    ):
        self.model, self.budget_bytes, self.max_model_len = model, budget_bytes, max_model_len
        self.policy, self.max_num_seqs = policy, max_num_seqs
        self.runner = None
        engine = self.new_engine()
        t0 = time.perf_counter()
        self.num_warmup_shapes = engine.runner.warmup()
        self.warmup_s = time.perf_counter() - t0
        self.runner = engine.runner

    def new_engine(self) -> ContiguousKVEngine:
        """A fresh engine (empty address space, no requests) over the compiled runner."""
        from paged_jax.baselines.contiguous_kv import ContiguousKVEngine

        return ContiguousKVEngine(
            self.model,
            self.budget_bytes,
            self.max_model_len,
            policy=self.policy,
            max_num_seqs=self.max_num_seqs,
            runner=self.runner,
        )

    def run(self, trace: list[TraceRequest]) -> SystemResult:
        engine = self.new_engine()
        start = time.perf_counter()
        for r in trace:
            engine.add_request(r)
        outputs: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.request_id] = out.token_ids
        elapsed = time.perf_counter() - start
        return SystemResult(
            name=f"contiguous-{self.policy}",
            elapsed_s=elapsed,
            num_requests=len(outputs),
            num_output_tokens=sum(map(len, outputs.values())),
            max_concurrent_seqs=engine.max_running,
            kv_utilization=engine.kv_utilization,
            outputs=outputs,
            extra={
                "policy": self.policy,
                "budget_token_slots": engine.space.size,
                "cache_rows": engine.max_concurrent,
                "kv_cache_bytes": engine.runner.cache_bytes,
                "warmup_s": self.warmup_s,
                "num_warmup_shapes": self.num_warmup_shapes,
                "num_steps": engine.num_steps,
                "num_computed_tokens": engine.num_computed_tokens,
                "num_padded_tokens": engine.num_padded_tokens,
            },
        )


class HFSystem:
    """transformers generate in length-sorted static batches; the model is loaded once."""

    def __init__(self, model_path: Any, *, dtype: str, num_threads: int | None):
        import torch
        import transformers

        self.model_path, self.dtype, self.num_threads = model_path, dtype, num_threads
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype)
        ).eval()

    def run(
        self, trace: list[TraceRequest], batch_size: int, *, num_threads: int | None = None
    ) -> SystemResult:
        """One pass over the trace; num_threads (torch intra-op) overrides the default."""
        from paged_jax.baselines.hf_generate import run_hf_generate

        res = run_hf_generate(
            self.model_path,
            trace,
            batch_size,
            dtype=self.dtype,
            num_threads=self.num_threads if num_threads is None else num_threads,
            model=self.model,
        )
        return SystemResult(
            name="hf-static",
            elapsed_s=res.elapsed_s,
            num_requests=len(res.outputs),
            num_output_tokens=sum(map(len, res.outputs.values())),
            max_concurrent_seqs=res.max_concurrent_seqs,
            kv_utilization=res.kv_utilization,
            outputs=res.outputs,
            extra={
                "batch_size": batch_size,
                "torch_threads": res.num_threads,
                "length_sorted_batches": True,
                "num_generated_tokens_incl_padding": res.num_generated_tokens,
            },
        )


__all__ = [
    "ContiguousSystem",
    "HFSystem",
    "PagedSystem",
    "SystemResult",
    "kv_bytes_per_token",
]
