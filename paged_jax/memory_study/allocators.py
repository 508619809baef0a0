"""Contiguous-reservation baselines: the paper's Orca (Max / Pow2 / Oracle) and a
FasterTransformer-style static batch.

Each admitted request gets one contiguous chunk of the KV address space, sized by a
reservation policy and placed by a buddy allocator (the paper's Orca) or first-fit; it
keeps the chunk until it finishes, so it never grows and is never preempted. Stepping
mirrors the paged Scheduler: running requests first (one decode token, or the next
prefill chunk), then FCFS admission with head-of-line blocking, within max_num_seqs and
max_num_batched_tokens. The static batch (run_static) has no iteration-level
scheduling: it takes the earliest requests, as many as max-length reservations fit,
and serves them until the last one finishes before it forms the next batch.

Address space of a 24-slot budget after three first-fit allocations and one free::

    0      5              13   16               24
    |  A   |   B (freed)   | C  |     free       |
           ^ hole of 8      ^ a 9-slot request fits only after 16

The same three requests (5, 8 and 3 slots) in a 32-slot buddy space: each chunk is
rounded up to a power of two and sits at a multiple of its size::

    0       8               16   20      24              32
    |  A 8  |   B 8 (freed) | C4 | free 4|    free 8     |
    ^ a 9-slot request needs a free 16-slot buddy block: 20 slots free, none fits
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

from paged_jax.memory_study.records import RunResult, StepLog
from paged_jax.memory_study.workloads import TraceRequest, Workload

POLICIES = ("max", "pow2", "oracle")
PLACEMENTS = ("buddy", "first-fit")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def reservation_size(
    policy: str, kv_len: int, max_model_len: int, *, output_len: int | None = None
) -> int:
    """Slots a contiguous allocator reserves for a request that will write kv_len entries.

    Args:
        policy: "max" (max_model_len, the true length unknown), "pow2" (the paper's
            Orca (Pow2): the prompt plus the output length rounded up to a power of two,
            e.g. 32 output positions for a 25-token output, capped at max_model_len) or
            "oracle" (exactly kv_len).
        kv_len: KV entries the request writes (prompt + output - 1, plus any extra the
            caller adds).
        max_model_len: the model's longest context.
        output_len: tokens the request generates; required by "pow2".
    """
    if policy == "max":
        return max_model_len
    if policy == "pow2":
        if output_len is None or not (1 <= output_len <= kv_len + 1):
            raise ValueError(
                f"output_len={output_len!r} must be an int in [1, kv_len + 1 = {kv_len + 1}]:"
                " the pow2 policy rounds the output length"
            )
        prompt_part = kv_len + 1 - output_len
        return min(prompt_part + next_pow2(output_len), max_model_len)
    if policy == "oracle":
        return kv_len
    raise ValueError(f"policy={policy!r} must be one of {POLICIES}")


def static_batch_size(kv_budget_tokens: int, max_model_len: int, max_num_seqs: int) -> int:
    """Requests a FasterTransformer-style static batch holds: max-length reservations
    that fit the budget, at most max_num_seqs."""
    if max_model_len < 1 or kv_budget_tokens < max_model_len:
        raise ValueError(
            f"kv_budget_tokens={kv_budget_tokens!r} must hold one max_model_len="
            f"{max_model_len!r} reservation"
        )
    return min(kv_budget_tokens // max_model_len, max_num_seqs)


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

    def chunk_size(self, n: int) -> int:
        """Slots an n-slot request occupies (first-fit: exactly n)."""
        return n

    @property
    def num_allocated(self) -> int:
        return sum(self._sizes.values())


class BuddySpace:
    """A linear address space of `size` slots with buddy allocation.

    A request for n slots takes a block of next_pow2(n) slots aligned to its size: the
    smallest free block that fits (lowest address among equals) is split in halves
    until it has that size; on free, a block merges with its buddy (the other half of
    the block it was split from) while the buddy is free. A size that is not a power of
    two is covered by power-of-two root blocks, largest first, which never merge.

    Args:
        size: slots in the space.
    """

    def __init__(self, size: int) -> None:
        if not (isinstance(size, int) and size >= 1):
            raise ValueError(f"size={size!r} must be an int >= 1 (slots in the space)")
        self.size = size
        self._free: dict[int, int] = {}  # free block start -> length
        self._used: dict[int, int] = {}  # allocated block start -> length
        self._root_end: dict[int, int] = {}  # root start -> end, bounds merging
        pos = 0
        for bit in range(size.bit_length() - 1, -1, -1):
            if size >> bit & 1:
                self._free[pos] = 1 << bit
                self._root_end[pos] = pos + (1 << bit)
                pos += 1 << bit
        self._roots = sorted(self._root_end)

    def _root_of(self, start: int) -> int:
        return self._roots[bisect.bisect_right(self._roots, start) - 1]

    def holes(self) -> list[tuple[int, int]]:
        """Free (start, length) blocks in address order; each is one buddy block, so a
        request fits only inside one (adjacent free blocks are not merged here)."""
        return sorted(self._free.items())

    def chunk_size(self, n: int) -> int:
        """Slots an n-slot request occupies: the next power of two."""
        return next_pow2(n)

    def alloc(self, n: int) -> int | None:
        """Places n slots in a next_pow2(n) buddy block; returns the start or None."""
        need = next_pow2(n)
        fits = [(length, start) for start, length in self._free.items() if length >= need]
        if not fits:
            return None
        length, start = min(fits)
        del self._free[start]
        while length > need:  # split, keeping the lower half
            length //= 2
            self._free[start + length] = length
        self._used[start] = need
        return start

    def free(self, start: int) -> None:
        length = self._used.pop(start)
        root = self._root_of(start)
        end = self._root_end[root]
        while True:
            offset = start - root
            buddy = root + (offset ^ length)
            if buddy + length > end or self._free.get(buddy) != length:
                break
            del self._free[buddy]
            start = min(start, buddy)
            length *= 2
        self._free[start] = length

    @property
    def num_allocated(self) -> int:
        return sum(self._used.values())


def make_space(placement: str, size: int) -> FirstFitSpace | BuddySpace:
    """The address space a placement names (see PLACEMENTS)."""
    if placement == "buddy":
        return BuddySpace(size)
    if placement == "first-fit":
        return FirstFitSpace(size)
    raise ValueError(f"placement={placement!r} must be one of {PLACEMENTS}")


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
    placement: str = "first-fit",
    max_num_seqs: int = 512,
    max_num_batched_tokens: int = 4096,
) -> RunResult:
    """Serves the trace with contiguous reservations at the workload's KV budget.

    Args:
        workload: the trace and the budget (a space of kv_budget_tokens slots).
        policy: reservation policy, see reservation_size.
        placement: "buddy" (the paper's Orca; the run is named orca-<policy>) or
            "first-fit" (named contig-<policy>).
        max_num_seqs: batch cap, as the paged scheduler's.
        max_num_batched_tokens: token budget per step, as the paged scheduler's.

    Returns:
        The run's per-step accounting (see records.py); a buddy block's rounding is
        internal fragmentation.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} must be one of {POLICIES}")
    budget = workload.kv_budget_tokens
    mml = workload.max_model_len
    space = make_space(placement, budget)

    def reserve(tr: TraceRequest) -> int:
        size = reservation_size(policy, tr.kv_len, mml, output_len=tr.output_len)
        return space.chunk_size(size)

    for tr in workload.requests:
        if reserve(tr) > budget:
            raise ValueError(
                f"kv_budget_tokens={budget!r} must hold request {tr.req_id!r}'s "
                f"{reserve(tr)}-slot {policy} reservation"
            )
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
    name = "orca" if placement == "buddy" else "contig"
    return log.finish(
        workload=workload.name,
        allocator=f"{name}-{policy}",
        kv_budget_tokens=budget,
        num_requests=len(workload.requests),
    )


def run_static(
    workload: Workload,
    *,
    max_num_seqs: int = 512,
    max_num_batched_tokens: int = 4096,
) -> RunResult:
    """Serves the trace in FasterTransformer-style static batches (run "static").

    A batch takes the earliest waiting requests, as many as max_model_len reservations
    fit the budget (static_batch_size), and runs until its last request finishes: no
    request joins or leaves it in between. Prefill is chunked under the token budget as
    in run_contiguous. A request that has finished keeps its slots until the batch ends:
    they count as internal fragmentation, and it no longer counts in batch_size.

    Args:
        workload: the trace and the budget.
        max_num_seqs: batch cap.
        max_num_batched_tokens: token budget per step.

    Returns:
        The run's per-step accounting (see records.py).
    """
    budget = workload.kv_budget_tokens
    mml = workload.max_model_len
    size = static_batch_size(budget, mml, max_num_seqs)
    for tr in workload.requests:
        if tr.kv_len > mml:
            raise ValueError(
                f"request {tr.req_id!r} writes {tr.kv_len} KV entries: must be <= "
                f"max_model_len={mml!r}"
            )
    waiting = collections.deque(workload.requests)
    log = StepLog()
    while waiting:
        batch = [
            _Seq(tr, i * mml, mml, num_tokens=len(tr.prompt_token_ids))
            for i, tr in enumerate(waiting.popleft() for _ in range(min(size, len(waiting))))
        ]
        while any(s.num_output < s.tr.output_len for s in batch):
            token_budget = max_num_batched_tokens
            scheduled = []
            for seq in batch:
                if seq.num_output >= seq.tr.output_len or token_budget == 0:
                    continue
                n = min(seq.num_tokens - seq.num_computed, token_budget)
                seq.num_computed += n
                token_budget -= n
                scheduled.append(seq)
            live = [s for s in batch if s.num_output < s.tr.output_len]
            done = [s for s in batch if s.num_output >= s.tr.output_len]
            tokens = sum(s.num_computed for s in live)
            reserved = sum(s.tr.kv_len - s.num_computed for s in live)
            internal = sum(mml - s.tr.kv_len for s in live) + mml * len(done)
            log.add(
                token_states=tokens,
                reserved=reserved,
                internal_frag=internal,
                external_frag=0,
                free=budget - mml * len(batch),
                batch_size=len(live),
                waiting=len(waiting),
                logical_tokens=tokens,
                logical_blocks=0,
                used_blocks=0,
                max_tail_waste=max((mml - s.num_computed for s in live), default=0),
            )
            for seq in scheduled:
                if seq.num_computed < seq.num_tokens:
                    continue
                seq.num_tokens += 1
                seq.num_output += 1
    return log.finish(
        workload=workload.name,
        allocator="static",
        kv_budget_tokens=budget,
        num_requests=len(workload.requests),
    )


def _record(log: StepLog, running, waiting, space, reserve, budget: int) -> None:
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
