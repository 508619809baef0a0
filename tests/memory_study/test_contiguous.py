"""Contiguous baselines: first-fit placement and the accounting, checked by hand."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_jax.memory_study.allocators import (
    BuddySpace,
    FirstFitSpace,
    reservation_size,
    run_contiguous,
    run_static,
    static_batch_size,
)
from paged_jax.memory_study.workloads import TraceRequest, Workload


def _three_requests(budget: int) -> Workload:
    # KV lengths (prompt + output - 1): A 4+2-1 = 5, B 2+3-1 = 4, C 3+5-1 = 7.
    reqs = (
        TraceRequest("A", (11, 12, 13, 14), 2),
        TraceRequest("B", (21, 22), 3),
        TraceRequest("C", (31, 32, 33), 5),
    )
    return Workload("three", reqs, kv_budget_tokens=budget, max_model_len=8)


def test_reservation_sizes():
    assert reservation_size("max", 5, 2048) == 2048
    # pow2 rounds the output length (the paper: 32 positions for a 25-token output):
    # prompt 10 + output 25 writes 34 entries and reserves 10 + 32.
    assert reservation_size("pow2", 34, 2048, output_len=25) == 42
    assert [reservation_size("pow2", 3 + o - 1, 2048, output_len=o) for o in (1, 2, 3, 8, 9)] == [
        3 + 1,
        3 + 2,
        3 + 4,
        3 + 8,
        3 + 16,
    ]
    assert reservation_size("pow2", 1500, 1024, output_len=700) == 1024  # capped
    with pytest.raises(ValueError, match="output_len=None must be an int"):
        reservation_size("pow2", 5, 8)
    assert reservation_size("oracle", 37, 2048) == 37
    with pytest.raises(ValueError, match="policy='lifo' must be one of"):
        reservation_size("lifo", 5, 8)


def test_first_fit_leaves_a_hole_a_larger_request_cannot_use():
    space = FirstFitSpace(14)
    assert [space.alloc(5), space.alloc(4), space.alloc(3)] == [0, 5, 9]
    space.free(0)
    assert space.holes() == [(0, 5), (12, 2)]
    assert space.alloc(6) is None  # 7 slots free, no hole of 6
    assert space.alloc(2) == 0  # first fit: the lowest hole that fits
    assert space.holes() == [(2, 3), (12, 2)]


def test_oracle_accounting_by_hand():
    """Budget 14, oracle: A at [0,5), B at [5,9); C (7 slots) does not fit the 5-slot hole.

    step 0: A prefill 4, B prefill 2. C waits: the hole [9,14) is external fragmentation.
    step 1: A 5, B 3; A samples its 2nd token and finishes -> [0,5) is freed.
    step 2: B 4; holes [0,5) and [9,14) hold 10 free slots but neither fits C's 7:
            all 10 are external fragmentation. B finishes.
    step 3: C placed at [0,7), prefill 3; steps 4-7 decode 4, 5, 6, 7; C finishes.
    """
    run = run_contiguous(_three_requests(14), "oracle", max_num_batched_tokens=64)
    assert run.allocator == "contig-oracle"
    a = run.arrays
    assert run.num_steps == 8
    assert list(a["batch_size"]) == [2, 2, 1, 1, 1, 1, 1, 1]
    assert list(a["token_states"]) == [6, 8, 4, 3, 4, 5, 6, 7]
    # reserved = true KV length - computed, summed: step 0 (5-4)+(4-2), step 1 0+(4-3).
    assert list(a["reserved"]) == [3, 1, 0, 4, 3, 2, 1, 0]
    assert list(a["internal_frag"]) == [0] * 8
    assert list(a["external_frag"]) == [5, 5, 10, 0, 0, 0, 0, 0]
    assert list(a["free"]) == [0, 0, 0, 7, 7, 7, 7, 7]
    assert list(a["waiting"]) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert run.num_preemptions == 0
    # Utilization over all steps: (6+8+4+3+4+5+6+7) / 8 steps / 14 slots.
    assert run.summary()["utilization_busy"] == pytest.approx(43 / 8 / 14)
    # Under load (steps 0-2, C waiting): (6 + 8 + 4) / 3 / 14.
    assert run.summary()["utilization_load"] == pytest.approx(18 / 3 / 14)


def test_max_and_pow2_accounting_by_hand():
    # max: every request reserves max_model_len = 8; only A fits in 14 slots at first.
    run = run_contiguous(_three_requests(14), "max", max_num_batched_tokens=64)
    a = run.arrays
    # A steps 0-1, B admitted at step 2 (decodes to 4 by step 4), C at step 5 (3 -> 7).
    assert list(a["token_states"]) == [4, 5, 2, 3, 4, 3, 4, 5, 6, 7]
    assert list(a["batch_size"]) == [1] * 10
    assert (a["token_states"][0], a["reserved"][0], a["internal_frag"][0]) == (4, 1, 3)
    assert list(a["external_frag"]) == [6] * 5 + [0] * 5  # hole [8,14) < 8 while one waits
    assert list(a["free"]) == [0] * 5 + [6] * 5
    # pow2 (prompt + pow2(output), capped at 8): A 4 + 2 = 6 at [0,6), B 2 + 4 = 6 at
    # [6,12), C 3 + 8 -> 8 does not fit [12,14).
    run = run_contiguous(_three_requests(14), "pow2", max_num_batched_tokens=64)
    step0 = {k: int(v[0]) for k, v in run.arrays.items()}
    assert step0["token_states"] == 4 + 2
    assert step0["reserved"] == (5 - 4) + (4 - 2)
    assert step0["internal_frag"] == (6 - 5) + (6 - 4)
    assert (step0["external_frag"], step0["free"]) == (2, 0)


def test_buddy_splits_merges_and_rounds():
    space = BuddySpace(32)
    # 5 -> block 8 at 0 (32 split into 16 + 8 + 8), 8 -> 8 at 8, 3 -> 4 at 16.
    assert [space.alloc(5), space.alloc(8), space.alloc(3)] == [0, 8, 16]
    assert space.holes() == [(20, 4), (24, 8)]
    assert space.num_allocated == 8 + 8 + 4
    space.free(8)
    assert space.alloc(9) is None  # 20 slots free, no free 16-slot block
    assert space.alloc(4) == 20  # the smallest block that fits, not the lowest
    space.free(0)  # 0 and 8 are buddies: they merge into [0, 16)
    assert space.holes() == [(0, 16), (24, 8)]
    assert space.alloc(9) == 0
    assert space.chunk_size(9) == 16 and space.num_allocated == 16 + 4 + 4
    # A size that is not a power of two: roots 16 + 8 that never merge.
    space = BuddySpace(24)
    assert space.holes() == [(0, 16), (16, 8)]
    assert [space.alloc(16), space.alloc(8), space.alloc(1)] == [0, 16, None]
    space.free(16)
    space.free(0)
    assert space.holes() == [(0, 16), (16, 8)] and space.alloc(17) is None
    with pytest.raises(ValueError, match="size=0 must be an int >= 1"):
        BuddySpace(0)


def test_buddy_oracle_run_counts_rounding_as_internal_fragmentation():
    # Budget 16: A 5 -> 8 at [0,8), B 4 -> 4 at [8,12), C 7 -> 8 fits no free block.
    run = run_contiguous(
        _three_requests(16), "oracle", placement="buddy", max_num_batched_tokens=64
    )
    assert run.allocator == "orca-oracle"
    step0 = {k: int(v[0]) for k, v in run.arrays.items()}
    assert step0["internal_frag"] == (8 - 5) + (4 - 4)
    assert (step0["external_frag"], step0["free"]) == (4, 0)
    assert list(run.arrays["batch_size"][:2]) == [2, 2]
    with pytest.raises(ValueError, match="placement='worst' must be one of"):
        run_contiguous(_three_requests(16), "oracle", placement="worst")


def test_static_batches_by_hand():
    """Budget 17, max_model_len 8: a static batch holds 2 requests.

    batch 1 = A (output 2), B (output 3): step 0 prefills both, A ends at step 1 and
    keeps its 8 slots idle until B ends at step 2. batch 2 = C: prefill + 4 decodes.
    """
    assert static_batch_size(17, 8, 512) == 2 and static_batch_size(17, 8, 1) == 1
    run = run_static(_three_requests(17), max_num_batched_tokens=64)
    a = run.arrays
    assert run.allocator == "static"
    assert list(a["batch_size"]) == [2, 2, 1, 1, 1, 1, 1, 1]
    assert list(a["waiting"]) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert list(a["token_states"]) == [6, 8, 4, 3, 4, 5, 6, 7]
    # step 2: A done holds 8 idle slots; B live holds 8 - 4 beyond its true length.
    assert int(a["internal_frag"][2]) == 8 + (8 - 4)
    assert list(a["free"]) == [1, 1, 1, 9, 9, 9, 9, 9]
    with pytest.raises(ValueError, match="kv_budget_tokens=6 must hold one max_model_len=8"):
        run_static(_three_requests(6))


def test_contiguous_rejects_a_reservation_beyond_the_budget():
    with pytest.raises(ValueError, match="kv_budget_tokens=6 must hold request 'A'"):
        run_contiguous(_three_requests(6), "max")


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([FirstFitSpace, BuddySpace]),
    st.sampled_from([32, 24]),
    st.lists(st.tuples(st.booleans(), st.integers(1, 9)), max_size=40),
)
def test_chunks_never_overlap(space_cls, size, ops):
    space = space_cls(size)
    live: dict[int, int] = {}
    for do_alloc, n in ops:
        if do_alloc or not live:
            fits = any(length >= space.chunk_size(n) for _, length in space.holes())
            start = space.alloc(n)
            assert (start is not None) == fits
            if start is not None:
                live[start] = space.chunk_size(n)
                assert space_cls is FirstFitSpace or start % live[start] == 0  # aligned
        else:
            start = sorted(live)[n % len(live)]
            space.free(start)
            del live[start]
        used = np.zeros(size, dtype=int)
        for s, chunk in live.items():
            used[s : s + chunk] += 1
        for s, length in space.holes():
            used[s : s + length] += 1
        assert used.min() == used.max() == 1  # chunks and holes tile the space
        assert space.num_allocated == sum(live.values())
    if space_cls is BuddySpace:
        for start in list(live):
            space.free(start)
        assert space.holes() == BuddySpace(size).holes()  # everything merged back
