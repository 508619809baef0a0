"""The engine benchmark: paged engine vs contiguous-KV vs HF static batches, one trace.

All three systems get the same weights, the same trace, greedy decoding with EOS ignored
(output lengths come from the trace) and the same KV budget in bytes. Warmup and
compilation are excluded from the timings; all requests arrive at time 0 (offline).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from paged_jax.baselines.contiguous_kv import ContiguousKVEngine, kv_bytes_per_token
from paged_jax.baselines.workload import TraceRequest

TARGET_CONCURRENCY_RATIO = 2.0
TARGET_KV_UTILIZATION = 0.95


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


def run_paged(
    model: Any,
    trace: list[TraceRequest],
    *,
    budget_bytes: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    enable_prefix_caching: bool = True,
    tensor_parallel_size: int = 1,
    num_kv_blocks: int | None = None,
    kv_cache_dtype: str = "auto",
) -> SystemResult:
    """Serves the trace with the paged engine, its pool sized to budget_bytes (null block in).

    num_kv_blocks, when given, overrides the budget (a tensor-parallel run keeps the
    pool of its N=1 twin, so both schedule alike). kv_cache_dtype "fp8_e4m3"/"fp8_e5m2"
    sizes the pool with 1-byte elements.
    """
    from paged_jax.config import EngineConfig
    from paged_jax.engine import Engine
    from paged_jax.sampling_params import SamplingParams

    if num_kv_blocks is None:
        from paged_jax.worker.kv_cache_dtype import kv_cache_jnp_dtype

        kv_dtype = kv_cache_jnp_dtype(kv_cache_dtype)
        num_kv_blocks = budget_bytes // int(model.kv_bytes_per_block(block_size, kv_dtype))
    config = EngineConfig(
        tensor_parallel_size=tensor_parallel_size,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching,
        attention_backend="auto",
        dtype=str(model.config.dtype),
        num_kv_blocks=num_kv_blocks,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = Engine(model, config)
    t0 = time.perf_counter()
    num_compiles = engine.warmup()
    warmup_s = time.perf_counter() - t0
    manager = engine.kv_cache_manager
    device_s = [0.0]
    computed = [0, 0]  # real, padded tokens through the model (recomputation included)
    execute = engine.runner.execute

    def timed_execute(step_input):  # jitted step incl. the host copy of its samples
        t = time.perf_counter()
        result = execute(step_input)
        device_s[0] += time.perf_counter() - t
        computed[0] += step_input.num_tokens
        computed[1] += step_input.token_ids.shape[0]
        return result

    engine.runner.execute = timed_execute
    start = time.perf_counter()
    for r in trace:
        params = SamplingParams(temperature=0.0, max_tokens=r.num_output_tokens, ignore_eos=True)
        engine.add_request(r.request_id, list(r.prompt_token_ids), params)
    outputs: dict[str, list[int]] = {}
    max_running = used = reserved = 0
    while engine.has_unfinished():
        finished = engine.step()
        for out in finished:
            outputs[out.request_id] = out.token_ids
        running = engine.scheduler.running
        max_running = max(max_running, len(running) + len(finished))
        used += sum(req.num_computed_tokens for req in running)
        reserved += (manager.num_usable_blocks - manager.num_free_blocks) * block_size
    elapsed = time.perf_counter() - start
    stats = engine.get_stats()
    return SystemResult(
        name="paged-jax",
        elapsed_s=elapsed,
        num_requests=len(outputs),
        num_output_tokens=sum(map(len, outputs.values())),
        max_concurrent_seqs=max_running,
        kv_utilization=used / max(1, reserved),
        outputs=outputs,
        extra={
            "num_kv_blocks": num_kv_blocks,
            # All devices together (runner.bytes_per_block is one device's share).
            "kv_pool_bytes": num_kv_blocks * engine.runner.bytes_per_block * tensor_parallel_size,
            "kv_cache_dtype": kv_cache_dtype,
            "block_size": block_size,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "enable_prefix_caching": enable_prefix_caching,
            "warmup_s": warmup_s,
            "num_warmup_shapes": num_compiles,
            "num_steps": stats["num_steps"],
            "runner_execute_s": device_s[0],
            "num_computed_tokens": computed[0],
            "num_padded_tokens": computed[1],
            "median_step_ms": stats["step_time_ms"],
            "num_preemptions": stats["num_preemptions"],
            "kv_cache_usage_peak": stats["kv_cache_usage_peak"],
            "num_compiles_after_warmup": stats["num_compiles_after_warmup"],
            "tensor_parallel_size": tensor_parallel_size,
            "weight_bytes_per_device": stats["weight_bytes_per_device"],
            "kv_cache_bytes_per_device": stats["kv_cache_bytes_per_device"],
        },
    )


def run_contiguous(
    model: Any, trace: list[TraceRequest], *, budget_bytes: int, max_model_len: int
) -> SystemResult:
    """Serves the trace with the contiguous-KV baseline at the same byte budget."""
    engine = ContiguousKVEngine(model, budget_bytes, max_model_len)
    t0 = time.perf_counter()
    num_compiles = engine.runner.warmup()
    warmup_s = time.perf_counter() - t0
    start = time.perf_counter()
    for r in trace:
        engine.add_request(r)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
    elapsed = time.perf_counter() - start
    return SystemResult(
        name="contiguous-kv",
        elapsed_s=elapsed,
        num_requests=len(outputs),
        num_output_tokens=sum(map(len, outputs.values())),
        max_concurrent_seqs=engine.max_running,
        kv_utilization=engine.kv_utilization,
        outputs=outputs,
        extra={
            "num_slots": engine.max_concurrent,
            "kv_cache_bytes": engine.runner.cache_bytes,
            "warmup_s": warmup_s,
            "num_warmup_shapes": num_compiles,
            "num_steps": engine.num_steps,
            "num_computed_tokens": engine.num_computed_tokens,
            "num_padded_tokens": engine.num_padded_tokens,
        },
    )


def run_hf(
    model_path: Any,
    trace: list[TraceRequest],
    *,
    batch_size: int,
    dtype: str,
    num_threads: int | None = None,
) -> SystemResult:
    """Serves the trace with transformers generate in static batches of batch_size."""
    from paged_jax.baselines.hf_generate import run_hf_generate

    res = run_hf_generate(model_path, trace, batch_size, dtype=dtype, num_threads=num_threads)
    return SystemResult(
        name="hf-static",
        elapsed_s=res.elapsed_s,
        num_requests=len(res.outputs),
        num_output_tokens=sum(map(len, res.outputs.values())),
        max_concurrent_seqs=min(batch_size, len(trace)),
        kv_utilization=res.kv_utilization,
        outputs=res.outputs,
        extra={
            "batch_size": batch_size,
            "torch_threads": num_threads,
            "num_generated_tokens_incl_padding": res.num_generated_tokens,
        },
    )


def _match_fraction(a: SystemResult, b: SystemResult) -> float:
    same = sum(a.outputs.get(k) == v for k, v in b.outputs.items())
    return same / max(1, len(b.outputs))


def compare(results: dict[str, SystemResult]) -> dict[str, Any]:
    """Ratios of the paged engine against each baseline, the targets, and output agreement."""
    paged = results["paged-jax"]
    ratios: dict[str, Any] = {}
    targets: dict[str, Any] = {
        "kv_utilization": {
            "target": TARGET_KV_UTILIZATION,
            "measured": paged.kv_utilization,
            "met": paged.kv_utilization >= TARGET_KV_UTILIZATION,
        }
    }
    agreement: dict[str, float] = {}
    if "contiguous-kv" in results:
        contig = results["contiguous-kv"]
        conc = paged.max_concurrent_seqs / contig.max_concurrent_seqs
        ratios["concurrency_paged_vs_contiguous"] = conc
        ratios["throughput_paged_vs_contiguous"] = paged.tokens_per_s / contig.tokens_per_s
        targets["concurrency_vs_contiguous"] = {
            "target": TARGET_CONCURRENCY_RATIO,
            "measured": conc,
            "met": conc >= TARGET_CONCURRENCY_RATIO,
        }
        agreement["paged_vs_contiguous"] = _match_fraction(paged, contig)
    if "hf-static" in results:
        ratios["throughput_paged_vs_hf"] = paged.tokens_per_s / results["hf-static"].tokens_per_s
        agreement["paged_vs_hf"] = _match_fraction(paged, results["hf-static"])
    baselines = [k for k in ("contiguous-kv", "hf-static") if k in results]
    if baselines:
        ahead = all(paged.tokens_per_s > results[k].tokens_per_s for k in baselines)
        targets["throughput_ahead_of_baselines"] = {"target": True, "met": ahead}
    return {"ratios": ratios, "targets": targets, "greedy_output_agreement": agreement}


def format_table(results: dict[str, SystemResult]) -> str:
    """A fixed-width table of the headline figures, one row per system."""
    header = (
        f"{'system':<14} {'tok/s':>9} {'req/s':>7} {'max conc':>8} {'KV util':>8} "
        f"{'time s':>8} {'out tok':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in results.values():
        lines.append(
            f"{r.name:<14} {r.tokens_per_s:>9.1f} {r.requests_per_s:>7.2f} "
            f"{r.max_concurrent_seqs:>8d} {r.kv_utilization:>8.1%} {r.elapsed_s:>8.2f} "
            f"{r.num_output_tokens:>8d}"
        )
    return "\n".join(lines)


__all__ = [
    "SystemResult",
    "compare",
    "format_table",
    "kv_bytes_per_token",
    "run_contiguous",
    "run_hf",
    "run_paged",
]
