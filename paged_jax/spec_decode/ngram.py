"""N-gram prompt lookup: propose the tokens that followed the last earlier occurrence of
the request's own suffix (host side, numpy; no model, no KV, no compiles).

For n from prompt_lookup_max down to prompt_lookup_min, the last n tokens of prompt +
output are searched for earlier in the same list; the longest n that occurs wins, its
first occurrence is taken, and the k tokens that followed it are proposed:

    tokens:  a b c d x y b c d ?      suffix "b c d" (n = 3) also sits at 1..3
               ^^^^^                   -> propose "x y b" (k = 3)

When fewer than k tokens follow the match, the proposal repeats them (the match and its
continuation overlap the suffix: a loop of period p continues with period p).
"""

from __future__ import annotations

import numpy as np

from paged_jax.spec_decode.proposer import (
    Proposal,
    ProposalBatch,
    ProposerContext,
    SpeculativeConfig,
)

__all__ = ["NgramProposer", "propose_ngram"]


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The k tokens that follow the first earlier match of the longest suffix n-gram.

    Args:
        tokens: i32[L] prompt + output tokens.
        min_n, max_n: the n-gram sizes tried, longest first.
        k: most tokens proposed.

    Returns:
        i32[k], or i32[0] when no suffix of size >= min_n occurs earlier.
    """
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Windows starting at 0 .. length - n - 1: each is followed by at least one token.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            # np.resize repeats the continuation cyclically when it is short.
            return np.resize(tokens[int(hits[0]) + n :], k)
    return tokens[:0]


class NgramProposer:
    """Prompt-lookup proposals (SpeculativeConfig.method == "ngram"); see the module docstring.

    Args:
        config: the speculative config (k, prompt_lookup_min / max).
        context: the engine's context (unused: n-gram lookup needs no model).
    """

    num_lookahead_tokens = 0  # it writes no KV of its own

    def __init__(self, config: SpeculativeConfig, context: ProposerContext | None = None):
        self.config = config
        self.num_compiles = 0
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def kv_cache_bytes_per_block(self) -> int:
        return 0

    def initialize(self, num_kv_blocks: int) -> None:
        del num_kv_blocks

    def warmup(self) -> None:
        pass

    def propose(self, batch: ProposalBatch) -> Proposal:
        """Looks each request's suffix up in its own tokens (point-mass proposals)."""
        n, k = batch.num_requests, self.k
        token_ids = np.zeros((n, k), np.int32)
        num_tokens = np.zeros(n, np.int32)
        for i, tokens in enumerate(batch.token_ids):
            found = propose_ngram(np.asarray(tokens, np.int32), self.min_n, self.max_n, k)
            token_ids[i, : len(found)] = found
            num_tokens[i] = len(found)
        return Proposal(token_ids, num_tokens, None)
