"""The engine's per-request and per-step records: finished outputs, the step in flight.

Split from engine.py so the engine module holds the step loop only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from paged_jax.core.kv_cache_spec import KVCacheGroupSpec
from paged_jax.core.request import Request
from paged_jax.core.scheduler_output import SchedulerOutput
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.runner import PendingStep


@dataclasses.dataclass
class EngineOutput:
    """One finished request.

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

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass
class InFlightStep:
    """A dispatched device step and what reading its tokens needs.

    requests holds the Request objects scheduled (by position in out.scheduled), so a
    token is dropped when its request ended, even if a new request reuses the id.
    """

    out: SchedulerOutput
    requests: list[Request]
    pending: PendingStep

    @classmethod
    def launch(cls, out: SchedulerOutput, live: dict[str, Request], pending: PendingStep):
        requests = out.scheduled_requests
        if len(requests) != len(out.scheduled):  # an output built by hand
            requests = [live[seq.req_id] for seq in out.scheduled]
        return cls(out, requests, pending)


@dataclasses.dataclass
class _ReqState:
    params: SamplingParams
    seed: int
    logprobs: list[dict[int, float]] | None
    first_token_time: float | None = None
    stop_reason: str | int | None = None


def model_kv_cache_groups(model: Any) -> tuple[KVCacheGroupSpec, ...]:
    """The model's KV-cache groups, or one full-attention group over all its layers.

    A model declares groups (full attention, sliding windows) with an optional
    ``kv_cache_groups()`` method; without one its window layers (if any) still attend
    through their window but keep every block.
    """
    method = getattr(model, "kv_cache_groups", None)
    if callable(method):
        return tuple(method())
    return (KVCacheGroupSpec(None, tuple(range(int(model.config.num_hidden_layers)))),)
