"""The model-free paged runner: its accounting against hand counts and the manager's own."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.memory_study.sim import OWNED, SHARED, run_paged
from paged_jax.memory_study.workloads import (
    TraceRequest,
    Workload,
    dataset_workload,
    parallel_sampling_workload,
)


def test_three_requests_by_hand():
    """block_size 4, 16 usable blocks, everything fits: no preemption, one step per token.

    A: prompt 5, output 3 (KV 7)   B: prompt 4, output 1 (KV 4)   C: prompt 9, output 2 (KV 10)
    step 0: A 5 in 2 blocks, B 4 in 1, C 9 in 3 -> tokens 18, 6 blocks; B finishes.
    step 1: A 6 (2 blocks), C 10 (3 blocks) -> 16 tokens, 5 blocks; C finishes.
    step 2: A 7 (2 blocks) -> 7 tokens; A finishes.
    """
    reqs = (
        TraceRequest("A", (101, 102, 103, 104, 105), 3),
        TraceRequest("B", (201, 202, 203, 204), 1),
        TraceRequest("C", tuple(range(301, 310)), 2),
    )
    run = run_paged(
        Workload("hand", reqs, kv_budget_tokens=64, max_model_len=32),
        block_size=4,
        check_invariants=True,
    )
    a = run.arrays
    assert list(a["token_states"]) == [18, 16, 7]
    assert list(a["logical_blocks"]) == [6, 5, 2]
    assert list(a["used_blocks"]) == [6, 5, 2]
    # reserved: slots of the last block the request still fills; internal: never filled.
    # step 0: A 8 slots, KV 7 -> reserved 2, internal 1; B 0, 0; C 12 slots, KV 10 -> 1, 2.
    assert list(a["reserved"]) == [3, 1, 0]
    assert list(a["internal_frag"]) == [3, 3, 1]
    assert list(a["free"]) == [4 * 10, 4 * 11, 4 * 14]
    assert list(a["batch_size"]) == [3, 2, 1]
    assert list(a["max_tail_waste"]) == [3, 2, 1]
    assert run.num_preemptions == 0
    assert run.extra["free_blocks_at_end"] == 16


def test_parallel_sampling_shares_the_prompt_blocks():
    """n = 3 children of a 9-token prompt, block_size 4: the two full prompt blocks are
    shared (the hit stops one token short of the prompt), each child owns its third block.

    step 0: 9 logical blocks (3 x 3), 5 used (2 shared + 3 owned) -> 4 saved.
    step 1: same; the 2-token child finishes.  step 2: 6 logical, 4 used -> 2 saved.
    step 3: only the 4-token child: 3 blocks, nothing shared.
    """
    prompt = tuple(range(500, 509))
    reqs = tuple(TraceRequest(f"c{j}", prompt, out, "g") for j, out in enumerate((2, 3, 4)))
    wl = Workload("par", reqs, kv_budget_tokens=64, max_model_len=32)
    on = run_paged(wl, block_size=4, record_occupancy=True, check_invariants=True)
    off = run_paged(wl, block_size=4, enable_prefix_caching=False, check_invariants=True)
    saved_on = on.arrays["logical_blocks"] - on.arrays["used_blocks"]
    assert list(on.arrays["logical_blocks"]) == [9, 9, 6, 3]
    assert list(saved_on) == [4, 4, 2, 0]
    assert list(off.arrays["used_blocks"]) == [9, 9, 6, 3]
    # Physical token states: 8 shared prompt tokens + each child's own tokens.
    assert list(on.arrays["token_states"]) == [8 + 3 * 1, 8 + 3 * 2, 8 + 2 * 3, 12]
    assert list(on.arrays["logical_tokens"]) == list(off.arrays["token_states"])
    occ = on.occupancy
    assert occ.shape == (4, 16)
    assert [int((row == SHARED).sum()) for row in occ] == [2, 2, 2, 0]
    assert [int((row == OWNED).sum()) for row in occ] == [3, 3, 2, 3]
    assert on.summary()["share_saved_by_sharing"] == pytest.approx(10 / 27)


def test_paged_waste_stays_under_one_block_under_pressure():
    """A tight pool forces recompute preemptions; the invariants hold at every step."""
    wl = dataset_workload("sharegpt", 12, kv_budget_tokens=2048, max_model_len=2048, seed=3)
    for bs in (8, 32):
        run = run_paged(
            wl, block_size=bs, max_num_seqs=16, max_num_batched_tokens=256, check_invariants=True
        )
        a = run.arrays
        assert run.num_preemptions > 0
        usable = 2048 // bs
        assert (a["max_tail_waste"] < bs).all()  # paged waste per request < one block
        assert (a["reserved"] + a["internal_frag"] < bs * np.maximum(a["batch_size"], 1)).all()
        assert (a["used_blocks"] + a["free"] // bs == usable).all()
        total = sum(a[c] for c in ("token_states", "reserved", "internal_frag", "free"))
        assert (total == usable * bs).all()
        assert (a["external_frag"] == 0).all()
        assert run.extra["free_blocks_at_end"] == usable


def test_parallel_sampling_workload_children_share_one_prompt():
    wl = parallel_sampling_workload(5, 4, kv_budget_tokens=4096, seed=1)
    assert len(wl.requests) == 20
    groups = {}
    for r in wl.requests:
        groups.setdefault(r.group, set()).add(r.prompt_token_ids)
    assert len(groups) == 5 and all(len(p) == 1 for p in groups.values())
