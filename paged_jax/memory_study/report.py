"""Runs the whole memory study and writes its JSON summary.

run_study() serves every workload with every allocator; summary_dict() turns the
results into the JSON the markdown page and the figures are made from.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from collections.abc import Callable

from paged_jax.memory_study.allocators import POLICIES, run_contiguous, run_static
from paged_jax.memory_study.records import RunResult
from paged_jax.memory_study.sim import run_paged
from paged_jax.memory_study.workloads import (
    dataset_workload,
    parallel_sampling_workload,
    shared_prefix_workload,
)

# Share of KV memory holding token states, PagedAttention paper Figure 2. Only the range
# 20.4%-38.2% for prior systems is restated in the project's seed documents; the split
# per system is read off the paper's figure.
PAPER_TOKEN_STATES = {
    "orca-max": 0.204,
    "orca-pow2": 0.268,
    "orca-oracle": 0.382,
    "paged": 0.963,
}
PAPER_PARALLEL_SAMPLING_SAVING = (0.061, 0.098)  # paper, parallel sampling on Alpaca


@dataclasses.dataclass(frozen=True)
class StudySettings:
    """Sizes of the study. The defaults are the published run (a few minutes on 2 cores).

    Args:
        num_sharegpt: requests in the ShareGPT-like trace.
        num_alpaca: requests in the Alpaca-like trace.
        sharegpt_budget: KV budget (token slots) for ShareGPT-like workloads.
        alpaca_budget: KV budget (token slots) for Alpaca-like workloads.
        num_shared_prefix: requests in the shared-system-prompt trace.
        system_prompt_len: tokens of the shared system prompt.
        num_parallel_prompts: prompts per parallel-sampling trace (x n requests).
        parallel_ns: the n values of parallel sampling.
        block_sizes: paged block sizes compared.
        sharing_block_size: block size of the sharing runs.
        max_model_len: longest context (the "max" baseline's reservation).
        max_num_seqs: batch cap of every allocator (high: memory is the limit).
        max_num_batched_tokens: token budget per step of every allocator.
        seed: trace seed.
    """

    num_sharegpt: int = 1000
    num_alpaca: int = 2000
    sharegpt_budget: int = 65536
    alpaca_budget: int = 16384
    num_shared_prefix: int = 1000
    system_prompt_len: int = 256
    num_parallel_prompts: int = 300
    parallel_ns: tuple[int, ...] = (2, 4, 6)
    block_sizes: tuple[int, ...] = (8, 16, 32)
    sharing_block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 4096
    seed: int = 0


SMALL_STUDY = StudySettings(
    num_sharegpt=40,
    num_alpaca=60,
    sharegpt_budget=8192,
    alpaca_budget=2048,
    num_shared_prefix=40,
    system_prompt_len=64,
    num_parallel_prompts=12,
    max_num_seqs=64,
    max_num_batched_tokens=1024,
)


@dataclasses.dataclass
class Study:
    """All runs of one study.

    Attributes:
        settings: what was run.
        base: workload name -> runs (paged per block size, the Orca policies,
            first-fit Oracle, static).
        sharing: workload name -> (run with prefix caching, run without).
        seconds: wall time of the whole study.
    """

    settings: StudySettings
    base: dict[str, list[RunResult]]
    sharing: dict[str, tuple[RunResult, RunResult]]
    seconds: float = 0.0

    def find(self, workload: str, allocator: str) -> RunResult:
        for r in self.base.get(workload, []):
            if r.allocator == allocator:
                return r
        raise KeyError(f"no run {allocator!r} on {workload!r}")


def run_study(
    settings: StudySettings = StudySettings(),
    *,
    check_invariants: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Study:
    """Serves every workload with every allocator at equal KV budgets.

    Args:
        settings: trace sizes and budgets.
        check_invariants: check the KV manager's invariants after every paged step (slow).
        progress: called with one line per finished run.
    """
    s = settings
    t0 = time.perf_counter()
    sched = dict(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens)

    def note(run: RunResult, seconds: float) -> None:
        if progress is not None:
            u = run.summary()["utilization_load"]
            progress(
                f"{run.workload:>24} {run.allocator:<18} steps={run.num_steps:<6} "
                f"util(load)={u:.3f} {seconds:.1f}s"
            )

    base: dict[str, list[RunResult]] = {}
    for dataset, n, budget in (
        ("sharegpt", s.num_sharegpt, s.sharegpt_budget),
        ("alpaca", s.num_alpaca, s.alpaca_budget),
    ):
        wl = dataset_workload(
            dataset, n, kv_budget_tokens=budget, max_model_len=s.max_model_len, seed=s.seed
        )
        runs = []
        for bs in s.block_sizes:
            t = time.perf_counter()
            run = run_paged(
                wl,
                block_size=bs,
                record_occupancy=(dataset == "sharegpt" and bs == s.sharing_block_size),
                check_invariants=check_invariants,
                **sched,
            )
            note(run, time.perf_counter() - t)
            runs.append(run)
        for policy in POLICIES:  # the paper's Orca: buddy placement
            t = time.perf_counter()
            run = run_contiguous(wl, policy, placement="buddy", **sched)
            note(run, time.perf_counter() - t)
            runs.append(run)
        t = time.perf_counter()  # first-fit Oracle: what the buddy's rounding costs
        run = run_contiguous(wl, "oracle", placement="first-fit", **sched)
        note(run, time.perf_counter() - t)
        runs.append(run)
        t = time.perf_counter()  # FasterTransformer-style static batches
        run = run_static(wl, **sched)
        note(run, time.perf_counter() - t)
        runs.append(run)
        base[dataset] = runs

    sharing_workloads = [
        shared_prefix_workload(
            s.num_shared_prefix,
            system_prompt_len=s.system_prompt_len,
            kv_budget_tokens=s.alpaca_budget,
            max_model_len=s.max_model_len,
            seed=s.seed,
        )
    ]
    sharing_workloads += [
        parallel_sampling_workload(
            s.num_parallel_prompts,
            n,
            kv_budget_tokens=s.alpaca_budget,
            max_model_len=s.max_model_len,
            seed=s.seed,
        )
        for n in s.parallel_ns
    ]
    sharing: dict[str, tuple[RunResult, RunResult]] = {}
    for i, wl in enumerate(sharing_workloads):
        pair = []
        for caching in (True, False):
            t = time.perf_counter()
            first = i == 0 and caching
            run = run_paged(
                wl,
                block_size=s.sharing_block_size,
                enable_prefix_caching=caching,
                record_occupancy=first,
                snapshot_request=wl.requests[1].req_id if first else None,
                check_invariants=check_invariants,
                allocator=f"paged-{s.sharing_block_size}" + ("" if caching else "-nocache"),
                **sched,
            )
            note(run, time.perf_counter() - t)
            pair.append(run)
        sharing[wl.name] = (pair[0], pair[1])
    return Study(s, base, sharing, time.perf_counter() - t0)


def summary_dict(study: Study, command: str = "") -> dict:
    """The study as JSON-ready numbers: one entry per run, plus the sharing comparison."""
    runs = [r.summary() for runs in study.base.values() for r in runs]
    sharing = []
    for name, (on, off) in study.sharing.items():
        a, b = on.summary(), off.summary()
        sharing.append(
            {
                "workload": name,
                "num_requests": a["num_requests"],
                "mean_blocks_saved": a["mean_blocks_saved_by_sharing"],
                "max_blocks_saved": a["max_blocks_saved_by_sharing"],
                "share_saved": a["share_saved_by_sharing"],
                "mean_logical_blocks": a["mean_logical_blocks"],
                "mean_used_blocks": a["mean_used_blocks"],
                "mean_batch_size": a["mean_batch_size"],
                "mean_batch_size_no_sharing": b["mean_batch_size"],
                "num_steps": a["num_steps"],
                "num_steps_no_sharing": b["num_steps"],
                "num_preemptions": a["num_preemptions"],
                "num_preemptions_no_sharing": b["num_preemptions"],
                "utilization_load": a["utilization_load"],
                "utilization_load_no_sharing": b["utilization_load"],
                "logical_utilization_load": a["logical_utilization_load"],
                "logical_utilization_load_no_sharing": b["logical_utilization_load"],
                "prefix_hit_tokens": a["prefix_hit_tokens"],
            }
        )
    return {
        "command": command,
        "settings": dataclasses.asdict(study.settings),
        "seconds": round(study.seconds, 1),
        "paper_token_states": PAPER_TOKEN_STATES,
        "paper_parallel_sampling_saving": PAPER_PARALLEL_SAMPLING_SAVING,
        "runs": runs,
        "sharing": sharing,
    }


def write_json(summary: dict, path: str | pathlib.Path) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, sort_keys=False) + "\n")
