"""Contiguous-reservation baselines (the paper's Orca-style Max / Pow2 / Oracle).

Each admitted request gets one contiguous chunk of the KV address space, sized by a
reservation policy and placed first-fit; it keeps the chunk until it finishes, so it
never grows and is never preempted. Stepping mirrors the paged Scheduler: running
requests first (one decode token, or the next prefill chunk), then FCFS admission
with head-of-line blocking, within max_num_seqs and max_num_batched_tokens.

Address space of a 24-slot budget after three first-fit allocations and one free::

    0      5              13   16               24
    |  A   |   B (freed)   | C  |     free       |
           ^ hole of 8      ^ a 9-slot request fits only after 16
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

from paged_jax.memory_study.records import RunResult, StepLog
from paged_jax.memory_study.workloads import TraceRequest, Workload

POLICIES = ("max", "pow2", "oracle")


def reservation_size(policy: str, kv_len: int, max_model_len: int) -> int:
    """Slots a contiguous allocator reserves for a request that will write kv_len entries.

    Args:
        policy: "max" (max_model_len, the true length unknown), "pow2" (the next power
            of two >= kv_len, capped at max_model_len) or "oracle" (exactly kv_len).
        kv_len: KV entries the request writes (prompt + output - 1).
        max_model_len: the model's longest context.
    """
    if policy == "max":
        return max_model_len
    if policy == "pow2":
        return min(1 << (kv_len - 1).bit_length(), max_model_len)
    if policy == "oracle":
        return kv_len
    raise ValueError(f"policy={policy!r} must be one of {POLICIES}")


class FirstFitSpace:
    """A linear address space of `size` slots with first-fit allocation.

    Args:
        size: slots in the space.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = []  # sorted chunk starts
        self._sizes: dict[int, int] = {}

    def holes(self) -> list[tuple[int, int]]:
        """Free (start, length) runs in address order."""
        out = []
        pos = 0
        for s in self._starts:
            if s > pos:
                out.append((pos, s - pos))
            pos = s + self._sizes[s]
        if pos < self.size:
            out.append((pos, self.size - pos))
        return out

    def alloc(self, n: int) -> int | None:
        """Places n slots in the lowest hole that fits; returns the start or None."""
        for start, length in self.holes():
            if length >= n:
                bisect.insort(self._starts, start)
                self._sizes[start] = n
                return start
        return None

    def free(self, start: int) -> None:
        self._starts.remove(start)
        del self._sizes[start]

    @property
    def num_allocated(self) -> int:
        return sum(self._sizes.values())


@dataclasses.dataclass
class _Seq:
    tr: TraceRequest
    start: int
    size: int
    num_tokens: int
    num_computed: int = 0
    num_output: int = 0


def run_contiguous(
    workload: Workload,
    policy: str,
    *,
    max_num_seqs: int = 512,
    max_num_batched_tokens: int = 4096,
) -> RunResult:
    """Serves the trace with contiguous reservations at the workload's KV budget.

    Args:
        workload: the trace and the budget (a space of kv_budget_tokens slots).
        policy: reservation policy, see reservation_size.
        max_num_seqs: batch cap, as the paged scheduler's.
        max_num_batched_tokens: token budget per step, as the paged scheduler's.

    Returns:
        The run's per-step accounting (see records.py).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} must be one of {POLICIES}")
    budget = workload.kv_budget_tokens
    mml = workload.max_model_len

    def reserve(tr: TraceRequest) -> int:
        return reservation_size(policy, tr.kv_len, mml)

    for tr in workload.requests:
        if reserve(tr) > budget:
            raise ValueError(
                f"kv_budget_tokens={budget!r} must hold request {tr.req_id!r}'s "
                f"{reserve(tr)}-slot {policy} reservation"
            )
    space = FirstFitSpace(budget)
    waiting = collections.deque(workload.requests)
    running: list[_Seq] = []
    log = StepLog()
    while waiting or running:
        token_budget = max_num_batched_tokens
        scheduled: list[_Seq] = []
        for seq in running:
            if token_budget == 0:
                break
            n = min(seq.num_tokens - seq.num_computed, token_budget)
            seq.num_computed += n
            token_budget -= n
            scheduled.append(seq)
        while waiting and token_budget > 0 and len(running) < max_num_seqs:
            tr = waiting[0]
            size = reserve(tr)
            start = space.alloc(size)
            if start is None:
                break  # head-of-line blocking, as the paged scheduler's FCFS admission
            waiting.popleft()
            seq = _Seq(tr, start, size, num_tokens=len(tr.prompt_token_ids))
            seq.num_computed = min(seq.num_tokens, token_budget)
            token_budget -= seq.num_computed
            running.append(seq)
            scheduled.append(seq)
        _record(log, running, waiting, space, reserve, budget)
        for seq in scheduled:
            if seq.num_computed < seq.num_tokens:
                continue  # a prefill chunk that does not reach the end samples nothing
            seq.num_tokens += 1
            seq.num_output += 1
            if seq.num_output >= seq.tr.output_len:
                running.remove(seq)
                space.free(seq.start)
    assert space.num_allocated == 0, "a finished request kept its contiguous chunk"
    return log.finish(
        workload=workload.name,
        allocator=f"contig-{policy}",
        kv_budget_tokens=budget,
        num_requests=len(workload.requests),
    )


def _record(log: StepLog, running, waiting, space: FirstFitSpace, reserve, budget: int) -> None:
    tokens = sum(s.num_computed for s in running)
    reserved = sum(min(s.size, s.tr.kv_len) - s.num_computed for s in running)
    internal = sum(s.size - min(s.size, s.tr.kv_len) for s in running)
    holes = space.holes()
    need = reserve(waiting[0]) if waiting else 0
    external = sum(length for _, length in holes if length < need)
    free = sum(length for _, length in holes) - external
    assert tokens + reserved + internal + external + free == budget, (
        "contiguous accounting does not add up to the address space: a chunk overlaps or is lost"
    )
    log.add(
        token_states=tokens,
        reserved=reserved,
        internal_frag=internal,
        external_frag=external,
        free=free,
        batch_size=len(running),
        waiting=len(waiting),
        logical_tokens=tokens,
        logical_blocks=0,
        used_blocks=0,
        max_tail_waste=max((s.size - s.num_computed for s in running), default=0),
    )
