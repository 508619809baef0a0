"""What the engine core and its output processor both speak: a step in flight, finish
reasons, the errors a request can end with, the host phases of a step.

Data only (no step logic), so the core, the output processor and the feature components
import it without importing each other.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from paged_jax.core.request import RequestStatus

if TYPE_CHECKING:
    from paged_jax.core.block_pool import KVCacheBlock
    from paged_jax.core.request import Request
    from paged_jax.core.scheduler_output import SchedulerOutput
    from paged_jax.prompt_logprobs import PromptLogprobs
    from paged_jax.worker.runner import PendingStep

# EngineOutput.finish_reason of each way a request ends.
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

# EngineOutput.error of a constrained request whose sampled token its grammar refused.
GRAMMAR_REFUSED_ERROR = (
    "the sampled token {token} is not allowed by the request's structured_outputs "
    "constraint (its grammar refused it)"
)

# EngineOutput.error of a request whose logits held a NaN or an infinity.
NONFINITE_LOGITS_ERROR = (
    "the model's logits for this request are not finite (NaN or Inf): likely NaN/Inf "
    "weights in the checkpoint or a bad config value such as rms_norm_eps <= 0 or "
    "rope_theta <= 0"
)

# The parts of a step() call's host time that get_stats()["host_phase_time_ms"] reports.
HOST_PHASES = ("schedule", "prepare", "dispatch", "process_outputs")


@dataclasses.dataclass
class InFlightStep:
    """A dispatched device step and what reading its tokens needs.

    requests holds the Request objects scheduled (by position in out.scheduled), so a
    token is dropped when its request ended, even if a new request reuses the id.
    cached holds the blocks hashed when the step was scheduled: their KV exists once
    the step completes, so they lose their hashes if it fails. prompt holds, per
    PromptLogprobs the step computes positions of, those positions (ascending), in the
    order of the step's prompt rows (StepResult.prompt_logprobs).
    """

    out: SchedulerOutput
    requests: list[Request]
    pending: PendingStep
    cached: list[KVCacheBlock] = dataclasses.field(default_factory=list)
    prompt: list[tuple[PromptLogprobs, range]] = dataclasses.field(default_factory=list)
    # Per HiddenStates (paged_jax.activations) the positions this step captures for it,
    # in the order of StepResult.hidden_states' rows.
    hidden_states: list[tuple[Any, range]] = dataclasses.field(default_factory=list)
