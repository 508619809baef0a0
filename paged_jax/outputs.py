"""Public outputs of LLM.generate (vLLM-shaped): RequestOutput, CompletionOutput, metrics."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    """One sampled completion of a prompt.

    Attributes:
        index: which of the prompt's n completions this is.
        text: the decoded text (a matched stop string is cut off, as in vLLM).
        token_ids: generated token ids (the stop token or EOS is included).
        finish_reason: "stop", "length", "abort" or "error".
        stop_reason: the stop string or stop token id that ended it; None for EOS/length.
        logprobs: per token {token id: logprob} when SamplingParams.logprobs was set.
        error: what went wrong when finish_reason is "error".
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None


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

    `error` is set (and `outputs` empty) when LLM.generate_iter could not serve the
    prompt; LLM.generate raises instead.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = True
    error: str | None = None
