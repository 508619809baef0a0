"""The device run's engine cell: one in-process engine, a series of points, JSON after each.

    python scripts/bench_engine.py --device-run --time-limit 60 --output bench_engine.json
    python scripts/bench_engine.py --device-run --rehearse ...    # CPU, cut shape

One paged engine on a Llama-3-8B-shaped bf16 model whose random weights are drawn on the
device (paged_jax.models.random_model: no checkpoint, no host copy), warmed up once, then
one point per batch size: that many requests of a fixed prompt and output length, all
arriving at once, greedy with EOS ignored. tok/s = output tokens / the point's wall time
(prefill included). The report is rewritten after every phase and every point (atomically:
a cell killed by its timeout leaves the last complete report), and its "metrics" dict
(points, tok_s of the best point, compiles_after_warmup) is what scripts/gpu_checks.sh
checks. A point starts only while the time used plus the last point's duration stays
within time_limit; the first point always runs.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Callable
from typing import Any

from paged_jax.baselines.json_report import finite_json as finite_json  # re-exported
from paged_jax.baselines.json_report import write_json_atomic
from paged_jax.baselines.workload import TraceRequest, WorkloadConfig, make_trace
from paged_jax.constants import cdiv
from paged_jax.models.random_init import LLAMA3_8B_CONFIG

# The rehearsal's cut of LLAMA3_8B_CONFIG: 2 layers, every width / 16, the vocabulary /
# ~31, GQA 4 and the family, dtype and code path kept. A CPU runs it in seconds.
REHEARSAL_MODEL_CONFIG: dict[str, Any] = dict(
    LLAMA3_8B_CONFIG,
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=896,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    bos_token_id=1,
    eos_token_id=2,
)


@dataclasses.dataclass(frozen=True)
class CellPlan:
    """What the cell runs: the model, the engine's shape and the points.

    Attributes:
        model_config: config.json fields of the random model (random_model's hf_config).
        dtype: weights, activations and KV cache dtype.
        batches: requests per point, in run order (largest first: the headline point
            lands even when the time limit cuts the series).
        prompt_len / output_len: tokens per request (every request alike).
        block_size / max_num_batched_tokens: engine settings; max_num_seqs is the
            largest batch and the pool holds every request of it whole (no preemption).
        seed: weights and prompts.
    """

    model_config: dict[str, Any]
    dtype: str
    batches: tuple[int, ...]
    prompt_len: int
    output_len: int
    block_size: int = 16
    max_num_batched_tokens: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"CellPlan.batches={self.batches!r} must be ints >= 1")
        for name in ("prompt_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"CellPlan.{name}={getattr(self, name)!r} must be >= 1")
        if self.max_num_batched_tokens < max(self.batches):
            raise ValueError(
                f"CellPlan.max_num_batched_tokens={self.max_num_batched_tokens!r} must be "
                f">= the largest batch {max(self.batches)}"
            )

    @property
    def max_model_len(self) -> int:
        return self.prompt_len + self.output_len

    @property
    def num_kv_blocks(self) -> int:
        """Every request of the largest batch whole, one spare block each, the null block."""
        per_request = cdiv(self.max_model_len, self.block_size) + 1
        return max(self.batches) * per_request + 1

    def engine_kwargs(self) -> dict[str, Any]:
        """PagedSystem's keywords (the layer scan on: what an accelerator runs by default)."""
        return {
            "budget_bytes": 0,  # num_kv_blocks decides
            "num_kv_blocks": self.num_kv_blocks,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_num_seqs": max(self.batches),
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "scan_layers": "on",
        }

    def trace(self, index: int) -> list[TraceRequest]:
        """Point `index`'s requests: batches[index] random prompts of exactly prompt_len."""
        workload = WorkloadConfig(
            num_requests=self.batches[index],
            input_median=float(self.prompt_len),
            input_sigma=0.0,
            input_min=self.prompt_len,
            input_max=self.prompt_len,
            output_median=float(self.output_len),
            output_sigma=0.0,
            output_min=self.output_len,
            output_max=self.output_len,
            vocab_size=int(self.model_config["vocab_size"]),
            seed=self.seed + 1 + index,
        )
        return make_trace(workload)


# Sized for a ~60 s cell on an H200, by estimate (no GPU has run it yet): warm-up's step
# programs dominate (6 here, token buckets 16, 64, 256 and their decode-only twins, beside
# the small block-copy and prompt-logprobs programs; a
# deviceless H200 compile of one 8B step program took 17-26 s on a loaded 2-core CPU,
# docs/gpu_compile_steps_depth.json), so the step budget stays at 256 tokens, and the
# points, ~0.7-3 s each at these lengths, fill the rest. The report's timeline_s says
# where the time went, to re-size from.
DEVICE_PLAN = CellPlan(
    model_config=LLAMA3_8B_CONFIG,
    dtype="bfloat16",
    batches=(256, 64, 16, 1),
    prompt_len=128,
    output_len=128,
    max_num_batched_tokens=256,
)
REHEARSAL_PLAN = CellPlan(
    model_config=REHEARSAL_MODEL_CONFIG,
    dtype="bfloat16",
    batches=(8, 4, 1),
    prompt_len=32,
    output_len=16,
    max_num_batched_tokens=64,
)


def _device_facts() -> dict[str, Any]:
    import jax
    import jaxlib

    device = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "num_devices": jax.device_count(),
    }


def _device_memory() -> dict[str, int] | None:
    """The first device's allocator figures (None where the backend has none, e.g. CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if not stats:
        return None
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
    return {k: int(stats[k]) for k in keys if k in stats}


def _metrics(points: list[dict[str, Any]]) -> dict[str, float]:
    """The cell's summary: every value a finite number (points=0 until one has run)."""
    if not points:
        return {"points": 0}
    best = max(points, key=lambda p: p["tok_s"])
    return {
        "points": len(points),
        "tok_s": best["tok_s"],
        "best_batch": best["batch"],
        "compiles_after_warmup": points[-1]["compiles_after_warmup"],
    }


def _print_flushed(line: str) -> None:
    print(line, flush=True)


def run_cell(
    plan: CellPlan,
    output: str | pathlib.Path,
    *,
    time_limit: float | None = None,
    header: dict[str, Any] | None = None,
    log: Callable[[str], None] = _print_flushed,
    start: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Runs the cell, rewriting `output` after every phase and point; returns the report.

    Args:
        plan: the model, engine and points.
        output: the JSON file.
        time_limit: seconds since `start` after which no point starts (see the module
            docstring); None: every point runs.
        header: fields put first in the report (command, source, machine).
        log: progress lines (default: printed and flushed, so a killed cell's log keeps
            them).
        start: `clock()` at the process's start (default: now).
        clock: seconds, for the time limit and the timeline (tests pass a fake one).
    """
    import jax

    from paged_jax.baselines.harness import PagedSystem, kv_bytes_per_token
    from paged_jax.models.random_init import random_model

    start = clock() if start is None else start
    output = pathlib.Path(output)
    points: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        **(header or {}),
        "cell": "bench_engine",
        "phase": "init",
        "metrics": _metrics(points),
        "plan": {**dataclasses.asdict(plan), "max_model_len": plan.max_model_len},
        "time_limit_s": time_limit,
        "device": _device_facts(),
        "timeline_s": {},
        "points": points,
        "skipped_points": [],
    }

    def save(phase: str) -> None:
        report["phase"] = phase
        report["metrics"] = _metrics(points)
        report["elapsed_s"] = clock() - start
        write_json_atomic(output, report)

    report["timeline_s"]["start_to_model_init"] = clock() - start  # imports, backend
    save("model init")
    t0 = clock()
    model = random_model(plan.model_config, dtype=plan.dtype, seed=plan.seed)
    jax.block_until_ready(jax.tree.leaves(model))
    report["timeline_s"]["param_init"] = clock() - t0
    report["model"] = {
        "config": plan.model_config,
        "dtype": plan.dtype,
        "weights": "random, drawn on the device by one jitted init (no checkpoint)",
        "num_parameters": sum(int(x.size) for x in jax.tree.leaves(model)),
        "kv_bytes_per_token": kv_bytes_per_token(model),
    }
    log(
        f"model: {report['model']['num_parameters']:,} parameters in "
        f"{report['timeline_s']['param_init']:.1f} s"
    )
    save("engine build + warm-up")
    t0 = clock()
    system = PagedSystem(model, owns_model=True, **plan.engine_kwargs())
    del model  # the engine owns it (its per-layer weights are freed once stacked)
    report["timeline_s"]["engine_build"] = clock() - t0 - system.warmup_s
    report["timeline_s"]["warmup"] = system.warmup_s
    report["warmup"] = {
        "num_programs": system.num_warmup_shapes,
        **system.engine.warmup_report.summary(),
    }
    report["device_memory_after_warmup"] = _device_memory()
    log(f"warm-up: {system.num_warmup_shapes} programs in {system.warmup_s:.1f} s")
    save("points")
    last_s = 0.0
    for i, batch in enumerate(plan.batches):
        used = clock() - start
        if points and time_limit is not None and used + last_s > time_limit:
            why = f"{used:.1f} s used + {last_s:.1f} s (last point) > time limit {time_limit} s"
            report["skipped_points"].append({"batch": batch, "why": why})
            log(f"point batch={batch}: skipped ({why})")
            continue
        result = system.run(plan.trace(i))
        summary = result.summary()
        stats = system.engine.get_stats()
        last_s = result.elapsed_s
        num_prompt_tokens = batch * plan.prompt_len
        points.append(
            {
                "batch": batch,
                "prompt_len": plan.prompt_len,
                "output_len": plan.output_len,
                "tok_s": result.tokens_per_s,
                "prompt_and_output_tok_s": (num_prompt_tokens + result.num_output_tokens)
                / result.elapsed_s,
                "elapsed_s": result.elapsed_s,
                "started_at_s": used,
                "num_output_tokens": result.num_output_tokens,
                "complete": result.num_output_tokens == batch * plan.output_len,
                "compiles_after_warmup": stats["num_compiles_after_warmup"],
                "summary": summary,
                "engine_stats": stats,
                "device_memory": _device_memory(),
            }
        )
        log(
            f"point batch={batch}: {result.tokens_per_s:.1f} tok/s, "
            f"{result.elapsed_s:.2f} s, {summary['num_steps']} steps, "
            f"compiles after warm-up {stats['num_compiles_after_warmup']}"
        )
        save("points")
    save("done")
    return report


def cell_ok(report: dict[str, Any]) -> list[str]:
    """What makes the cell a failure (empty when it is not): no point, a point that did
    not produce every token, or a compile after warm-up."""
    problems = []
    points = report["points"]
    if not points:
        problems.append("no point ran")
    problems += [f"point batch={p['batch']} is incomplete" for p in points if not p["complete"]]
    compiles = report["metrics"].get("compiles_after_warmup", 0)
    if compiles:
        problems.append(f"{compiles} compiles after warm-up (must be 0)")
    return problems


__all__ = [
    "DEVICE_PLAN",
    "REHEARSAL_MODEL_CONFIG",
    "REHEARSAL_PLAN",
    "CellPlan",
    "cell_ok",
    "finite_json",
    "run_cell",
    "write_json_atomic",
]
