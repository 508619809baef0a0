"""The scheduler's side of forks: start a forked child, emit its row and the step's copies.

Kept beside scheduler.py so the scheduler's main loop stays readable. Pure Python;
never imports jax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_jax.core.request import Request, RequestStatus
from paged_jax.core.scheduler_output import NewRow, SchedulerOutput

if TYPE_CHECKING:
    from paged_jax.core.scheduler import Scheduler


def fork_running_request(
    sched: Scheduler, parent_id: str, child: Request, num_tokens: int | None = None
) -> None:
    """Scheduler.fork_request: the child joins the running requests on the parent's blocks."""
    parent = sched.requests.get(parent_id)
    if parent is None or parent.status != RequestStatus.RUNNING:
        raise ValueError(f"parent_id={parent_id!r} must name a running request")
    if child.request_id in sched.requests:
        raise ValueError(
            f"child.request_id={child.request_id!r} must be unique among live requests"
        )
    if len(sched.running) >= sched.config.max_num_seqs:
        raise ValueError(
            f"max_num_seqs={sched.config.max_num_seqs} requests are running: finish or "
            f"abort one before forking {parent_id!r}"
        )
    child.num_computed_tokens = sched.kv.fork(parent, child, num_tokens)
    child.status = RequestStatus.RUNNING
    sched.requests[child.request_id] = child
    sched.running.append(child)
    sched._forked.append(child)


def add_fork_rows_and_copies(sched: Scheduler, out: SchedulerOutput) -> None:
    """Adds forked children's rows (their whole current tables) and the step's block copies.

    Called at the end of schedule(), after the last allocation of the step. A child
    row carries its table as it is now, so its new and copied blocks of this step
    are not also sent as appends or replacements.
    """
    new_rows = set()
    for child in sched._forked:
        if child.status != RequestStatus.RUNNING:
            continue  # preempted (its row comes with its resume) or finished already
        rid = child.request_id
        new_rows.add(rid)
        out.new_block_ids.pop(rid, None)
        out.new_rows.append(
            NewRow(rid, list(child.all_token_ids), sched.kv.get_block_ids_per_group(rid), 0)
        )
    sched._forked = []
    copies = sched.kv.take_pending_copies()
    out.block_copies = copies.pairs
    for rid, updates in copies.table_updates.items():
        req = sched.requests.get(rid)
        if req is None or req.status != RequestStatus.RUNNING or rid in new_rows:
            continue
        out.replaced_block_ids[rid] = list(updates)
