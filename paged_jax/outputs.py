"""Finished outputs: the engine's EngineOutput and LLM.generate's vLLM-shaped RequestOutput.

The engine keeps logprobs cheap (``{token id: float}`` per position and a parallel list
of ranks); ``RequestOutput`` and ``CompletionOutput`` carry vLLM's ``Logprob`` objects,
built from those by ``paged_jax.output_processor``. Data types (and the one-position
``logprob_entry``) only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

# One position's logprobs as the engine keeps them: {token id: logprob}, the chosen
# (sampled or prompt) token first, then the top ones; and the rank of each, in that order.
LogprobEntry = dict[int, float]
RankEntry = list[int]


@dataclasses.dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's ``Logprob``).

    Attributes:
        logprob: the log-probability, from the raw model distribution (log-softmax of
            the logits before temperature, penalties or other processing).
        rank: 1-based rank of the token in that distribution: how many tokens are at
            least as likely (the chosen token's real rank even outside the top ones;
            the top entries rank 1..k).
        decoded_token: the tokenizer's text of this one token, None without a tokenizer.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprob_entry(
    token_id: int,
    logprob: float,
    rank: int,
    top_token_ids: Sequence[int],
    top_logprobs: Sequence[float],
) -> tuple[LogprobEntry, RankEntry]:
    """One position's entry: the chosen token, then the top ones (vLLM's order and ranks).

    A chosen token that is also a top one keeps its place first and takes that top
    entry's rank, as in vLLM.
    """
    entry = {token_id: logprob}
    ranks = [rank]
    for j, (tid, lp) in enumerate(zip(top_token_ids, top_logprobs)):
        if tid == token_id:
            ranks[0] = j + 1
        else:
            ranks.append(j + 1)
        entry[tid] = lp
    return entry, ranks


@dataclasses.dataclass
class EngineOutput:
    """One finished request, as ``Engine.step`` and ``Engine.abort_request`` return it.

    A parallel-sampling parent (``SamplingParams.n > 1``) finishes once, when its last
    sample does: ``samples`` then holds the n per-sample outputs in index order (each
    an ordinary EngineOutput), ``token_ids`` is empty and ``logprobs`` None. Its
    ``finish_reason`` is the one its samples share; when they differ, the first of
    "stop", "length", "abort" that any sample has ("error" only when every sample
    failed, with the first sample's ``error``).

    Attributes:
        request_id: the id given to add_request.
        prompt_token_ids: the prompt.
        token_ids: generated tokens (a stop token is included; EOS too).
        finish_reason: "stop", "length", "abort" or "error".
        stop_reason: the stop string or stop token that ended it, if any.
        error: why the request failed (finish_reason "error").
        logprobs: per generated token {token id: logprob} (sampled token first, then
            the top `SamplingParams.logprobs`), or None when not asked for.
        logprob_ranks: per generated token the 1-based ranks of that entry's tokens,
            in its order (see ``logprob_entry``); None with logprobs None.
        prompt_logprobs: with `SamplingParams.prompt_logprobs`: None for the first
            prompt token, then per prompt token {that token: logprob, + the top ones};
            None when not asked for (a parallel-sampling parent holds its prompt's).
            A request that ended before its prompt was computed has fewer entries.
        prompt_logprob_ranks: the ranks of prompt_logprobs, aligned with it.
        arrival_time / first_token_time / finish_time: wall-clock seconds.
        num_cached_tokens: prompt tokens served from the prefix cache at admission.
        num_preemptions: how often the request was preempted.
        samples: a parallel-sampling parent's n outputs in index order; None for
            every other request.
        prompt_hidden_states / hidden_states: with SamplingParams.return_hidden_states,
            {layer: f32[rows, hidden_size]} of the prompt's tokens and of the generated
            tokens that were fed back (paged_jax.activations); None otherwise.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list[LogprobEntry] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float = 0.0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    samples: list[EngineOutput] | None = None
    logprob_ranks: list[RankEntry] | None = None
    prompt_logprobs: list[LogprobEntry | None] | None = None
    prompt_logprob_ranks: list[RankEntry | None] | None = None
    prompt_hidden_states: dict[int, Any] | None = None
    hidden_states: dict[int, Any] | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def completions(self) -> list[EngineOutput]:
        """The outputs of the prompt's completions: ``samples``, or this output alone."""
        return [self] if self.samples is None else self.samples


@dataclasses.dataclass
class CompletionOutput:
    """One sampled completion of a prompt.

    Attributes:
        index: which of the prompt's n completions this is.
        text: the decoded text (a matched stop string is cut off, as in vLLM).
        token_ids: generated token ids (the stop token or EOS is included).
        finish_reason: "stop", "length", "abort" or "error".
        stop_reason: the stop string or stop token id that ended it; None for EOS/length.
        logprobs: per generated token {token id: Logprob} when SamplingParams.logprobs
            was set: the sampled token (with its real rank) and the top
            SamplingParams.logprobs tokens (ranks 1..k); ``logprobs[i][t].logprob``.
        cumulative_logprob: the sum of the generated tokens' logprobs; None when
            SamplingParams.logprobs was not set (as vLLM V1).
        error: what went wrong when finish_reason is "error".
        hidden_states: with SamplingParams.return_hidden_states, {layer: f32[N - 1,
            hidden_size]} for N generated tokens: row j is the residual stream at the
            position that consumed generated token j (the last token is never fed
            back); None otherwise.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    error: str | None = None
    cumulative_logprob: float | None = None
    hidden_states: dict[int, Any] | None = None


@dataclasses.dataclass
class RequestMetrics:
    """Timing of one prompt (wall-clock seconds; first token over all its completions)."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float
    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_tokens: int

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    """Everything LLM.generate returns for one prompt, in input order.

    Attributes:
        request_id / prompt / prompt_token_ids: the request and its prompt.
        outputs: its completions (n of them; beams are LLM.beam_search's).
        metrics: timing and token counts.
        prompt_logprobs: with SamplingParams.prompt_logprobs: None for the first
            prompt token, then for each later one {that token: Logprob, + the top
            prompt_logprobs tokens} from the raw model distribution; None otherwise.
        prompt_hidden_states: with SamplingParams.return_hidden_states, {layer:
            f32[num_prompt_tokens, hidden_size]} (EngineConfig.hidden_state_layers);
            None otherwise.
        error: why the prompt was not served, else None. Set (with ``outputs``
            empty) for a prompt LLM.generate_iter rejected (LLM.generate raises on
            such input before running anything), and, by both, when every completion
            failed while running (their finish_reason is "error").
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = True
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_hidden_states: dict[int, Any] | None = None
