"""Finished outputs: the engine's EngineOutput and LLM.generate's vLLM-shaped RequestOutput."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paged_jax.sampling_params import SamplingParams


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
        logprobs: per generated token {token id: logprob} (sampled token plus the
            top `SamplingParams.logprobs`), or None when not asked for.
        arrival_time / first_token_time / finish_time: wall-clock seconds.
        num_cached_tokens: prompt tokens served from the prefix cache at admission.
        num_preemptions: how often the request was preempted.
        samples: a parallel-sampling parent's n outputs in index order; None for
            every other request.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float = 0.0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    samples: list[EngineOutput] | None = None

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

    @classmethod
    def from_engine_output(
        cls,
        index: int,
        out: EngineOutput,
        params: SamplingParams,
        decode: Callable[..., str],
    ) -> CompletionOutput:
        """One completion with vLLM's text rules.

        A stop string is cut off, and so is the text of the stop token or EOS that
        ended the output; ``include_stop_str_in_output`` keeps both.

        Args:
            index: which of the prompt's completions this is.
            out: the finished (sample's) engine output.
            params: the prompt's SamplingParams (its text settings).
            decode: ``decode(token_ids, skip_special_tokens=...) -> str``.
        """
        ids = list(out.token_ids)
        keep_stop = params.include_stop_str_in_output
        by_token = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
        text_ids = ids[:-1] if by_token and ids and not keep_stop else ids
        text = decode(text_ids, skip_special_tokens=params.skip_special_tokens)
        if isinstance(out.stop_reason, str) and out.stop_reason in text:
            end = text.find(out.stop_reason)
            text = text[: end + len(out.stop_reason)] if keep_stop else text[:end]
        return cls(
            index=index,
            text=text,
            token_ids=ids,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            logprobs=out.logprobs,
            error=out.error,
        )


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
