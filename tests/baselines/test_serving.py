"""Online serving host logic: arrivals, the driver on a fake clock, metrics, sustained rate."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paged_jax.baselines.serving import (
    OnlineRun,
    RequestRecord,
    ReservationServer,
    StaticBatchServer,
    analyze_curves,
    latency_bound,
    paired_analysis,
    poisson_arrivals,
    ratio_interval,
    run_metrics,
    serve_online,
    sustained_rate,
    system_curves,
)
from paged_jax.baselines.workload import (
    DatasetTraceConfig,
    TraceRequest,
    load_jsonl_trace,
    make_dataset_trace,
    trace_summary,
)


def test_poisson_arrivals_seeded_rate_and_errors():
    a = poisson_arrivals(4000, 5.0, seed=3)
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    np.testing.assert_array_equal(a, poisson_arrivals(4000, 5.0, seed=3))
    assert not np.array_equal(a, poisson_arrivals(4000, 5.0, seed=4))
    assert abs(np.diff(a).mean() - 0.2) < 0.01  # mean gap 1 / rate
    with pytest.raises(ValueError, match=r"rate=0 must be a finite number > 0"):
        poisson_arrivals(3, 0, seed=0)
    with pytest.raises(ValueError, match=r"num_requests=0 must be >= 1"):
        poisson_arrivals(0, 1.0, seed=0)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        assert dt >= 0
        self.t += dt


class OneAtATime:
    """A server whose step takes 1 s and finishes the oldest request after `steps` steps."""

    def __init__(self, clock: FakeClock, steps: int = 2):
        self.clock, self.steps, self.queue, self.added_at = clock, steps, [], {}

    def add(self, req):
        self.added_at[req.request_id] = self.clock.t
        self.queue.append([req, 0])

    def step(self):
        self.clock.t += 1.0
        head = self.queue[0]
        head[1] += 1
        if head[1] == self.steps:
            self.queue.pop(0)
            return [(head[0].request_id, [7] * head[0].num_output_tokens)]
        return []

    def has_unfinished(self):
        return bool(self.queue)

    @property
    def num_running(self):
        return min(1, len(self.queue))


def _req(i: int, out: int = 4) -> TraceRequest:
    return TraceRequest(f"r{i}", (5, 6), out)


def test_driver_adds_only_arrived_requests_and_measures_from_arrival():
    clock = FakeClock()
    server = OneAtATime(clock)
    trace = [_req(0), _req(1), _req(2, out=2)]
    run = serve_online(server, trace, [0.0, 0.5, 10.0], clock=clock, sleep=clock.sleep)
    # r1 arrives during r0's first step and is added after it; r2 waits for its arrival.
    assert server.added_at == {"r0": 0.0, "r1": 1.0, "r2": 10.0}
    rec = {r.request_id: r for r in run.records}
    assert (rec["r0"].finish_s, rec["r1"].finish_s, rec["r2"].finish_s) == (2.0, 4.0, 12.0)
    assert rec["r1"].latency_s == 3.5 and rec["r1"].normalized_latency_s == 3.5 / 4
    assert rec["r2"].normalized_latency_s == 1.0
    assert run.outputs["r2"] == [7, 7] and run.num_steps == 6
    assert run.max_running == 2  # at r0's last step: r1 waiting + r0 finishing
    # Time-averaged: steps of 1 s running 1, 2, 1, 1 then (after the idle gap) 1, 1
    # request(s), over 12 s from the first arrival to the last finish.
    assert run.mean_running == pytest.approx(7 / 12)
    m = run_metrics(run)
    assert m["mean_normalized_latency_s"] == pytest.approx((0.5 + 0.875 + 1.0) / 3)
    assert m["num_output_tokens"] == 10 and m["served_requests_per_s"] == pytest.approx(3 / 12)
    with pytest.raises(ValueError, match="len\\(arrivals\\)=2 must equal len\\(trace\\)=3"):
        serve_online(server, trace, [0.0, 1.0], clock=clock, sleep=clock.sleep)


def test_sustained_rate_interpolates_and_flags_censoring():
    # log-linear between (2, 1) and (4, 4): bound 2 is halfway in log latency.
    assert sustained_rate([1, 2, 4], [1.0, 1.0, 4.0], 2.0) == (pytest.approx(3.0), False)
    assert sustained_rate([1, 2], [1.0, 1.5], 2.0) == (2, True)
    assert sustained_rate([1, 2], [3.0, 5.0], 2.0) == (0.0, False)
    assert latency_bound({"a": 0.01, "b": 0.03}, 4.0) == pytest.approx(0.12)
    with pytest.raises(ValueError, match="factor=1 must be > 1"):
        latency_bound({"a": 1.0}, 1)


def test_analyze_curves_ratios():
    points = []
    for system, knee in (("paged-jax", 8.0), ("contiguous-max", 2.0)):
        for rate in (1.0, 2.0, 4.0, 8.0, 16.0):
            for rep, jitter in enumerate((0.0, 0.002)):
                lat = 0.01 + jitter + (0.0 if rate <= knee else rate)
                points.append(
                    {
                        "system": system,
                        "rate": rate,
                        "repeat": rep,
                        "mean_normalized_latency_s": lat,
                    }
                )
    curves = system_curves(points)
    assert [p["rate"] for p in curves["paged-jax"]] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert curves["paged-jax"][0]["min"] == 0.01 and curves["paged-jax"][0]["max"] == 0.012
    a = analyze_curves(curves, 4.0)
    assert a["main"]["bound_s_per_token"] == pytest.approx(4 * 0.011)
    paged, base = a["main"]["sustained"]["paged-jax"], a["main"]["sustained"]["contiguous-max"]
    assert 8 < paged["rate"] < 16 and 2 < base["rate"] < 4
    ratio = a["main"]["paged_over"]["contiguous-max"]
    assert ratio["ratio"] == pytest.approx(paged["rate"] / base["rate"]) and not ratio["censored"]
    assert [s["factor"] for s in a["sensitivity"]] == [2.0, 8.0]


@pytest.mark.parametrize("dataset", ["sharegpt", "alpaca"])
def test_dataset_traces_keep_the_paper_ratios_scaled(dataset):
    cfg = DatasetTraceConfig(dataset=dataset, num_requests=3000, scale=0.25, seed=1)
    trace = make_dataset_trace(cfg)
    assert trace == make_dataset_trace(cfg)  # seeded
    s = trace_summary(trace)
    paper = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}[dataset]
    assert cfg.max_model_len == 512
    assert s["input_mean"] == pytest.approx(paper[0] * 0.25, rel=0.1)
    assert s["output_mean"] == pytest.approx(paper[1] * 0.25, rel=0.1)
    assert all(r.num_prompt_tokens + r.num_output_tokens <= 512 for r in trace)
    assert all(3 <= t < 1024 for r in trace[:50] for t in r.prompt_token_ids)
    with pytest.raises(ValueError, match="dataset='lmsys' must be one of"):
        DatasetTraceConfig(dataset="lmsys")
    with pytest.raises(ValueError, match="scale=0.005 is too small for"):
        DatasetTraceConfig(dataset=dataset, scale=0.005)


def test_jsonl_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        "\n".join(json.dumps({"prompt_len": p, "output_len": o}) for p, o in [(3, 5), (7, 1)])
    )
    trace = load_jsonl_trace(str(path), max_model_len=16, seed=2)
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in trace] == [(3, 5), (7, 1)]
    assert trace == load_jsonl_trace(str(path), max_model_len=16, seed=2)
    with pytest.raises(ValueError, match=r"t.jsonl:1: prompt_len \+ output_len = 8 must be <= "):
        load_jsonl_trace(str(path), max_model_len=7)
    path.write_text('{"prompt_len": 0, "output_len": 2}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:1: prompt_len=0, output_len=2 must be ints"):
        load_jsonl_trace(str(path), max_model_len=7)
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r'must be a JSON object with "prompt_len"'):
        load_jsonl_trace(str(path), max_model_len=7)


def test_run_metrics_record_math():
    run = OnlineRun([RequestRecord("a", 1.0, 3.0, 4)], {"a": [1] * 4}, 3.0, 5, 1)
    assert run_metrics(run)["mean_normalized_latency_s"] == 0.5


class Instant:
    """An inner server that finishes every added request at its next step."""

    def __init__(self):
        self.live, self.added = [], []

    def add(self, req):
        self.live.append(req)
        self.added.append(req.request_id)

    def step(self):
        done, self.live = self.live, []
        return [(r.request_id, [1] * r.num_output_tokens) for r in done]

    def has_unfinished(self):
        return bool(self.live)

    @property
    def num_running(self):
        return len(self.live)


@pytest.mark.parametrize(
    ("policy", "admitted_first"),
    [("max", ["a"]), ("pow2", ["a", "b"]), ("oracle", ["a", "b", "c"])],
)
def test_reservation_server_admits_by_policy(policy, admitted_first):
    # KV lengths (prompt + output - 1) 3, 4, 2 in 9 slots first-fit, max_model_len 8: max
    # reserves 8 (b waits, c waits behind it), pow2 (prompt + pow2(output)) 2 + 2 and
    # 3 + 2 (c's 1 + 2 does not fit), oracle 3 + 4 + 2.
    inner = Instant()
    gate = ReservationServer(inner, policy, budget_tokens=9, max_model_len=8, placement="first-fit")
    reqs = [
        TraceRequest("a", (5, 5), 2),
        TraceRequest("b", (5, 5, 5), 2),
        TraceRequest("c", (5,), 2),
    ]
    for r in reqs:
        gate.add(r)
    assert inner.added == admitted_first
    while gate.has_unfinished():
        gate.step()
    assert inner.added == ["a", "b", "c"] and gate.space.num_allocated == 0
    with pytest.raises(ValueError, match="must be <= max_model_len=8"):
        gate.add(TraceRequest("d", (5,) * 6, 3))
    # In whole blocks of 4: KV length 2 reserves one block.
    blocks = ReservationServer(Instant(), policy, budget_tokens=8, max_model_len=8, granularity=4)
    assert (
        blocks.reservation(TraceRequest("x", (5,), 2)) == {"max": 8, "pow2": 4, "oracle": 4}[policy]
    )
    with pytest.raises(ValueError, match="granularity=3 must be >= 1 and divide budget_tokens=8"):
        ReservationServer(Instant(), policy, budget_tokens=8, max_model_len=8, granularity=3)


def test_reservation_server_places_by_buddy():
    # Budget 9 = buddy roots of 8 and 1; oracle: a 3 -> 4 at [0,4), b 4 at [4,8), c 2 -> 2
    # fits no free block (the 1-slot root) although first-fit would have had room.
    inner = Instant()
    gate = ReservationServer(inner, "oracle", budget_tokens=9, max_model_len=8)
    for r in (
        TraceRequest("a", (5, 5), 2),
        TraceRequest("b", (5, 5, 5), 2),
        TraceRequest("c", (5,), 2),
    ):
        gate.add(r)
    assert inner.added == ["a", "b"] and gate.space.num_allocated == 8
    assert gate.extra()["placement"] == "buddy"
    gate.step()
    assert inner.added == ["a", "b", "c"] and gate.space.num_allocated == 2


def test_static_batch_server_forms_the_next_batch_only_when_one_ends():
    # Budget 17, max_model_len 8: batches of 2. a, b, c arrive at once; a finishes at
    # the first step, b at the second; c enters only after, d (arriving meanwhile) with it.
    class Steps(Instant):
        def step(self):
            for r in self.live:
                r[1] -= 1
            done = [r for r, n in self.live if n == 0]
            self.live = [[r, n] for r, n in self.live if n > 0]
            return [(r.request_id, [1] * r.num_output_tokens) for r in done]

        def add(self, req):
            self.live.append([req, req.num_output_tokens])
            self.added.append(req.request_id)

    inner = Steps()
    gate = StaticBatchServer(inner, budget_tokens=17, max_model_len=8, max_num_seqs=256)
    assert gate.batch_size == 2
    for name, out in (("a", 1), ("b", 2), ("c", 1)):
        gate.add(TraceRequest(name, (5,), out))
    assert inner.added == [] and gate.has_unfinished()  # the batch forms at a step
    assert [r for r, _ in gate.step()] == ["a"] and inner.added == ["a", "b"]
    gate.add(TraceRequest("d", (5,), 1))
    assert [r for r, _ in gate.step()] == ["b"] and inner.added == ["a", "b"]
    assert [r for r, _ in gate.step()] == ["c", "d"] and inner.added == ["a", "b", "c", "d"]
    assert not gate.has_unfinished()
    assert gate.extra()["num_batches"] == 2
    with pytest.raises(ValueError, match="must be <= max_model_len=8"):
        gate.add(TraceRequest("e", (5,) * 6, 3))
    with pytest.raises(ValueError, match="kv_budget_tokens=7 must hold one max_model_len=8"):
        StaticBatchServer(Steps(), budget_tokens=7, max_model_len=8, max_num_seqs=4)


def test_paired_ratios_and_interval():
    iv = ratio_interval([2.0, 2.0, 2.0])
    assert (iv["geomean"], iv["low"], iv["high"]) == pytest.approx((2.0, 2.0, 2.0))
    iv = ratio_interval([1.0, 4.0])  # log mean log 2, sd log 4 / sqrt 2, t(1) 12.706
    half = 12.706 * (np.log(4.0) / np.sqrt(2)) / np.sqrt(2)
    assert iv["geomean"] == pytest.approx(2.0) and iv["high"] == pytest.approx(2 * np.exp(half))
    assert ratio_interval([3.0])["low"] is None
    with pytest.raises(ValueError, match="ratios=\\[\\] must be a non-empty list"):
        ratio_interval([])
    # Two repeats; bound 10: paged crosses it halfway from 2 to 4 req/s in log latency
    # (5 -> 20), orca from 0 to 2 at rep 0 (2.5 -> 40) and at 2 -> 4 at rep 1.
    pts = []
    for rep, (paged, orca) in enumerate((((2.5, 5.0, 20.0), (2.5, 40.0, 80.0)),
                                         ((2.5, 5.0, 20.0), (2.5, 5.0, 20.0)))):  # fmt: skip
        for rate, p_lat, o_lat in zip((0.0, 2.0, 4.0), paged, orca):
            pts.append({"system": "paged-jax", "repeat": rep, "rate": rate,
                        "mean_normalized_latency_s": p_lat, "mean_running": rate})  # fmt: skip
            pts.append({"system": "orca-oracle", "repeat": rep, "rate": rate,
                        "mean_normalized_latency_s": o_lat, "mean_running": rate / 2})  # fmt: skip
    out = paired_analysis(pts, bound=10.0)
    vs = out["orca-oracle"]["vs_reference"]
    assert [r["ratio"] for r in vs["sustained_ratio_per_repeat"]] == pytest.approx([3.0 / 1.0, 1.0])
    assert vs["sustained_ratio"]["geomean"] == pytest.approx(np.sqrt(3.0))
    assert vs["latency_ratio_by_rate"]["2.0"]["per_repeat"] == pytest.approx([8.0, 1.0])
    assert out["orca-oracle"]["mean_running_median"] == {"0.0": 0.0, "2.0": 1.0, "4.0": 2.0}
    assert out["paged-jax"]["sustained_per_repeat"][0]["rate"] == pytest.approx(3.0)
