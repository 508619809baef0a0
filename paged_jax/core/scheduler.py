"""Continuous-batching scheduler with chunked prefill, preemption and forks (vLLM V1 semantics).

Host side, pure Python. Each step serves RUNNING requests first (decodes and the
next chunks of partial prefills), then admits WAITING ones, within the budgets
max_num_batched_tokens and max_num_seqs. When a running request cannot get a block,
the lowest-priority / latest-arrived running request is preempted (recompute: its
blocks are freed and it restarts from the waiting queue's head; swap: its KV blocks
are copied to host memory first and copied back into fresh blocks on resume). No
request is admitted in a step that preempted. A forked request (``fork_request``)
runs at once on its parent's blocks; the step copies a shared block on first write.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Iterable

from paged_jax.config import EngineConfig
from paged_jax.constants import cdiv
from paged_jax.core.copy_on_write import BlockCopies
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request, RequestStatus
from paged_jax.core.scheduler_output import NewRow, ScheduledSeq, SchedulerOutput
from paged_jax.lora import AdapterSlots


class _WaitingQueue:
    """FCFS deque or priority heap keyed by (priority, arrival_time, submission order)."""

    def __init__(self, policy: str):
        self.policy = policy
        self._fifo: collections.deque[Request] = collections.deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self):
        return iter(self._fifo) if self.policy == "fcfs" else (e[3] for e in sorted(self._heap))

    def add(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.append(req)
        else:
            heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._order), req))

    def prepend(self, req: Request) -> None:
        """Re-queue a preempted request: the front for FCFS, by priority otherwise."""
        if self.policy == "fcfs":
            self._fifo.appendleft(req)
        else:
            heapq.heappush(self._heap, (req.priority, req.arrival_time, -next(self._order), req))

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.remove(req)
        else:
            self._heap = [e for e in self._heap if e[3] is not req]
            heapq.heapify(self._heap)


class Scheduler:
    """Decides each step's tokens per request and owns the requests' lifecycles.

    Args:
        config: a resolved EngineConfig (max_model_len set).
        kv_cache_manager: the block manager all allocations go through.
    """

    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager):
        assert config.max_model_len is not None, "the engine resolves max_model_len first"
        if config.preemption_mode == "swap" and kv_cache_manager.has_sliding_window:
            # A swapped-out window table holds nulls below the window; restoring it would
            # hash fresh blocks whose contents were never computed.
            raise ValueError(
                f"EngineConfig.preemption_mode={config.preemption_mode!r} must be 'recompute' "
                "for models with sliding-window KV groups"
            )
        self.config = config
        self.kv = kv_cache_manager
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.num_usable_blocks = kv_cache_manager.num_usable_blocks
        self.requests: dict[str, Request] = {}
        self.waiting = _WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        # Requests preempted by swap: req_id -> number of tokens whose KV went to host.
        self.swapped: dict[str, int] = {}
        self._removed: list[str] = []
        self.errors: dict[str, str] = {}
        self.num_preemptions = 0
        self._forked: list[Request] = []  # children whose rows go out with the next step
        # Speculative decoding: k, the KV slots held past each request's known tokens for
        # a proposer's own KV, and the drafts the next schedule() verifies (set by the
        # engine after each step: req_id -> up to k proposed tokens).
        self.num_spec_tokens = config.num_speculative_tokens
        spec = config.speculative_config
        self.num_lookahead_tokens = 0 if spec is None else spec.num_lookahead_tokens
        self.spec_token_ids: dict[str, list[int]] = {}
        # Requests whose block tables lost their tail after a rejection (update_from_output);
        # the engine shortens their input-batch rows and clears this.
        self.trimmed_req_ids: list[str] = []
        # Multi-LoRA: at most max_loras distinct adapters among running requests (each
        # holds a device slot while it runs); None: LoRA off.
        self.max_loras = config.max_loras if config.enable_lora else None

    # ------------------------------------------------------------ lifecycle
    def add_request(self, req: Request) -> None:
        """Queue a validated request (the engine checks ids, lengths and params)."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id={req.request_id!r} must be unique among live requests")
        self.requests[req.request_id] = req
        req.status = RequestStatus.WAITING
        self.waiting.add(req)

    def finish_request(self, req_id: str, status: RequestStatus, error: str | None = None) -> None:
        """End a live request: free its blocks now and drop it from the device batch."""
        req = self.requests.pop(req_id)
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._removed.append(req_id)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        self.kv.free(req)
        self.swapped.pop(req_id, None)
        req.status = status
        if error is not None:
            self.errors[req_id] = error

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _can_never_fit(self, req: Request) -> str | None:
        """Why the request can never be scheduled again, or None."""
        if req.num_tokens > self.max_model_len:
            return (
                f"the request's {req.num_tokens} tokens exceed max_model_len={self.max_model_len}"
            )
        need = self.kv.max_blocks_per_request(req.num_tokens, self.config.max_num_batched_tokens)
        if need > self.num_usable_blocks:
            return (
                f"the request's {req.num_tokens} tokens need {need} KV blocks but the pool "
                f"has only {self.num_usable_blocks} usable blocks"
            )
        return None

    # ------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then admissions if nothing was preempted.

        There is no prefill or decode phase: each request has computed tokens and
        known tokens, and a step gives each the tokens that close the gap, within
        the budget. Every scheduled request is advanced optimistically, as in vLLM:
        its num_computed_tokens counts this step's tokens (the next step may continue
        a chunked prefill before this step's outputs are read) and, with async
        scheduling, a sampling step adds a placeholder for the token that stays on
        device. Last, after the step's final allocation, forked children enter the
        batch and the step's copies on write are taken.
        """
        out = SchedulerOutput(removed_req_ids=self._removed)
        self._removed = []
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []  # in schedule order
        reqs: list[Request] = []  # the Request of each entry of seqs
        placeholders = self.config.async_scheduling
        # Speculative decoding: a decoding request (one token to compute) with drafts
        # verifies them in the same step: 1 + s tokens, s capped by the budget, max_tokens
        # and max_model_len (each accepted draft is one more output token). The drafts
        # are not part of the request's tokens: they are never hashed, and after the
        # step num_computed_tokens drops back to the accepted length.
        spec_ids = self.spec_token_ids
        self.spec_token_ids = {}
        lookahead = self.num_lookahead_tokens
        # The decode hot loop: every running request, every step. Locals and inlined
        # checks keep it at a few attribute reads per request; a decode token that
        # needs no new block (or exactly one) takes allocate_slots' fast path.
        allocate = self.kv.allocate_slots
        empty = self.kv.empty_kv_cache_blocks
        new_block_ids = out.new_block_ids
        running_status = RequestStatus.RUNNING
        max_model_len = self.max_model_len
        make_seq = tuple.__new__  # ScheduledSeq(...) without its Python-level __new__
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not running_status:
                continue  # preempted earlier in this loop
            pending = req.num_output_placeholders
            num_tokens = len(req.all_token_ids)
            if pending:
                # Its in-flight tokens already reach max_tokens or max_model_len: the
                # last one is on its way, schedule nothing more.
                num_output = len(req.output_token_ids) + pending
                params = req.sampling_params
                if (
                    params is not None and num_output >= params.max_tokens
                ) or num_tokens + pending >= max_model_len:
                    continue
            else:
                num_output = len(req.output_token_ids)
            num_computed = req.num_computed_tokens
            num_new = num_tokens + pending - num_computed
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                continue
            drafts = spec_ids.get(req.request_id) if spec_ids else None
            num_draft = 0
            if drafts and num_new == 1 and not pending:
                drafts = self._cap_drafts(req, drafts, budget - 1)
                num_draft = len(drafts)
            samples = num_computed + num_new == num_tokens + pending
            num_new += num_draft
            new_blocks = (
                allocate(req, num_new, num_lookahead_tokens=lookahead)
                if lookahead
                else allocate(req, num_new)
            )
            if new_blocks is None:
                while new_blocks is None:
                    victim = self._pick_victim()
                    budget += self._unschedule(victim, seqs, reqs)
                    new_block_ids.pop(victim.request_id, None)
                    out.spec_token_ids.pop(victim.request_id, None)
                    self._preempt(victim, out)
                    if victim is req:
                        break
                    new_blocks = allocate(req, num_new, num_lookahead_tokens=lookahead)
                if req.status is not running_status:
                    continue
            if num_draft:
                out.spec_token_ids[req.request_id] = drafts
            if new_blocks is not empty and any(new_blocks.blocks):
                new_block_ids[req.request_id] = new_blocks.get_block_ids()
            seqs.append(
                make_seq(ScheduledSeq, (req.request_id, num_computed, num_new, num_output, samples))
            )
            reqs.append(req)
            req.num_computed_tokens = num_computed + num_new
            if placeholders and samples:
                req.num_output_placeholders = pending + 1
            budget -= num_new

        if not out.preempted_req_ids:
            self._admit(out, seqs, reqs, budget)
        if self._forked or len(self.kv.pending_copies):
            fork_rows = self._forked_rows()
            for row in fork_rows:
                # The row carries the child's whole current table.
                new_block_ids.pop(row.req_id, None)
            out.new_rows.extend(fork_rows)
            copies = self.kv.take_pending_copies()
            out.block_copies = copies.pairs
            out.replaced_block_ids = self._replaced_block_ids(
                copies, {row.req_id for row in fork_rows}
            )
        out.scheduled = seqs
        out.scheduled_requests = reqs
        return out

    def _cap_drafts(self, req: Request, drafts: list[int], room: int) -> list[int]:
        """The drafts a decoding request can verify now: within the token budget left
        (room), and such that every accepted draft plus the bonus token stays within
        max_tokens and max_model_len."""
        limit = min(room, self.num_spec_tokens, self.max_model_len - req.num_tokens - 1)
        params = req.sampling_params
        max_tokens = getattr(params, "max_tokens", None)
        if max_tokens is not None:
            limit = min(limit, max_tokens - len(req.output_token_ids) - 1)
        return list(drafts[: max(limit, 0)])

    def _unschedule(self, req: Request, seqs: list[ScheduledSeq], reqs: list[Request]) -> int:
        """Takes a request being preempted back out of this step; returns its tokens."""
        for i in range(len(reqs) - 1, -1, -1):
            if reqs[i] is req:
                seq = seqs.pop(i)
                del reqs[i]
                req.num_computed_tokens -= seq.num_new_tokens
                if self.config.async_scheduling and seq.samples:
                    req.num_output_placeholders -= 1
                return seq.num_new_tokens
        return 0

    def _admit(
        self, out: SchedulerOutput, seqs: list[ScheduledSeq], reqs: list[Request], budget: int
    ) -> None:
        # Requests whose adapter cannot get a LoRA slot now (every slot pinned by running
        # requests of other adapters) step aside, as in vLLM: the ones behind them may run;
        # they go back to the head of the queue, in order, after this round.
        lora_deferred: list[Request] = []
        self._admit_loop(out, seqs, reqs, budget, lora_deferred)
        for req in reversed(lora_deferred):
            self.waiting.prepend(req)

    def _admit_loop(
        self,
        out: SchedulerOutput,
        seqs: list[ScheduledSeq],
        reqs: list[Request],
        budget: int,
        lora_deferred: list[Request],
    ) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            if req.num_output_placeholders:
                break  # preempted with a token in flight: resumes once it is read
            reason = self._can_never_fit(req)
            if reason is not None:
                self.finish_request(req.request_id, RequestStatus.FINISHED_ERROR, reason)
                out.errored.append(req)
                continue
            if self.max_loras is not None and not self._adapter_fits(req):
                lora_deferred.append(self.waiting.pop())
                continue
            swapped_tokens = self.swapped.get(req.request_id)
            if swapped_tokens is not None:
                # Resume from host: fresh blocks for the swapped tokens and the new ones.
                num_new = min(req.num_tokens - swapped_tokens, budget)
                req.num_computed_tokens = 0
                if (
                    self.kv.allocate_slots(
                        req,
                        swapped_tokens + num_new,
                        num_lookahead_tokens=self.num_lookahead_tokens,
                    )
                    is None
                ):
                    req.num_computed_tokens = swapped_tokens
                    break
                num_computed = swapped_tokens
                block_ids = self.kv.get_block_ids_per_group(req)
                out.swap_in.append(
                    (req.request_id, block_ids[0][: cdiv(swapped_tokens, self.block_size)])
                )
                del self.swapped[req.request_id]
            else:
                hit_blocks, num_computed = self.kv.get_computed_blocks(req)
                num_new = min(req.num_tokens - num_computed, budget)
                if (
                    self.kv.allocate_slots(
                        req,
                        num_new,
                        num_new_computed_tokens=num_computed,
                        new_computed_blocks=hit_blocks,
                        num_lookahead_tokens=self.num_lookahead_tokens,
                    )
                    is None
                ):
                    break  # head-of-line blocking: waiting requests never preempt
                block_ids = self.kv.get_block_ids_per_group(req)
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.new_rows.append(
                NewRow(req.request_id, list(req.all_token_ids), block_ids, num_computed)
            )
            samples = num_computed + num_new == req.num_tokens
            seqs.append(
                ScheduledSeq(req.request_id, num_computed, num_new, req.num_output_tokens, samples)
            )
            reqs.append(req)
            req.num_computed_tokens = num_computed + num_new  # the optimistic advance
            if samples and self.config.async_scheduling:
                req.num_output_placeholders += 1
            budget -= num_new

    def _adapter_fits(self, req: Request) -> bool:
        """Whether ``req``'s adapter (if any) can have a device slot beside the running ones."""
        if req.adapter_id is None:
            return True
        running = (r.adapter_id for r in self.running if r.adapter_id is not None)
        return AdapterSlots.fits(req.adapter_id, running, self.max_loras)

    # ------------------------------------------------------------ forks
    def fork_request(self, parent_id: str, child: Request, num_tokens: int | None = None) -> None:
        """Starts ``child`` (see ``Request.fork``) as a running request sharing the parent's blocks.

        The child's computed tokens are the parent's first num_tokens (default: all
        the parent's computed tokens); its first write into a shared block is copied
        on write. Its input-batch row goes out with the next schedule().

        Raises:
            ValueError: the parent is not running, the child's id is taken, or the
                batch already holds max_num_seqs requests (see KVCacheManager.fork too).
        """
        parent = self.requests.get(parent_id)
        if parent is None or parent.status != RequestStatus.RUNNING:
            raise ValueError(f"parent_id={parent_id!r} must name a running request")
        if child.request_id in self.requests:
            raise ValueError(
                f"child.request_id={child.request_id!r} must be unique among live requests"
            )
        if len(self.running) >= self.config.max_num_seqs:
            raise ValueError(
                f"max_num_seqs={self.config.max_num_seqs} requests are running: finish or "
                f"abort one before forking {parent_id!r}"
            )
        child.num_computed_tokens = self.kv.fork(parent, child, num_tokens)
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.running.append(child)
        self._forked.append(child)

    def _forked_rows(self) -> list[NewRow]:
        """Rows of the children forked since the last step that still run (whole tables).

        A child preempted meanwhile gets its row when it resumes; a finished one none.
        """
        rows = [
            NewRow(
                child.request_id,
                list(child.all_token_ids),
                self.kv.get_block_ids_per_group(child),
                0,
            )
            for child in self._forked
            if child.status == RequestStatus.RUNNING
        ]
        self._forked = []
        return rows

    def _replaced_block_ids(
        self, copies: BlockCopies, new_row_ids: set[str]
    ) -> dict[str, list[tuple[int, int, int]]]:
        """The table slots of running rows that now name a copy (a new row has them already)."""
        replaced = {}
        for rid, updates in copies.table_updates.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING or rid in new_row_ids:
                continue
            replaced[rid] = list(updates)
        return replaced

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        if self.config.preemption_mode == "swap" and req.num_computed_tokens > 0:
            num_saved = req.num_computed_tokens
            block_ids = list(self.kv.get_block_ids(req))[: cdiv(num_saved, self.block_size)]
            # A block copied on write this round holds no KV until the step: read its source.
            block_ids = [self.kv.pending_copies.source_of(b) for b in block_ids]
            out.swap_out.append((req.request_id, block_ids))
            self.swapped[req.request_id] = num_saved
        else:
            req.num_computed_tokens = 0
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(req)
        out.preempted_req_ids.append(req.request_id)
        out.removed_req_ids.append(req.request_id)

    # ------------------------------------------------------------ failed steps
    def roll_back(self, touched: Iterable[Request] = ()) -> list[str]:
        """Undoes what steps that never completed advanced, so their work runs again.

        Scheduling a step advances its requests before the device runs it (computed
        tokens, async placeholders). When a step fails, every running request goes back
        to the head of the waiting queue in running order, holding no blocks, with no
        computed tokens and no placeholders, exactly as after a recompute preemption
        (not counted as one): on resume it recomputes its KV, mostly from prefix hits
        on what completed steps wrote. Tokens already appended are kept; they came from
        completed steps. A live request of ``touched`` that left the running list since
        (preempted while its token was in flight) loses its placeholders and its
        swapped-out host copy, which may hold the failed step's KV.

        Args:
            touched: the Request objects the failed steps scheduled.

        Returns:
            The ids whose swapped-out host copies must be dropped.
        """
        assert not len(self.kv.pending_copies), "copies are taken inside schedule()"
        dropped = []
        live = self.requests
        for req in touched:
            rid = req.request_id
            if live.get(rid) is not req or req.status == RequestStatus.RUNNING:
                continue
            req.num_output_placeholders = 0
            if self.swapped.pop(rid, None) is not None:
                req.num_computed_tokens = 0
                dropped.append(rid)
        running, self.running = self.running, []
        for req in running:
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.num_output_placeholders = 0
            req.status = RequestStatus.PREEMPTED
            self._removed.append(req.request_id)
        for req in reversed(running):  # each goes to the head: the first ends first
            self.waiting.prepend(req)
        self._forked = []
        return dropped

    # ------------------------------------------------------------ results
    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, int], eos_token_ids: tuple[int, ...] = ()
    ) -> list[Request]:
        """Append sampled tokens, check token-level stops, free finished requests.

        Args:
            out: the SchedulerOutput this step ran.
            sampled: req_id -> sampled token for every sequence whose step reached
                the end of its known tokens (a partial prefill chunk samples nothing).
            eos_token_ids: the model's EOS ids (ignored for requests with ignore_eos).

        Returns:
            The requests that finished in this step (already freed).
        """
        finished = []
        requests = self.requests
        running_status = RequestStatus.RUNNING
        max_model_len = self.max_model_len
        for req_id, token in sampled.items():
            req = requests.get(req_id)
            if req is None:
                continue
            if req.num_output_placeholders:
                # Async: the token was scheduled on; a request preempted meanwhile keeps it.
                req.num_output_placeholders -= 1
            elif req.status is not running_status:
                continue
            if type(token) is list:  # a speculative row: its accepted drafts and one more
                if self._apply_spec_tokens(req, token, out, eos_token_ids):
                    finished.append(req)
                continue
            req.append_output_token_ids(token)
            # Token-level stops (this loop runs for every sequence of every step).
            params = req.sampling_params
            status = None
            if params is not None:
                num_output = len(req.output_token_ids)
                if num_output >= params.min_tokens and (
                    (not params.ignore_eos and token in eos_token_ids)
                    or token in params.stop_token_ids
                ):
                    status = RequestStatus.FINISHED_STOPPED
                elif num_output >= params.max_tokens:
                    status = RequestStatus.FINISHED_LENGTH
            if status is None and len(req.all_token_ids) >= max_model_len:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self.finish_request(req_id, status)
                finished.append(req)
        return finished

    def token_stop_status(self, req: Request, token: int, eos_token_ids: tuple[int, ...]):
        """The FINISHED_* status appending ``token`` (already appended) gives, or None."""
        params = req.sampling_params
        if params is not None:
            num_output = len(req.output_token_ids)
            if num_output >= params.min_tokens and (
                (not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids
            ):
                return RequestStatus.FINISHED_STOPPED
            if num_output >= params.max_tokens:
                return RequestStatus.FINISHED_LENGTH
        if len(req.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _apply_spec_tokens(
        self,
        req: Request,
        tokens: list[int],
        out: SchedulerOutput,
        eos_token_ids: tuple[int, ...],
    ) -> bool:
        """Appends a verified row's emitted tokens in order, stopping at the first stop.

        Rollback of the rejected drafts: the step computed KV for the token before the
        drafts and every draft; only the accepted ones count, so num_computed_tokens
        becomes num_tokens - 1 (the last emitted token is computed next step). Blocks
        held only for rejected drafts (past num_tokens + lookahead) go back to the pool;
        drafts were never hashed (allocate_slots caches only over known tokens).

        Returns:
            True when the request finished (already freed); the tokens after the stop
            are dropped.
        """
        status = None
        for token in tokens:
            req.append_output_token_ids(token)
            status = self.token_stop_status(req, token, eos_token_ids)
            if status is not None:
                break
        if status is not None:
            self.finish_request(req.request_id, status)
            return True
        req.num_computed_tokens = req.num_tokens - 1
        if self.kv.free_tail_blocks(req, req.num_tokens + self.num_lookahead_tokens):
            self.trimmed_req_ids.append(req.request_id)
        return False
