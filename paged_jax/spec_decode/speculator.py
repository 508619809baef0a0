"""The engine's speculative-decoding component: a proposer's drafts in, verified tokens out.

The engine calls it at two points of a step. ``read`` takes a verified step's result
(accepted drafts, then the target's own token, per row) and counts acceptance;
``propose`` runs after the step's tokens were applied and hands the scheduler the
drafts the next step verifies. The rejection sampler (worker/rejection_sampler.py) does
the verifying inside the step; the scheduler rolls rejected drafts back. Host side:
never imports jax.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import TYPE_CHECKING, Any

import numpy as np

from paged_jax.spec_decode.proposer import (
    Proposal,
    ProposalBatch,
    ProposalSampling,
    Proposer,
    check_proposal,
)

if TYPE_CHECKING:
    from paged_jax.core.kv_cache_manager import KVCacheManager
    from paged_jax.core.request import Request
    from paged_jax.core.scheduler import Scheduler
    from paged_jax.engine_types import InFlightStep
    from paged_jax.worker.input_batch import InputBatch


class Speculator:
    """Proposes drafts for the next step and reads verified steps; counts acceptance.

    Args:
        proposer: the Proposer of EngineConfig.speculative_config.
        method: its name (SpeculativeConfig.method), for the stats.
        k: num_speculative_tokens.
        scheduler, kv_cache_manager, input_batch: the engine's (read; the scheduler's
            ``spec_token_ids`` is set, its ``trimmed_req_ids`` consumed).
        runner: the engine's Runner; a proposer's draft distributions go to its
            ``draft_probs``.
    """

    def __init__(
        self,
        proposer: Proposer,
        method: str,
        k: int,
        scheduler: Scheduler,
        kv_cache_manager: KVCacheManager,
        input_batch: InputBatch,
        runner: Any,
    ) -> None:
        self.proposer = proposer
        self.method = method
        self.k = k
        self.scheduler = scheduler
        self.kv_cache_manager = kv_cache_manager
        self.input_batch = input_batch
        self.runner = runner
        self.num_drafts = 0  # sequence-steps that verified at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.drafted_at = np.zeros(k, np.int64)  # drafts proposed at position j
        self.accepted_at = np.zeros(k, np.int64)  # ... and accepted there
        self.last_accepted: dict[str, int] = {}  # drafts each row accepted last step

    def read(
        self, step: InFlightStep, result: Any, live_get: Callable[[str], Request | None]
    ) -> tuple[dict[str, list[int]], list[Request]]:
        """req_id -> its emitted tokens (accepted drafts, then the target's) of a
        verified step, and the requests whose logits were not finite; counts acceptance.

        A request with a non-finite position among its emitted ones keeps the tokens
        emitted before the first such position (each was decided by finite logits at an
        earlier position, so the plain engine emits them too) and is returned as broken:
        it ends with an error unless those tokens stop it first.
        """
        spec_ids = step.out.spec_token_ids
        emitted = result.num_emitted.tolist()
        token_ids = result.token_ids
        nonfinite = result.nonfinite
        sampled: dict[str, list[int]] = {}
        broken = []
        self.last_accepted = {}
        for i, (seq, req) in enumerate(zip(step.out.scheduled, step.requests)):
            if not seq.samples or live_get(seq.req_id) is not req:
                continue
            e = emitted[i]
            accepted = e - 1
            if nonfinite is not None and nonfinite[i, :e].any():
                broken.append(req)
                e = accepted = int(np.argmax(nonfinite[i, :e]))  # the first bad position
                if e == 0:
                    continue
            num_draft = len(spec_ids.get(seq.req_id, ()))
            if num_draft:
                self.num_drafts += 1
                self.num_draft_tokens += num_draft
                self.num_accepted_tokens += accepted
                self.drafted_at[:num_draft] += 1
                self.accepted_at[:accepted] += 1
                self.last_accepted[seq.req_id] = accepted
            sampled[seq.req_id] = token_ids[i, :e].tolist()
        return sampled, broken

    def propose(self, step: Any, constrained: Container[str]) -> None:
        """Asks the proposer for the drafts the next step verifies (after this step's
        tokens are applied): every running request with exactly one token to compute
        and an input-batch row, ``constrained`` ones (structured outputs) excepted.
        ``step``: the StepInput this step ran."""
        sched = self.scheduler
        kv = self.kv_cache_manager
        batch = self.input_batch
        if sched.trimmed_req_ids:  # rejected drafts' blocks went back: shorten the rows
            for req_id in sched.trimmed_req_ids:
                if req_id in batch.row_of:
                    ids = kv.get_block_ids_per_group(req_id)
                    batch.truncate_block_ids(req_id, [len(g) for g in ids])
            sched.trimmed_req_ids = []
        row_of = batch.row_of
        reqs = [
            r
            for r in sched.running
            if r.num_tokens - r.num_computed_tokens == 1
            and r.request_id in row_of
            and r.request_id not in constrained
        ]
        # Called with no proposing request too: a draft model still writes its KV for
        # the step's tokens (prefill chunks), or its later proposals miss them.
        rows = np.fromiter((row_of[r.request_id] for r in reqs), np.int32, len(reqs))
        proposal_batch = ProposalBatch(
            step_input=step,
            req_ids=[r.request_id for r in reqs],
            rows=rows,
            token_ids=[r.all_token_ids for r in reqs],
            next_token_ids=np.array([r.all_token_ids[-1] for r in reqs], np.int32),
            next_positions=np.array([r.num_tokens - 1 for r in reqs], np.int32),
            num_accepted=np.array(
                [self.last_accepted.get(r.request_id, 0) for r in reqs], np.int32
            ),
            block_ids=[kv.get_block_ids_per_group(r) for r in reqs],
            sampling=ProposalSampling(
                temperature=batch.temperature[rows],
                top_k=batch.top_k[rows],
                top_p=batch.top_p[rows],
                min_p=batch.min_p[rows],
                seeds=batch.seeds[rows],
                counters=np.array([r.num_output_tokens for r in reqs], np.int32),
            ),
        )
        proposal: Proposal = self.proposer.propose(proposal_batch)
        check_proposal(proposal, len(reqs), self.k)
        if proposal.draft_probs is not None:
            self.runner.draft_probs = proposal.draft_probs
        counts = proposal.num_tokens.tolist()
        ids = proposal.token_ids.tolist()
        sched.spec_token_ids = {
            r.request_id: ids[i][: counts[i]] for i, r in enumerate(reqs) if counts[i]
        }

    def stats(self) -> dict[str, Any]:
        """Speculative decoding's counters, as Engine.get_stats reports them."""
        drafted = self.drafted_at
        return {
            "spec_method": self.method,
            "spec_num_speculative_tokens": self.k,
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": (
                self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
            ),
            # Of the sequence-steps that proposed a draft at position j, the share that
            # accepted it.
            "spec_acceptance_rate_per_position": [
                float(a / d) if d else 0.0 for a, d in zip(self.accepted_at, drafted)
            ],
        }
