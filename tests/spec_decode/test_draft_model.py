"""The draft-model method end to end: exact greedy outputs, the acceptance ceiling, config errors.

Targets are the tiny Llama / Qwen2 checkpoints; drafts are an independent smaller random
Llama of the same vocabulary, or the Qwen2 target's own first layer (truncate_checkpoint).
Every engine runs with chunked prefill (a small token budget) and a pool small enough
to preempt, and ends drained with the block manager's invariants holding.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from paged_jax.config import EngineConfig
from paged_jax.engine import Engine
from paged_jax.models import load_model
from paged_jax.sampling_params import SamplingParams

K = 3
MAX_NEW = 10
SMALL = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1,
)  # fmt: skip


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    out = [rng.integers(3, 128, n).tolist() for n in (3, 7, 13, 21)]
    # A repetitive prompt: the truncated draft agrees with the target more often on it.
    out.append((rng.integers(3, 128, 4).tolist() * 5)[:19])
    return out


def _engine(target, draft, **overrides) -> Engine:
    cfg = dict(
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,  # chunked prefill of the longer prompts
        max_model_len=64,
        num_kv_blocks=24,  # small enough to preempt
        attention_backend="reference",
        speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": K},
    )  # fmt: skip
    cfg.update(overrides)
    engine = Engine(load_model(target, attention_backend="reference"), EngineConfig(**cfg))
    engine.warmup()
    return engine


def _run_greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    _assert_drained(engine)
    return [outs[str(i)].token_ids for i in range(len(prompts))]


def _assert_drained(engine: Engine) -> None:
    kv = engine.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked after the run"
    assert engine.input_batch.row_of == {}, "input-batch rows leaked after the run"
    stats = engine.get_stats()
    assert stats["num_compiles_after_warmup"] == 0, "a step compiled after warm-up"


@pytest.fixture(scope="module")
def llama_engine(tiny_hf_checkpoint):
    """A Llama target with an independent smaller random Llama draft (shared by the
    greedy and the sampling test: one warm-up)."""
    target = tiny_hf_checkpoint("llama")
    return _engine(target, tiny_hf_checkpoint("llama", seed=7, **SMALL))


@pytest.fixture(scope="module")
def truncated_qwen2(tiny_hf_checkpoint, tmp_path_factory):
    """The Qwen2 target's own first layer, saved as a checkpoint."""
    from paged_jax.spec_decode.draft_checkpoints import truncate_checkpoint

    target = tiny_hf_checkpoint("qwen2")
    return truncate_checkpoint(target, tmp_path_factory.mktemp("qwen2_1layer"), 1)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_with_draft_equals_transformers(family, request, tiny_hf_checkpoint, hf_greedy):
    target = tiny_hf_checkpoint(family)
    if family == "llama":  # an independent smaller random model
        engine = request.getfixturevalue("llama_engine")
    else:  # the target's own first layer
        draft = request.getfixturevalue("truncated_qwen2")
        assert load_model(draft).config.num_hidden_layers == 1
        engine = _engine(target, draft)
    prompts = _prompts()
    before = engine.get_stats()
    got = _run_greedy(engine, prompts)
    assert got == [hf_greedy(target, p, MAX_NEW) for p in prompts]
    stats = engine.get_stats()
    assert stats["num_preemptions"] > before["num_preemptions"], "the pool must preempt"
    assert stats["spec_num_draft_tokens"] > before["spec_num_draft_tokens"], "no drafts"


def test_draft_equal_to_target_accepts_nearly_everything(tiny_hf_checkpoint):
    target = tiny_hf_checkpoint("llama")
    engine = _engine(target, target, num_kv_blocks=64)
    _run_greedy(engine, _prompts())
    stats = engine.get_stats()
    drafted, accepted = stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]
    assert drafted > 0
    # The same weights propose what the target verifies; only float rounding between
    # the one-token draft steps and the k + 1 token verify step may flip a near tie.
    assert accepted >= 0.95 * drafted, stats


def test_bad_draft_config_names_the_field(tiny_hf_checkpoint, tmp_path):
    from paged_jax.spec_decode.draft_model import DraftModelProposer
    from paged_jax.spec_decode.proposer import ProposerContext, SpeculativeConfig

    target = tiny_hf_checkpoint("llama")
    config = EngineConfig(block_size=4, max_model_len=64, max_num_seqs=4)
    context = ProposerContext(config, vocab_size=128, target_model=None)
    with pytest.raises(ValueError, match=r"speculative_config\['model'\]='/nonexistent'"):
        DraftModelProposer(
            SpeculativeConfig(model="/nonexistent", num_speculative_tokens=2), context
        )
    other = tiny_hf_checkpoint("llama", vocab_size=96, **SMALL)
    with pytest.raises(ValueError, match=r"speculative_config\['model'\].*vocab_size=96"):
        DraftModelProposer(SpeculativeConfig(model=str(other), num_speculative_tokens=2), context)
    short = tmp_path / "short"
    shutil.copytree(target, short)
    hf = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**hf, "max_position_embeddings": 32}))
    with pytest.raises(ValueError, match=r"max_position_embeddings=32.*max_model_len=64"):
        DraftModelProposer(SpeculativeConfig(model=str(short), num_speculative_tokens=2), context)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"model": str(target), "num_speculative_tokens": 0})


def test_sampling_with_a_different_draft_follows_the_target(tiny_hf_checkpoint, llama_engine):
    """The second output token (the first one a draft proposes, accepted with min(1, p/q)
    or resampled from the residual) over seeded requests follows the target's exact
    marginal sum_x p(x | prompt) p(. | prompt, x), computed with transformers; a
    chi-square test whose p-value floor fails a correct sampler 1 time in 10^4. The
    draft's marginal is 0.46 from the target's in total variation: 800 of its own
    tokens, unverified, fail the test with p-values near 1e-150."""
    import torch
    import transformers
    from scipy import stats

    target = tiny_hf_checkpoint("llama")
    temperature, n, prompt = 0.5, 800, [5, 9, 17, 33]
    engine = llama_engine
    before = engine.get_stats()
    for i in range(n):
        params = SamplingParams(temperature=temperature, max_tokens=3, seed=i, ignore_eos=True)
        engine.add_request(str(i), prompt, params)
    second = []
    while engine.has_unfinished():
        second += [o.token_ids[1] for o in engine.step()]
    _assert_drained(engine)
    stats_ = engine.get_stats()
    drafted = stats_["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = stats_["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    assert 0 < accepted < drafted, "both the accept and the resample path must run"

    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        ids = torch.tensor([prompt + [x] for x in range(128)])
        p2 = torch.softmax(hf(ids).logits[:, -1] / temperature, -1)
    marginal = (p1 @ p2).numpy().astype(np.float64)
    counts = np.bincount(second, minlength=128).astype(np.float64)
    expected = marginal * n
    # Pool the rare tokens into one bin so every bin expects >= 5 draws.
    rare = expected < 5
    obs = np.append(counts[~rare], counts[rare].sum())
    exp = np.append(expected[~rare], expected[rare].sum())
    assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-4
