"""The simulated GPU clock: the step-time arithmetic, the virtual driver, the bisection."""

from __future__ import annotations

import json

import pytest

from paged_jax.baselines.workload import TraceRequest
from paged_jax.memory_study import serving_sim as sim
from paged_jax.memory_study.serving_study import bisect_rate

# hidden 2, 1 layer, ffn 4, vocab 10, 6 positions: every count below is done by hand.
TINY = dict(
    hidden_size=2, num_layers=1, ffn_dim=4, vocab_size=10, max_position_embeddings=6,
    dtype_bytes=2,
)  # fmt: skip


def test_step_time_by_hand():
    """matmul params = 1 x (4*2*2 + 2*2*4) = 32; all params = 32 + biases and layer norms
    (4*2 + 4 + 2 + 2*2*2 = 22) + final norm 4 + embeddings 10*2 + positions (6+2)*2 = 94;
    weight bytes 188; KV per token 2 * 1 * 2 * 2 = 8 bytes.

    One step: a decode row with 3 tokens in KV, and a 2-token prefill:
    new tokens 1 + 2 = 3; KV touched (3+1) + (0+2) = 6; attended pairs 3+1 and 1+2 = 7;
    sampled rows 2. bytes = 188 + 6*8 = 236; flops = 2*32*3 + 2*2*10*2 + 4*1*2*7 = 328.
    """
    memory_bound = sim.StepTimeModel(**TINY, hbm_bytes_per_s=100, peak_flops_per_s=1000,
                                     overhead_s=0.5)  # fmt: skip
    assert memory_bound.matmul_params == 32
    assert memory_bound.num_params == 94
    assert memory_bound.weight_bytes == 188
    assert memory_bound.kv_bytes_per_token == 8
    cost = sim.StepCost()
    cost.add(3, 1, True)
    cost.add(0, 2, True)
    assert (cost.new, cost.kv, cost.pairs, cost.sampled) == (3, 6, 7, 2)
    assert cost.time(memory_bound) == pytest.approx(236 / 100 + 0.5)
    compute_bound = sim.StepTimeModel(**TINY, hbm_bytes_per_s=1e6, peak_flops_per_s=1000,
                                      overhead_s=0.5)  # fmt: skip
    assert cost.time(compute_bound) == pytest.approx(328 / 1000 + 0.5)
    # rows=2 counts two equal sequences.
    two = sim.StepCost()
    two.add(3, 1, True, rows=2)
    assert (two.new, two.kv, two.pairs, two.sampled) == (2, 8, 8, 2)

    # The defaults are the paper's setting: 800 KiB of KV per token, ~26 GB of weights,
    # 12 GiB of KV = 15,728 slots (the paper's Table 1: "15.7K").
    opt = sim.StepTimeModel()
    assert opt.kv_bytes_per_token == 819_200
    assert 25.5e9 < opt.weight_bytes < 26e9
    assert sim.kv_budget_tokens(opt) == 15_728
    with pytest.raises(ValueError, match=r"StepTimeModel.hidden_size=0 must be an int >= 1"):
        sim.StepTimeModel(hidden_size=0)
    with pytest.raises(ValueError, match=r"StepTimeModel.overhead_s=-1"):
        sim.StepTimeModel(overhead_s=-1)


def test_driver_latency_accounting_by_hand():
    """Every step takes exactly 1 s (no bytes or FLOPs worth counting, 1 s overhead).

    r1: prompt 3, output 2, arrives at 0; r2: prompt 2, output 2, arrives at 0.5 (during
    r1's first step, so it waits for that step's end).
    paged, Orca (Oracle, Pow2): t=1 r1 prefilled (token 1); t=2 r1 token 2 (done,
    latency 2), r2 prefilled; t=3 r2 token 2 (done, latency 2.5). Batch 1, 2, 1 over 3 s.
    Orca (Max) in a 2048-slot budget holds one 2048-slot reservation, so r2 is admitted
    when r1 frees it: done at 4, as the static batch (r1 alone, then r2).
    """
    model = sim.StepTimeModel(hbm_bytes_per_s=1e30, peak_flops_per_s=1e30, overhead_s=1.0)
    trace = [TraceRequest("r1", (5, 6, 7), 2), TraceRequest("r2", (8, 9), 2)]
    arrivals = [0.0, 0.5]
    want = {
        "paged": (2.0, 3.0, 4 / 3),
        "orca-oracle": (2.0, 3.0, 4 / 3),
        "orca-pow2": (2.0, 3.0, 4 / 3),
        "orca-max": (2.0, 4.0, 1.0),
        "fastertransformer": (2.0, 4.0, 1.0),
    }
    for system, (r1_done, r2_done, batch) in want.items():
        clock = sim.VirtualClock()
        server = sim.make_system(system, model, clock, budget_tokens=2048)
        run = sim.serve_online(server, trace, arrivals, clock=clock, sleep=clock.sleep)
        finish = {r.request_id: r.finish_s for r in run.records}
        assert finish == {"r1": r1_done, "r2": r2_done}, system
        norm = sorted(r.normalized_latency_s for r in run.records)
        assert norm == sorted([r1_done / 2, (r2_done - 0.5) / 2]), system
        assert server.extra()["time_avg_batch_size"] == pytest.approx(batch), system


def test_simulation_is_deterministic_and_orders_the_systems():
    """Two runs of one trace give identical results; on a short ShareGPT-like trace at a
    rate where memory binds, paged batches more than Oracle, Oracle more than Max."""
    model = sim.StepTimeModel()
    budget = sim.kv_budget_tokens(model)
    trace = sim.make_trace("sharegpt", 200, seed=3)
    reqs, arrivals = trace.at_rate(4.0, 30.0)
    assert 80 < len(reqs) < 200
    first = sim.simulate("paged", reqs, arrivals, model, budget_tokens=budget)
    assert json.dumps(first) == json.dumps(
        sim.simulate("paged", reqs, arrivals, model, budget_tokens=budget)
    )
    assert first["num_requests"] == len(reqs)
    batch = {
        s: sim.simulate(s, reqs, arrivals, model, budget_tokens=budget)["time_avg_batch_size"]
        for s in ("orca-oracle", "orca-max")
    }
    assert first["time_avg_batch_size"] > batch["orca-oracle"] > batch["orca-max"]
    # A higher rate compresses the same requests.
    assert trace.at_rate(8.0, 10.0)[0] == reqs[: len(trace.at_rate(8.0, 10.0)[0])]
    with pytest.raises(ValueError, match=r"rate=0 must be a finite number > 0"):
        trace.at_rate(0, 60.0)
    with pytest.raises(ValueError, match=r"name='orca-lru' must be one of"):
        sim.make_system("orca-lru", model, sim.VirtualClock(), budget_tokens=budget)


def test_bisection_finds_a_known_threshold():
    threshold = 3.7

    def latency(rate: float) -> float:
        return 1.0 if rate <= threshold else 10.0

    for start in (0.2, 1.0, 3.7, 50.0):
        rate, points = bisect_rate(latency, 2.0, start, rel_tol=0.01)
        assert threshold / 1.01 <= rate <= threshold, start
        assert len(points) < 20, start
        assert all(lat <= 2.0 for r, lat in points if r <= rate)
    assert bisect_rate(lambda r: 10.0, 2.0, 1.0, min_rate=0.1)[0] == 0.0
    assert bisect_rate(lambda r: 1.0, 2.0, 1.0, max_rate=30.0)[0] == 30.0
    with pytest.raises(ValueError, match=r"bound=0"):
        bisect_rate(latency, 0, 1.0)


def test_study_end_to_end_on_a_tiny_trace():
    """run_study's shape on 3 s of Alpaca: every system gets a rate at every bound, the
    ratios are paged's rate over each, and the tables print every row."""
    from paged_jax.memory_study import serving_study

    settings = serving_study.SimStudySettings(
        datasets=("alpaca",),
        duration_s=3.0,
        other_factors=(8.0,),
        overhead_scales=(2.0,),
        flops_scales=(),
        rel_tol=1.0,
        sensitivity_rel_tol=1.0,
        num_unloaded=10,
        trace_requests={"alpaca": 2000},
    )
    summary = serving_study.run_study(settings)
    res = summary["traces"]["alpaca"]
    assert [b["factor"] for b in res["bounds"]] == [4.0, 8.0]
    main = res["bounds"][0]
    for system in sim.SYSTEMS:
        assert main["sustained"][system] > 0, system
        assert res["points"][system], system
    for system, ratio in main["paged_over"].items():
        assert ratio == pytest.approx(main["sustained"]["paged"] / main["sustained"][system])
    assert res["sensitivity"][0]["overhead_s"] == pytest.approx(2 * sim.STEP_OVERHEAD_S)
    tables = serving_study.markdown_tables(json.loads(json.dumps(summary)))
    assert "| alpaca | 4x |" in tables and "overhead 10 ms" in tables and "Fig. 13" in tables
