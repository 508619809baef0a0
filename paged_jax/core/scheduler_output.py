"""What one scheduler step decided: the host -> device handoff (vLLM's SchedulerOutput).

Pure Python. `paged_jax.worker.InputBatch` turns these into a fixed-shape StepInput.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from paged_jax.core.request import Request


class ScheduledSeq(NamedTuple):
    """One sequence of a step: which request, where its new tokens start, how many.

    num_output_tokens counts tokens sampled so far, in-flight ones included (it keys
    the sampler's seed); samples is False for a prefill chunk that stops short of the
    request's last known token (its sampled id is garbage and is dropped).

    A NamedTuple (immutable, about 4x cheaper to build than a frozen dataclass): the
    scheduler makes one per running request per step.
    """

    req_id: str
    num_computed_tokens: int
    num_new_tokens: int
    num_output_tokens: int
    samples: bool = True


@dataclasses.dataclass
class NewRow:
    """A request entering the device batch (newly admitted or resumed): its whole state.

    block_ids holds one block table per KV-cache group (0 = null, below a window).
    """

    req_id: str
    token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclasses.dataclass
class SchedulerOutput:
    """What one step runs and what the runner must do to device state first.

    Order of application: drop rows of finished/preempted requests, swap out, add
    new rows (admitted, resumed or forked), append block ids, replace copied-on-write
    block ids, swap in, then run `scheduled` (whose step first runs `block_copies`).
    """

    scheduled: list[ScheduledSeq] = dataclasses.field(default_factory=list)
    new_rows: list[NewRow] = dataclasses.field(default_factory=list)
    # req_id -> blocks appended this step, one list per KV-cache group.
    new_block_ids: dict[str, tuple[list[int], ...]] = dataclasses.field(default_factory=dict)
    removed_req_ids: list[str] = dataclasses.field(default_factory=list)
    preempted_req_ids: list[str] = dataclasses.field(default_factory=list)
    # (req_id, block ids whose contents go to host) — read before any write this step.
    swap_out: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)
    # (req_id, fresh block ids that receive the host copy) — written before the step.
    swap_in: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)
    # Requests finished with an error while scheduling (they can never fit).
    errored: list[Request] = dataclasses.field(default_factory=list)
    # Copy-on-write: (src, dst) block copies run on device before this step's KV writes,
    # and the table slots (req_id -> [(group, index, new block id)]) that name the copies.
    block_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    replaced_block_ids: dict[str, list[tuple[int, int, int]]] = dataclasses.field(
        default_factory=dict
    )
    # The Request of each entry of `scheduled` (same order), as the scheduler saw them;
    # empty when the output was built by hand (readers then look requests up by id).
    scheduled_requests: list[Request] = dataclasses.field(default_factory=list)
    # Speculative decoding: req_id -> the drafts this step verifies after the request's
    # one known token (its ScheduledSeq.num_new_tokens counts them: 1 + len(drafts)).
    spec_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
