"""Random adds, aborts, forks, steps and failed steps keep the engine exact and its cache honest.

A hypothesis RuleBasedStateMachine drives an Engine over SumModel (greedy, so every
request's whole output is ``SumModel.reference_continuation`` of its prompt, forks
included) on a pool small enough to preempt. Some steps fail once at an injected point
(before packing, before dispatch, with the device state lost, at reading the result,
after the tokens were applied)
with a device error or a KeyboardInterrupt; the exception must reach the caller. After
every rule the block manager's invariants hold and no block of the prefix cache names
KV that was never written (SumModel's V cache holds each token's id); at the end every
request has finished exactly once with its reference output (aborted ones with a prefix
of it) and the pool is drained. Engines are built once per configuration and reused
across examples (each example leaves its engine idle).
"""

from __future__ import annotations

import collections
import itertools

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from paged_jax.core.request import Request, RequestStatus
from paged_jax.engine import Engine
from paged_jax.outputs import EngineOutput
from paged_jax.sampling_params import SamplingParams
from paged_jax.testing.fake_model import SumModel
from tests.engine.test_engine_fake import VOCAB, assert_pool_drained, make_engine
from tests.engine.test_step_failures import (
    WHERE,
    FailOnce,
    assert_cached_blocks_hold_their_kv,
    requests_seen,
    within_time_limit,
)

# (async_scheduling, preemption_mode, enable_prefix_caching)
CONFIGS = [(True, "recompute", True), (False, "swap", True), (True, "swap", False)]
PREFIXES = [list(range(10, 23)), [7] * 9, list(range(40, 48))]
MAX_LIVE = 8

_ENGINES: dict[tuple, tuple[Engine, FailOnce, dict[int, Request]]] = {}
COUNTS: collections.Counter[str] = collections.Counter()


def engine_for(config: tuple) -> tuple[Engine, FailOnce, dict[int, Request]]:
    """The configuration's shared engine; a fresh one if a failed example left work behind."""
    if config in _ENGINES and _ENGINES[config][0].has_unfinished():
        del _ENGINES[config]
    if config not in _ENGINES:
        async_scheduling, mode, caching = config
        engine = make_engine(
            async_scheduling=async_scheduling,
            preemption_mode=mode,
            enable_prefix_caching=caching,
            num_kv_blocks=24,  # 23 usable blocks of 4 tokens: preemption is common
            max_num_seqs=6,
            max_num_batched_tokens=16,
            max_len=64,
        )
        _ENGINES[config] = engine, FailOnce(engine), {}
    return _ENGINES[config]


class EngineMachine(RuleBasedStateMachine):
    @initialize(config=st.sampled_from(CONFIGS))
    def setup(self, config):
        self.engine, self.fail, self.seen = engine_for(config)
        self.ids = itertools.count()
        self.prompt: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.live: list[str] = []
        self.outs: dict[str, EngineOutput] = {}
        self.preemptions_before = self.engine.get_stats()["num_preemptions"]

    # -- bookkeeping -----------------------------------------------------------

    def _take(self, outs: list[EngineOutput]) -> None:
        for o in outs:
            assert o.request_id not in self.outs, f"{o.request_id} finished twice"
            assert o.request_id in self.live, f"{o.request_id} finished but was not live"
            self.live.remove(o.request_id)
            self.outs[o.request_id] = o
            want = SumModel.reference_continuation(
                self.prompt[o.request_id], self.max_tokens[o.request_id], VOCAB
            )
            if o.finish_reason == "abort":
                assert o.token_ids == want[: len(o.token_ids)], o.request_id
            else:
                assert o.finish_reason == "length", (o.request_id, o.finish_reason, o.error)
                assert o.token_ids == want, o.request_id
        requests_seen(self.engine, self.seen)

    # -- rules -------------------------------------------------------------------

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(
        prefix=st.sampled_from(PREFIXES),
        cut=st.integers(1, 13),
        suffix=st.lists(st.integers(0, VOCAB - 1), max_size=6),
        max_tokens=st.integers(1, 30),
        copies=st.integers(1, 3),
    )
    def add(self, prefix, cut, suffix, max_tokens, copies):
        prompt = prefix[:cut] + suffix
        for _ in range(min(copies, MAX_LIVE - len(self.live))):
            rid = f"q{next(self.ids)}"
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
            self.engine.add_request(rid, prompt, params)
            self.prompt[rid], self.max_tokens[rid] = prompt, max_tokens
            self.live.append(rid)
        requests_seen(self.engine, self.seen)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(self.live))
        if not self.engine.is_live(rid):
            return  # it ended in a step that then raised: the next step() reports it
        self._take([self.engine.abort_request(rid)])
        COUNTS["aborts"] += 1

    @precondition(lambda self: self.live and len(self.live) < MAX_LIVE)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        req = self.engine.get_request(parent)
        if req is None or req.status != RequestStatus.RUNNING:
            return
        child = f"f{next(self.ids)}"
        try:
            self.engine.fork_request(parent, child)
        except ValueError:
            return  # a full batch, or nothing computed yet to share
        # Greedy: the child continues its parent's output, so its reference is the parent's.
        self.prompt[child], self.max_tokens[child] = self.prompt[parent], self.max_tokens[parent]
        self.live.append(child)
        requests_seen(self.engine, self.seen)
        COUNTS["forks"] += 1

    @rule(num=st.integers(1, 4))
    def step(self, num):
        for _ in range(num):
            self._take(self.engine.step())
        COUNTS["steps"] += num

    @precondition(lambda self: self.live)
    @rule(where=st.sampled_from(WHERE), interrupt=st.booleans(), warm=st.integers(0, 2))
    def failed_step(self, where, interrupt, warm):
        for _ in range(warm):
            self._take(self.engine.step())
        exc = KeyboardInterrupt() if interrupt else RuntimeError("device error")
        self.fail.arm(where, exc)
        for _ in range(20):  # fires at the next step that packs or reads a device step
            try:
                self._take(self.engine.step())
            except type(exc):
                COUNTS[f"failed at {where}"] += 1
                break
            if self.fail.where is None:
                break
        self.fail.where = None  # disarm if nothing was left to run
        requests_seen(self.engine, self.seen)

    # -- checks ------------------------------------------------------------------

    @invariant()
    def consistent_and_honest(self):
        if not hasattr(self, "engine"):
            return
        self.engine.kv_cache_manager.check_invariants()
        assert_cached_blocks_hold_their_kv(self.engine, self.seen)

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        for _ in range(1_000):
            if not self.engine.has_unfinished():
                break
            self._take(self.engine.step())
        assert not self.engine.has_unfinished(), "the engine stopped making progress"
        assert not self.live, f"{self.live} never finished"
        assert_cached_blocks_hold_their_kv(self.engine, self.seen)
        assert_pool_drained(self.engine)
        COUNTS["preemptions"] += (
            self.engine.get_stats()["num_preemptions"] - self.preemptions_before
        )


def test_random_engine_work_with_failed_steps_stays_exact():
    def run():
        run_state_machine_as_test(
            EngineMachine,
            settings=settings(
                max_examples=24,
                stateful_step_count=40,
                deadline=None,
                derandomize=True,  # the same examples each run: the coverage checks are stable
                # No shrinking: each attempt may build an engine (a compile); the first
                # failing example is reported as it ran.
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            ),
        )

    within_time_limit(run, seconds=600)
    for where in WHERE:
        assert COUNTS[f"failed at {where}"] > 0, (where, COUNTS)
    assert COUNTS["forks"] > 0 and COUNTS["aborts"] > 0 and COUNTS["preemptions"] > 0, COUNTS
