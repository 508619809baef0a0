"""Figure 14 on the simulated clock: paged forks (parallel sampling, beam search) and Orca
with one reservation per sample / beam."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from paged_jax.baselines.workload import TraceRequest
from paged_jax.memory_study import serving_sim as sim

# Weights and KV cost nothing, every step 1 s: step counts become seconds.
ONE_SECOND = sim.StepTimeModel(hbm_bytes_per_s=1e30, peak_flops_per_s=1e30, overhead_s=1.0)


def _serve(system, mode, width, trace, arrivals, model=ONE_SECOND, budget=2048):
    clock = sim.VirtualClock()
    server = sim.make_system(system, model, clock, budget_tokens=budget, mode=mode, width=width)
    run = sim.serve_online(server, trace, arrivals, clock=clock, sleep=clock.sleep)
    return server, run


@pytest.mark.parametrize("mode", ["parallel", "beam"])
def test_a_forked_request_returns_every_sample_and_its_latency_is_per_output_token(mode):
    """One request, prompt 20, output 5, width 3, alone at 1 s a step: paged prefills
    once (the prompt's sample is token 1), then 3 sequences decode tokens 2..5: 5 steps,
    as Orca's one prefill row then 3 rows. It returns 3 token lists of 5; the driver
    divides the latency (5 s) by one sequence's length (5), the paper's normalized
    latency, not by the 15 tokens of all samples."""
    trace = [TraceRequest("r", tuple(range(3, 23)), 5)]
    for system in ("paged", "orca-oracle"):
        server, run = _serve(system, mode, 3, trace, [0.0])
        (record,) = run.records
        assert record.finish_s == 5.0, system
        assert record.num_output_tokens == 5, system
        assert record.normalized_latency_s == 1.0, system
        tokens = run.outputs["r"]
        assert len(tokens) == 3 and all(len(t) == 5 for t in tokens), system
        assert not server.has_unfinished(), system
    if mode == "beam":  # the search's beams: distinct sequences, best first
        assert len({tuple(t) for t in tokens}) <= 3


def test_orca_reserves_one_chunk_per_sample_all_or_none():
    """Oracle reserves prompt + output - 1 = 29 slots per copy, a 32-slot buddy chunk:
    3 copies hold 96 slots. In a 64-slot space 2 copies fit and 3 never do."""
    model = ONE_SECOND
    req = TraceRequest("r", tuple(range(3, 13)), 20)
    clock = sim.VirtualClock()
    orca = sim.OrcaSim(model, clock, "oracle", budget_tokens=2048, copies=3, max_model_len=64)
    orca.add(req)
    orca.step()
    assert orca.extra()["peak_reserved_tokens"] == 3 * 32
    assert orca.num_running == 1
    small = sim.OrcaSim(model, clock, "oracle", budget_tokens=64, copies=3, max_model_len=64)
    small.add(req)
    small.step()
    assert small.num_running == 0 and small.extra()["peak_reserved_tokens"] == 0
    two = sim.OrcaSim(model, clock, "oracle", budget_tokens=64, copies=2, max_model_len=64)
    two.add(req)
    two.step()
    assert two.num_running == 1 and two.extra()["peak_reserved_tokens"] == 64
    with pytest.raises(ValueError, match=r"copies=0 must be an int"):
        sim.OrcaSim(model, clock, "oracle", budget_tokens=64, copies=0, max_model_len=64)


def test_paged_shares_blocks_where_orca_reserves_copies():
    """The same Alpaca-like trace served with n = 4 samples and 4 beams: paged holds fewer
    KV slots at its peak than Orca (Oracle) reserves, because samples share the prompt's
    blocks and beams also their common generated blocks (beams save more); paged with
    basic sampling shares nothing."""
    model = sim.StepTimeModel()
    budget = sim.kv_budget_tokens(model)
    trace = sim.make_trace("alpaca", 400, seed=5)
    reqs, arrivals = trace.at_rate(10.0, 2.0)
    assert 10 < len(reqs) < 40
    saved = {}
    for mode in ("parallel", "beam"):
        paged, run = _serve("paged", mode, 4, reqs, arrivals, model, budget)
        orca, orca_run = _serve("orca-oracle", mode, 4, reqs, arrivals, model, budget)
        assert len(run.records) == len(orca_run.records) == len(reqs)
        extra = paged.extra()
        assert extra["peak_physical_blocks"] * sim.BLOCK_SIZE < orca.extra()["peak_reserved_tokens"]
        saved[mode] = extra["blocks_saved_by_sharing"]
    assert 0 < saved["parallel"] < saved["beam"]
    basic, _ = _serve("paged", "basic", 1, reqs, arrivals, model, budget)
    assert basic.extra()["blocks_saved_by_sharing"] == 0.0
    with pytest.raises(ValueError, match=r"width=2 must be 1 for basic sampling"):
        sim.make_system("paged", model, sim.VirtualClock(), budget_tokens=budget, width=2)
    with pytest.raises(ValueError, match=r"fastertransformer serves basic sampling only"):
        sim.make_system(
            "fastertransformer", model, sim.VirtualClock(), budget_tokens=budget, mode="beam",
            width=2,
        )  # fmt: skip


_RUN_BEAMS = """
import json
from paged_jax.memory_study import serving_sim as sim
m = sim.StepTimeModel()
trace = sim.make_trace("alpaca", 400, seed=2)
reqs, arrivals = trace.at_rate(40.0, 0.5)
# A budget of 1,024 slots: forks preempt and recompute, the paths most prone to drift.
res = sim.simulate("paged", reqs, arrivals, m, budget_tokens=1024, mode="beam", width=4)
print(json.dumps({k: v for k, v in res.items() if k != "wall_s"}))
"""


def test_beam_runs_are_deterministic_across_hash_seeds():
    """The same trace under pressure (preemptions) gives the same results in processes
    with different string hashing: nothing depends on set or dict-of-hash order."""
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _RUN_BEAMS], capture_output=True, text=True, env=env,
            check=True,
        )  # fmt: skip
        outs.append(json.loads(proc.stdout))
    assert outs[0] == outs[1]
    assert outs[0]["num_preemptions"] > 0
    assert outs[0]["num_requests"] > 10


def test_fork_study_end_to_end_on_a_tiny_trace():
    """run_fork_study's shape: every cell has a rate per system at each bound, ratios are
    paged's rate over each, the paper's figures sit beside their cells."""
    from paged_jax.memory_study import serving_study

    settings = serving_study.ForkServingSettings(
        systems=("paged", "orca-oracle"),
        cells=(("parallel", 2), ("beam", 2)),
        duration_s=1.0,
        other_factors=(),
        rel_tol=1.0,
        num_unloaded=2,
        trace_requests={"alpaca": 80},
    )
    summary = json.loads(json.dumps(serving_study.run_fork_study(settings)))
    cells = summary["traces"]["alpaca"]["cells"]
    assert [(c["mode"], c["width"]) for c in cells] == [("parallel", 2), ("beam", 2)]
    for c in cells:
        main = c["bounds"][0]
        for s in settings.systems:
            assert main["sustained"][s] > 0, (c["mode"], s)
        for s, ratio in main["paged_over"].items():
            assert ratio == pytest.approx(main["sustained"]["paged"] / main["sustained"][s])
    assert [c["paper_over_oracle"] for c in cells] == [None, None]  # no number for n, w = 2
    assert [c["paper_saving"] for c in cells] == [[0.061, 0.098], [0.376, 0.552]]
    assert 0 < cells[0]["paged_saving_at_sustained"] < cells[1]["paged_saving_at_sustained"]
    tables = serving_study.fork_markdown_tables(summary)
    assert "| alpaca | beam | 2 | 4x |" in tables and "(37.6-55.2%)" in tables
