"""PromptLogprobs: one prompt's logprobs, collected as the steps that prefill it are read.

The hidden state at position p predicts prompt token p + 1, so a prompt of L tokens has
L - 1 entries (RequestOutput.prompt_logprobs puts None first, for token 0). Prefill
arrives in chunks, possibly more than once (a request preempted by recompute computes
its prompt again), so entries are kept by position: a position already recorded is
skipped, and positions arrive in order from the first missing one.

    prompt     t0  t1  t2  t3  t4         (L = 5)
    position    0   1   2   3   4
    entry       -> t1  t2  t3  t4         entries[p] = logprobs of t(p+1) at position p
    chunk 1: positions 0..1   chunk 2: positions 2..4 (4 samples, no prompt entry)

With a tail of K tokens (SamplingParams.prompt_logprobs_tail) only positions from
first = L - 1 - K on are wanted; tokens 0 .. first - 1 may come from the prefix cache:

    tail K = 2  ->  first = 2:  entry    None None  -> t3  t4   (cache may cover t0 t1)

Pure Python; never imports jax.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_jax.outputs import LogprobEntry, RankEntry, logprob_entry


class PromptLogprobs:
    """The prompt logprobs of one prompt, in position order, without duplicates or gaps.

    Args:
        prompt_token_ids: the prompt whose tokens are the targets (a parallel-sampling
            carrier prefills all but the last token, yet its entries cover the prompt).
        num_top: top entries per position (SamplingParams.prompt_logprobs).
        tail: only the last ``tail`` prompt tokens get entries
            (SamplingParams.prompt_logprobs_tail; capped at len(prompt) - 1); None: all.

    The requests that compute it read at most ``num_cacheable_tokens`` tokens from the
    prefix cache (none without a tail): every wanted position runs through the model.
    """

    def __init__(self, prompt_token_ids: Sequence[int], num_top: int, tail: int | None = None):
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_top = num_top
        num_positions = len(self.prompt_token_ids) - 1
        # The first position with an entry: earlier ones are never computed for it.
        self.first = 0 if tail is None else max(num_positions - tail, 0)
        self.logprobs: list[LogprobEntry] = []
        self.ranks: list[RankEntry] = []

    @property
    def num_positions(self) -> int:
        """Positions with an entry when complete: len(prompt) - 1."""
        return len(self.prompt_token_ids) - 1

    @property
    def num_cacheable_tokens(self) -> int:
        """How many leading prompt tokens may come from the prefix cache (0: none)."""
        return self.first

    @property
    def next_position(self) -> int:
        """The first wanted position not recorded yet."""
        return self.first + len(self.logprobs)

    @property
    def complete(self) -> bool:
        return self.next_position == self.num_positions

    def wanted(self, start: int, end: int) -> range:
        """The positions of [start, end) (one scheduled chunk) that predict a wanted
        prompt token."""
        return range(max(start, self.first), min(end, self.num_positions))

    def target(self, position: int) -> int:
        """The prompt token the entry of ``position`` is about."""
        return self.prompt_token_ids[position + 1]

    def add(
        self,
        positions: Sequence[int],
        logprobs: Sequence[float],
        ranks: Sequence[int],
        top_token_ids: Sequence[Sequence[int]],
        top_logprobs: Sequence[Sequence[float]],
    ) -> None:
        """Records one chunk's positions (ascending); already recorded ones are skipped."""
        k = self.num_top
        for i, p in enumerate(positions):
            if p < self.next_position:
                continue  # computed again after a preemption (the same values), or unwanted
            assert p == self.next_position, (
                f"prompt logprobs of position {p} arrived before position "
                f"{self.next_position}'s: a prompt position was skipped (a prefix-cache hit "
                "past num_cacheable_tokens?)"
            )
            entry, entry_ranks = logprob_entry(
                self.target(p),
                float(logprobs[i]),
                int(ranks[i]),
                [int(t) for t in top_token_ids[i][:k]],
                [float(x) for x in top_logprobs[i][:k]],
            )
            self.logprobs.append(entry)
            self.ranks.append(entry_ranks)

    def output(self) -> tuple[list[LogprobEntry | None], list[RankEntry | None]]:
        """(entries, ranks) as EngineOutput carries them: None for the first prompt token
        (and for every token before the tail)."""
        head: list[None] = [None] * (self.first + 1)
        return [*head, *self.logprobs], [*head, *self.ranks]
