"""SpeculativeConfig validation and n-gram prompt lookup (host only, no jax)."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.config import EngineConfig
from paged_jax.entrypoints.generate_cli import build_parser
from paged_jax.spec_decode.ngram import NgramProposer, propose_ngram
from paged_jax.spec_decode.proposer import (
    ProposalBatch,
    ProposalSampling,
    SpeculativeConfig,
)


@pytest.mark.parametrize(
    "value, match",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, r"\['method'\]='eagle' must be one of"),
        ({"method": "ngram"}, r"num_speculative_tokens=0 must be an int in \[1, 16\]"),
        ({"method": "ngram", "num_speculative_tokens": 17}, r"num_speculative_tokens=17"),
        ({"method": "ngram", "num_speculative_tokens": True}, r"num_speculative_tokens=True"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            r"prompt_lookup_min=0 must be None or an int >= 1",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 2,
                "prompt_lookup_min": 3,
            },
            r"prompt_lookup_min=3 must be <= prompt_lookup_max=2",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "model": "x"},
            r"key\(s\) \['model'\] are not read by method='ngram'",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, r"model=None must be a draft"),
        (
            {"model": "/x", "num_speculative_tokens": 2, "dtype": "int8"},
            r"dtype='int8' must be one of",
        ),
        ("ngram", r"speculative_config='ngram' must be a dict"),
    ],
)
def test_bad_speculative_config_names_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(value)
    with pytest.raises(ValueError, match=match if isinstance(value, dict) else "must be None"):
        EngineConfig(speculative_config=value)


def test_lookup_defaults_and_cli_flag():
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_lookahead_tokens) == (4, 4, 0)
    spec = SpeculativeConfig.from_dict({"model": "/draft", "num_speculative_tokens": 2})
    assert spec.method == "draft_model" and spec.num_lookahead_tokens == 2
    args = build_parser().parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    )
    assert args.speculative_config.num_speculative_tokens == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--speculative-config", "{not json"])


def _naive_lookup(tokens, lo, hi, k):
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                out = list(tokens)
                for i in range(k):  # the copy may read what it has just proposed
                    out.append(out[start + n + i])
                return out[len(tokens) :]
    return []


def test_ngram_lookup_equals_a_naive_search():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, rng.integers(1, 40)).tolist()
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        k = int(rng.integers(1, 5))
        got = propose_ngram(np.asarray(tokens, np.int32), lo, hi, k).tolist()
        assert got == _naive_lookup(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_ngram_proposer_fills_the_contract():
    spec = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3
    )
    proposer = NgramProposer(spec)
    seqs = [[1, 2, 3, 9, 1, 2], [5, 6, 7], [4, 4, 4, 4]]
    n = len(seqs)
    batch = ProposalBatch(
        step_input=None,
        req_ids=["a", "b", "c"],
        rows=np.arange(n, dtype=np.int32),
        token_ids=seqs,
        next_token_ids=np.array([s[-1] for s in seqs], np.int32),
        next_positions=np.array([len(s) - 1 for s in seqs], np.int32),
        num_accepted=np.zeros(n, np.int32),
        block_ids=[([],)] * n,
        sampling=ProposalSampling(*(np.zeros(n) for _ in range(6))),
    )
    out = proposer.propose(batch)
    assert out.num_tokens.tolist() == [3, 0, 3]
    assert out.token_ids[0].tolist() == [3, 9, 1]
    assert out.token_ids[2].tolist() == [4, 4, 4]  # a run goes on
    assert out.draft_probs is None
