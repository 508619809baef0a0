"""Speculative decoding through the engine on SumModel (outputs computable by hand).

An oracle proposer drafts SumModel's true continuation with planted mistakes, so every
step mixes accepted and rejected drafts: outputs must equal the reference exactly,
under preemption, chunked prefill and prefix caching, with the pool drained after.
"""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.config import EngineConfig
from paged_jax.engine import Engine
from paged_jax.sampling_params import SamplingParams
from paged_jax.spec_decode.proposer import Proposal, ProposalBatch
from paged_jax.testing.bounded import call_within
from paged_jax.testing.fake_model import SumModel, SumModelConfig

VOCAB = 97
K = 3


class OracleProposer:
    """Drafts SumModel's greedy continuation; every `wrong_every`-th proposal has one
    wrong token and every other one is a token short, so acceptance varies."""

    num_lookahead_tokens = 0
    num_compiles = 0

    def __init__(self, k: int = K, wrong_every: int = 3):
        self.k = k
        self.wrong_every = wrong_every
        self.calls = 0

    def kv_cache_bytes_per_block(self) -> int:
        return 0

    def initialize(self, num_kv_blocks: int) -> None:
        pass

    def warmup(self) -> None:
        pass

    def propose(self, batch: ProposalBatch) -> Proposal:
        n = batch.num_requests
        ids = np.zeros((n, self.k), np.int32)
        counts = np.zeros(n, np.int32)
        for i, tokens in enumerate(batch.token_ids):
            assert batch.next_token_ids[i] == tokens[-1]
            assert batch.next_positions[i] == len(tokens) - 1
            self.calls += 1
            ref = SumModel.reference_continuation(list(tokens), self.k, VOCAB)
            if self.calls % self.wrong_every == 0:
                j = self.calls % self.k
                ref[j] = (ref[j] + 1) % VOCAB
            ids[i] = ref
            counts[i] = self.k - self.calls % 2
        return Proposal(ids, counts, None)


def make_engine(proposer=None, **kwargs) -> Engine:
    """A small pool (preemption) and token budget (chunked prefill), prefix caching on."""
    model = SumModel(SumModelConfig(vocab_size=VOCAB, max_position_embeddings=128))
    base = dict(
        block_size=4,
        num_kv_blocks=16,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        attention_backend="reference",
        validate=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": K},
    )
    base.update(kwargs)
    engine = Engine(model, EngineConfig(**base))
    if proposer is not None:
        engine.proposer = proposer
    return engine


def run_all(engine: Engine) -> dict:
    def loop():
        outs = {}
        while engine.has_unfinished():
            for o in engine.step():
                assert o.request_id not in outs, "a request finished twice"
                outs[o.request_id] = o
                engine.kv_cache_manager.check_invariants()
        return outs

    return call_within(1200, loop)  # a hang guard, generous for a loaded machine


def assert_pool_drained(engine: Engine) -> None:
    kv = engine.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked after the run"
    assert engine.input_batch.row_of == {}, "input-batch rows leaked after the run"


def prompts(n: int, seed: int, shared: int = 0) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, VOCAB, shared).tolist()
    return {
        f"r{i}": prefix + rng.integers(0, VOCAB, rng.integers(1, 20)).tolist() for i in range(n)
    }


# One engine of each kind per module: their programs compile once (warm-up), and every
# test drains them again (checked), so later tests start from an empty pool.
@pytest.fixture(scope="module")
def spec_engine():
    engine = make_engine(OracleProposer())
    engine.warmup()
    return engine


@pytest.fixture(scope="module")
def plain_engine():
    engine = make_engine(speculative_config=None)
    engine.warmup()
    return engine


def run_requests(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs = run_all(engine)
    assert_pool_drained(engine)
    assert engine.get_stats()["num_compiles_after_warmup"] == 0
    return outs


def test_greedy_with_rejections_equals_reference(spec_engine):
    """Preemption, chunked prefill and prefix hits (shared prefix) in one run; the
    proposer plants wrong and short drafts. The engine was asked for async scheduling
    and runs synchronously with speculation (the outputs are the synchronous engine's)."""
    engine = spec_engine
    engine.proposer = OracleProposer()
    assert engine.async_scheduling_requested and not engine.config.async_scheduling
    before = engine.get_stats()
    ps = prompts(8, seed=1, shared=9)
    max_tokens = {rid: 5 + i * 3 for i, rid in enumerate(ps)}
    outs = run_requests(
        engine,
        {
            rid: (p, SamplingParams(temperature=0.0, max_tokens=max_tokens[rid]))
            for rid, p in ps.items()
        },
    )
    for rid, p in ps.items():
        assert outs[rid].token_ids == SumModel.reference_continuation(p, max_tokens[rid], VOCAB), (
            rid
        )
        assert outs[rid].finish_reason == "length"
    stats = engine.get_stats()
    accepted = stats["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    drafted = stats["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    assert 0 < accepted < drafted
    assert len(stats["spec_acceptance_rate_per_position"]) == K
    assert stats["num_preemptions"] > before["num_preemptions"], "pool meant to preempt"
    assert stats["prefix_cache_hits"] > before["prefix_cache_hits"]


@pytest.mark.slow
def test_swap_preemption_with_rejections_equals_reference():
    """Slow (its own engine's compiles, ~1 min on 2 cores): swap preemption."""
    engine = make_engine(OracleProposer(), preemption_mode="swap")
    ps = prompts(8, seed=2)
    for rid, p in ps.items():
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=12))
    outs = run_all(engine)
    for rid, p in ps.items():
        assert outs[rid].token_ids == SumModel.reference_continuation(p, 12, VOCAB), rid
    assert engine.get_stats()["num_preemptions"] > 0
    assert_pool_drained(engine)


def test_stops_penalties_logprobs_equal_the_plain_engine(spec_engine, plain_engine):
    """Stop tokens inside accepted drafts end the request there (later drafts dropped);
    min_tokens, max_tokens, penalties and logprobs count accepted tokens in order: the
    outputs equal the non-speculative engine's."""
    prompt = [5, 11, 2]
    ref = SumModel.reference_continuation(prompt, 30, VOCAB)
    stop = ref[7]
    first = ref.index(stop)
    spec_engine.proposer = OracleProposer(wrong_every=1000)
    requests = {
        "stop": (prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop])),
        "late": (
            prompt,
            SamplingParams(
                temperature=0, max_tokens=30, stop_token_ids=[stop], min_tokens=first + 2
            ),
        ),
        "len": (prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=2)),
        "pen": (prompt, SamplingParams(temperature=0, max_tokens=9, frequency_penalty=1.5)),
    }
    got = run_requests(spec_engine, requests)
    want = run_requests(plain_engine, requests)
    assert got["stop"].token_ids == ref[: first + 1]
    assert got["stop"].finish_reason == "stop" and got["stop"].stop_reason == stop
    for rid in requests:
        assert got[rid].token_ids == want[rid].token_ids, rid
        assert got[rid].finish_reason == want[rid].finish_reason, rid
    assert len(got["len"].logprobs) == 6
    for a, b in zip(got["len"].logprobs, want["len"].logprobs):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t] == pytest.approx(b[t], abs=1e-5)


def test_rejected_drafts_leave_no_blocks(spec_engine):
    """After every step a request holds only the blocks its known tokens need (the
    n-gram proposer needs no lookahead), with the engine's own n-gram proposer."""
    from paged_jax.spec_decode.ngram import NgramProposer

    engine = spec_engine
    engine.proposer = NgramProposer(engine.config.speculative_config)
    ps = prompts(4, seed=3)
    kv = engine.kv_cache_manager
    for rid, p in ps.items():
        engine.add_request(rid, p * 3, SamplingParams(temperature=0, max_tokens=12))

    def loop():
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o for o in engine.step()})
            for req in engine.scheduler.running:
                held = len(kv.get_block_ids(req))
                assert held <= -(-req.num_tokens // 4), (req, held)
        return outs

    outs = call_within(1200, loop)  # a hang guard, generous for a loaded machine
    for rid, p in ps.items():
        assert outs[rid].token_ids == SumModel.reference_continuation(p * 3, 12, VOCAB)
    assert_pool_drained(engine)


def test_seeded_sampling_is_deterministic_and_equals_plain_without_drafts(
    spec_engine, plain_engine
):
    """Sampled outputs key on the request's seed and position: two runs agree, and a
    proposer that drafts nothing gives exactly the non-speculative engine's samples."""
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_tokens=10, seed=7)
    requests = {rid: (p, params) for rid, p in prompts(4, seed=5).items()}

    class Silent(OracleProposer):
        def propose(self, batch):
            return Proposal.empty(batch.num_requests, self.k)

    def tokens(outs):
        return {rid: o.token_ids for rid, o in outs.items()}

    plain = tokens(run_requests(plain_engine, requests))
    spec_engine.proposer = Silent()
    assert tokens(run_requests(spec_engine, requests)) == plain
    spec_engine.proposer = OracleProposer()
    first = tokens(run_requests(spec_engine, requests))
    spec_engine.proposer = OracleProposer()
    assert tokens(run_requests(spec_engine, requests)) == first


def test_stop_strings_cut_accepted_drafts_like_the_plain_engine(spec_engine, plain_engine):
    """A stop string completed inside a run of accepted drafts ends the request at the
    token that completes it, as without speculation."""
    prompt = [3, 8, 1]
    ref = SumModel.reference_continuation(prompt, 30, VOCAB)
    stop = f" {ref[6]} {ref[7]} "
    spec_engine.proposer = OracleProposer(wrong_every=1000)
    requests = {"s": (prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop]))}
    got = {}
    for name, engine in (("spec", spec_engine), ("plain", plain_engine)):
        engine.detokenize = lambda ids: " " + " ".join(map(str, ids)) + " "
        try:
            got[name] = run_requests(engine, requests)["s"]
        finally:
            engine.detokenize = None
    assert got["spec"].token_ids == got["plain"].token_ids
    assert got["spec"].finish_reason == "stop" and got["spec"].stop_reason == stop
    assert len(got["spec"].token_ids) < 30


class BadWrongDrafts(OracleProposer):
    """OracleProposer whose planted wrong tokens are all `bad`."""

    def __init__(self, bad: int, **kwargs):
        super().__init__(**kwargs)
        self.bad = bad

    def propose(self, batch: ProposalBatch) -> Proposal:
        out = super().propose(batch)
        for i, tokens in enumerate(batch.token_ids):
            ref = SumModel.reference_continuation(list(tokens), self.k, VOCAB)
            out.token_ids[i] = np.where(out.token_ids[i] != ref, self.bad, out.token_ids[i])
        return out


def test_nonfinite_logits_end_only_their_request_like_the_plain_engine():
    """SumModel with nonfinite_token_id=BAD gives a NaN logit to every position after a
    BAD token, drafts included. A request whose accepted drafts reach BAD keeps the
    tokens before the NaN position and ends with finish_reason "error", as the plain
    engine does (before: it lost every token of that step); rejected BAD drafts (every
    planted wrong token is BAD) leave their request untouched; the others finish exactly."""
    from paged_jax.engine import NONFINITE_LOGITS_ERROR

    bad = 13
    model = SumModel(
        SumModelConfig(vocab_size=VOCAB, max_position_embeddings=128, nonfinite_token_id=bad)
    )
    late = next(
        [t] for t in range(VOCAB) if SumModel.reference_continuation([t], 8, VOCAB)[2] == bad
    )
    good = {"g0": [1, 2, 3], "g1": [4, 5, 6, 7, 8]}
    for p in good.values():
        assert bad not in SumModel.reference_continuation(p, 8, VOCAB)
    requests = {"at_prompt": [5, bad], "late": late, **good}
    outs = {}
    for name, spec in (("plain", None), ("spec", {"method": "ngram", "num_speculative_tokens": K})):
        engine = Engine(
            model,
            EngineConfig(
                block_size=4,
                num_kv_blocks=32,
                max_num_seqs=4,
                max_num_batched_tokens=16,
                attention_backend="reference",
                speculative_config=spec,
            ),
        )
        if spec is not None:
            engine.proposer = BadWrongDrafts(bad, wrong_every=2)
        for rid, p in requests.items():
            engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=8, logprobs=1))
        outs[name] = run_all(engine)
        assert_pool_drained(engine)
        if spec is not None:
            stats = engine.get_stats()
            assert stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    plain, spec_outs = outs["plain"], outs["spec"]
    assert plain["late"].token_ids == SumModel.reference_continuation(late, 3, VOCAB)
    for rid in requests:
        assert spec_outs[rid].token_ids == plain[rid].token_ids, rid
        assert spec_outs[rid].finish_reason == plain[rid].finish_reason, rid
        assert len(spec_outs[rid].logprobs) == len(plain[rid].token_ids), rid
    for rid in ("at_prompt", "late"):
        assert spec_outs[rid].finish_reason == "error"
        assert spec_outs[rid].error == NONFINITE_LOGITS_ERROR
    for rid in good:
        assert spec_outs[rid].finish_reason == "length"
