"""Serving n samples or n beams a request: the paged engine's forks against Orca's n runs.

On SumModel (no weights, tiny compiles) the online beam server must return what the
offline beam search returns for the same prompts, parallel samples must be the same
behind an Orca gate as without it (same seeds), and the gate must hold n runs a request.
"""

from __future__ import annotations

import threading
import types

import pytest

from paged_jax.baselines.serving import (
    BeamSearchServer,
    ParallelSamplingServer,
    ReservationServer,
    num_output_tokens,
    serve_online,
)
from paged_jax.baselines.workload import TraceRequest
from paged_jax.beam_search import BeamSearchParams, run_beam_search
from paged_jax.config import EngineConfig
from paged_jax.engine import Engine
from paged_jax.testing.fake_model import SumModel, SumModelConfig

VOCAB = 97
TRACE = [
    TraceRequest("a", (3, 9, 14, 2, 7), 6),
    TraceRequest("b", (11, 4, 4, 8, 20, 1, 6, 5, 13), 4),
    TraceRequest("c", (30, 2), 5),
]


@pytest.fixture(scope="module")
def system() -> types.SimpleNamespace:
    """A harness-like system (its .engine) shared by the tests: one set of compiles."""
    model = SumModel(SumModelConfig(vocab_size=VOCAB, max_position_embeddings=64))
    config = EngineConfig(
        block_size=4,
        num_kv_blocks=48,
        max_num_seqs=16,
        max_num_batched_tokens=32,
        max_model_len=32,
        attention_backend="reference",
    )
    return types.SimpleNamespace(engine=Engine(model, config))


def run_in_thread(fn, timeout: float = 120.0):
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} did not finish in {timeout} s"
    return box["out"]


class FakeClock:
    """Each call advances 0.01 s; sleeping jumps ahead."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.01
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def serve(server, arrivals=(0.0, 0.02, 0.05)):
    clock = FakeClock()
    return serve_online(server, TRACE, list(arrivals), clock=clock, sleep=clock.sleep)


def test_online_beams_equal_offline_beam_search_and_orca_gate(system):
    width = 3
    run = run_in_thread(lambda: serve(BeamSearchServer(system, width)))
    assert set(run.outputs) == {"a", "b", "c"}
    for req in TRACE:
        params = BeamSearchParams(width, req.num_output_tokens, ignore_eos=True)
        want = run_beam_search(system.engine, [list(req.prompt_token_ids)], params)[0]
        assert run.outputs[req.request_id] == [s.output_token_ids for s in want.sequences]
        assert num_output_tokens(run.outputs[req.request_id]) == req.num_output_tokens
    # Behind an Orca gate of one beam's worth of room per request, requests run one at
    # a time and still give the same beams.
    gate = ReservationServer(
        BeamSearchServer(system, width),
        "oracle",
        45,
        32,
        copies=width,
        extra_kv_tokens=1,
        placement="first-fit",
    )
    gated = run_in_thread(lambda: serve(gate))
    assert gated.outputs == run.outputs and gated.max_running <= width + 1
    # max_num_seqs 16 holds (16 - 1) // 6 = 2 searches of width 6: the third waits
    # (forking it in would need a 17th row).
    wide = BeamSearchServer(system, 6)
    wide_run = run_in_thread(lambda: serve(wide, arrivals=(0.0, 0.0, 0.0)))
    assert set(wide_run.outputs) == {"a", "b", "c"} and wide_run.max_running <= 16
    kv = system.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"


def test_parallel_samples_share_the_prompt_and_match_behind_the_gate(system):
    server = ParallelSamplingServer(system, 3)
    run = run_in_thread(lambda: serve(server))
    for req in TRACE:
        samples = run.outputs[req.request_id]
        assert len(samples) == 3 and {len(s) for s in samples} == {req.num_output_tokens}
    extra = server.extra()
    assert extra["blocks_saved_by_sharing"] > 0, extra  # the prompt's blocks are shared
    gate = ReservationServer(ParallelSamplingServer(system, 3), "oracle", 64, 32, copies=3)
    assert run_in_thread(lambda: serve(gate)).outputs == run.outputs
    with pytest.raises(ValueError, match="n=0 must be an int >= 1"):
        ParallelSamplingServer(system, 0)


def test_gate_reserves_one_run_per_copy_all_or_none():
    class Instant:
        def __init__(self):
            self.added, self.live = [], []

        def add(self, r):
            self.added.append(r.request_id)
            self.live.append(r)

        def step(self):
            done, self.live = self.live, []
            return [(r.request_id, [[1] * r.num_output_tokens]) for r in done]

        def has_unfinished(self):
            return bool(self.live)

        num_running = 0

    # KV length 4 + 3 - 1 = 6 per copy: first-fit, 2 copies hold 12 of 14 slots, so b
    # waits; a buddy allocator rounds each copy to 8, so 2 copies hold 16 of 16.
    for placement, budget, held in (("first-fit", 14, 12), ("buddy", 16, 16)):
        inner = Instant()
        gate = ReservationServer(inner, "oracle", budget, 8, copies=2, placement=placement)
        gate.add(TraceRequest("a", (5,) * 4, 3))
        gate.add(TraceRequest("b", (5,) * 4, 3))
        assert inner.added == ["a"] and gate.space.num_allocated == held, placement
        gate.step()
        assert inner.added == ["a", "b"] and gate.space.num_allocated == held, placement
        gate.step()
        assert gate.space.num_allocated == 0
    # Under buddy, 14 slots are roots of 8, 4 and 2 that never merge: two 8-slot copies
    # never fit, so the request is refused when added instead of waiting forever.
    gate = ReservationServer(Instant(), "oracle", 14, 8, copies=2)
    with pytest.raises(ValueError, match="copies=2 reservations of 6 slots do not fit"):
        gate.add(TraceRequest("c", (5,) * 4, 3))
    assert not gate.has_unfinished()
    with pytest.raises(ValueError, match="copies=0 must be an int >= 1"):
        ReservationServer(inner, "oracle", 14, 8, copies=0)
