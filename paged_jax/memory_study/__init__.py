"""Memory study: how much KV memory holds token states under paged vs contiguous allocation.

Host code only (never imports jax). workloads -> traces; sim drives the real Scheduler
and KVCacheManager model-free; allocators simulates the contiguous baselines (Orca on a buddy allocator,
first-fit, static batches);
report runs the study and writes the summary; plots (matplotlib, lazy) draws it.
"""

from __future__ import annotations

from paged_jax.memory_study.allocators import (
    BuddySpace,
    FirstFitSpace,
    reservation_size,
    run_contiguous,
    run_static,
)
from paged_jax.memory_study.records import RunResult, StepLog
from paged_jax.memory_study.sim import run_paged
from paged_jax.memory_study.workloads import TraceRequest, Workload

__all__ = [
    "BuddySpace",
    "FirstFitSpace",
    "RunResult",
    "StepLog",
    "TraceRequest",
    "Workload",
    "reservation_size",
    "run_contiguous",
    "run_paged",
    "run_static",
]
