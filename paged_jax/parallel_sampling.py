"""Parallel sampling (SamplingParams.n > 1): a parent request whose n samples share one prefill.

The Engine prefills the prompt minus its last token once, as a carrier request. Right
after the step that reads the carrier's first token it forks the n samples from it
(sharing every block, the partial last one included) and aborts the carrier; each
sample then computes the last prompt token as a one-token decode row and samples its
own first token with its own seed. Its write into the shared partial block is copied
on write (n - 1 copies; the last sample writes in place). Without forks each sample
would prefill the whole prompt and find only its full blocks in the prefix cache.

    add_request(p, prompt, n=3)   carrier "p__prefill": prompt[:-1], greedy
    step() ... carrier's first token read -> fork "p_0", "p_1", "p_2"; abort the carrier
    step() ... "p_0" .. "p_2" finish -> one EngineOutput "p" with samples [p_0, p_1, p_2]

``ParallelSampleRequest`` keeps one parent's bookkeeping (ids, per-sample settings,
finished samples, the merged output); ``ParallelSampling`` is the engine's component for
all of them: it queues carriers, forks samples after the prefill, gathers finished
samples into their parent's output and aborts parents, through four engine calls (queue,
fork, abort, is_live); the engine calls it after each step's tokens (``after_step``).
Pure Python; never imports jax.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from paged_jax.core.request import Request, RequestStatus
from paged_jax.outputs import EngineOutput
from paged_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_jax.prompt_logprobs import PromptLogprobs

CARRIER_SUFFIX = "__prefill"
# The carrier's sampled token is discarded (greedy is enough); ignore_eos and a second
# token keep it running until the samples are forked from it.
CARRIER_PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
# When samples end differently, the parent reports the first of these any sample has.
_REASON_ORDER = ("stop", "length", "abort")


def carrier_params(params: SamplingParams) -> SamplingParams:
    """The carrier's settings: CARRIER_PARAMS, with the parent's steering vectors (the
    prompt's KV is the steered one its samples share) and its return_hidden_states (the
    carrier's prompt rows are the samples' first rows)."""
    if params.steering_vectors is None and not params.return_hidden_states:
        return CARRIER_PARAMS
    return dataclasses.replace(
        CARRIER_PARAMS,
        steering_vectors=params.steering_vectors,
        return_hidden_states=params.return_hidden_states,
    )


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Settings of sample ``index``: n=1, and seed (seed + index) % 2**32 when seeded."""
    seed = None if params.seed is None else (params.seed + index) % 2**32
    return dataclasses.replace(params, n=1, seed=seed)


class ParallelSampleRequest:
    """One n > 1 request: its samples' ids and settings, its carrier, its finished samples.

    Args:
        request_id: the parent's id.
        prompt_token_ids: the prompt (validated by the engine).
        params: the parent's settings (n > 1).
        arrival_time: the parent's arrival (wall-clock seconds).
        priority: the parent's scheduling priority, passed on to its requests.
        cache_salt: the parent's prefix-cache salt, passed on to its requests.
        block_extra_keys: the parent's per-block hash keys, passed on to its requests.
        adapter_id: the parent's LoRA adapter id (None: the base model), passed on to its
            requests, so its carrier and samples run with the adapter and hash with it.
        prompt_embeds: the parent's prompt embeddings (f32[P, hidden], checked by the
            engine), passed on to its requests; None for a token prompt.

    Attributes:
        samples: (request id, settings) of each sample in index order; sample j is
            ``f"{request_id}_{j}"``.
        carrier_id: the request prefilling all but the last prompt token, None when
            the prompt has one token (its samples are plain requests from the start).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival_time: float,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        block_extra_keys: tuple[bytes, ...] = (),
        adapter_id: int | str | None = None,
        prompt_embeds: Any = None,
    ) -> None:
        assert params.n > 1, "an n == 1 request is a plain request, never a parent"
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.block_extra_keys = block_extra_keys
        self.adapter_id = adapter_id
        self.prompt_embeds = prompt_embeds
        self.samples = [(f"{request_id}_{j}", sample_params(params, j)) for j in range(params.n)]
        self.carrier_id = request_id + CARRIER_SUFFIX if len(self.prompt_token_ids) >= 2 else None
        self._outputs: dict[str, EngineOutput] = {}

    @property
    def carrier_prompt(self) -> list[int]:
        """What the carrier prefills: every prompt token but the last."""
        return self.prompt_token_ids[:-1]

    @property
    def request_ids(self) -> list[str]:
        """Every engine request id this parent uses: its carrier (if any), then its samples."""
        carrier = [] if self.carrier_id is None else [self.carrier_id]
        return carrier + [sample_id for sample_id, _ in self.samples]

    @property
    def done(self) -> bool:
        """True once every sample has finished."""
        return len(self._outputs) == len(self.samples)

    def record(self, out: EngineOutput) -> None:
        """Keeps one finished sample's output."""
        assert out.request_id not in self._outputs, f"sample {out.request_id!r} finished twice"
        self._outputs[out.request_id] = out

    def unfinished_sample_ids(self) -> list[str]:
        """Samples without an output yet, in index order (live or not yet forked)."""
        return [sid for sid, _ in self.samples if sid not in self._outputs]

    def output(self, finish_time: float) -> EngineOutput:
        """The parent's EngineOutput; a sample that never started counts as aborted."""
        outs = [
            self._outputs.get(sid)
            or EngineOutput(
                request_id=sid,
                prompt_token_ids=list(self.prompt_token_ids),
                token_ids=[],
                finish_reason="abort",
                arrival_time=self.arrival_time,
                finish_time=finish_time,
            )
            for sid, _ in self.samples
        ]
        reasons = {o.finish_reason for o in outs}
        if len(reasons) == 1:
            reason = reasons.pop()
        else:
            reason = next(r for r in _REASON_ORDER if r in reasons)
        firsts = [o.first_token_time for o in outs if o.first_token_time is not None]
        # Every sample that ran holds the whole prompt's rows (the carrier's, then its own
        # row of the last prompt token): the parent reports them once.
        prompt_states = next(
            (o.prompt_hidden_states for o in outs if o.prompt_hidden_states is not None), None
        )
        return EngineOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            token_ids=[],
            finish_reason=reason,
            error=outs[0].error if reason == "error" else None,
            arrival_time=self.arrival_time,
            first_token_time=min(firsts) if firsts else None,
            finish_time=finish_time,
            num_cached_tokens=max(o.num_cached_tokens for o in outs),
            num_preemptions=sum(o.num_preemptions for o in outs),
            samples=outs,
            prompt_hidden_states=prompt_states,
        )


class ParallelSampling:
    """The engine's live parallel-sampling parents and the requests they run.

    Args:
        queue: ``queue(request, prompt, prompt_embeds)`` queues one of a parent's
            requests (a Request) as a plain engine request; ``prompt`` is the parent's
            PromptLogprobs when this request must compute them (it then skips reading
            the prefix cache), else None; ``prompt_embeds`` the parent's (or None).
        fork: ``fork(carrier, sample_id, prompt_token_ids, output_token_ids, params)``
            (the engine's fork, output_token_ids None) forks a sample from its
            prefilled carrier (a Request); ValueError when it cannot.
        abort: ``abort(request_id) -> EngineOutput`` ends a live engine request.
        is_live: ``is_live(request_id)``: a plain engine request holds the id.

    Attributes:
        parents: live parents by id.
        parent_of: every id a live parent uses (its carrier and samples) -> the parent.
        prefilling: carrier id -> its parent, for carriers whose samples are not forked.
    """

    def __init__(
        self,
        queue: Callable[..., None],
        fork: Callable[..., None],
        abort: Callable[[str], EngineOutput],
        is_live: Callable[[str], bool],
    ) -> None:
        self.queue = queue
        self.fork = fork
        self.abort = abort
        self.is_live = is_live
        self.parents: dict[str, ParallelSampleRequest] = {}
        self.parent_of: dict[str, ParallelSampleRequest] = {}
        self.prefilling: dict[str, ParallelSampleRequest] = {}
        self.prompt_logprobs: dict[str, PromptLogprobs] = {}

    def holds(self, request_id: str) -> bool:
        """True when a live parent uses ``request_id`` (as itself, its carrier or a sample)."""
        return request_id in self.parents or request_id in self.parent_of

    def add(
        self,
        req: Request,
        prompt: PromptLogprobs | None,
        id_taken: Callable[[str], bool],
        prompt_embeds: Any = None,
    ) -> None:
        """Queues an n > 1 request, validated as the Request ``req``: its carrier, or
        its samples (a one-token prompt).

        ``prompt`` collects the parent's prompt logprobs, computed by its carrier (or by
        samples that fell back to plain requests before the carrier finished them).
        ``prompt_embeds``: the prompt's embeddings (every request of the parent gets them).

        Raises:
            ValueError: an id one of its requests needs is taken (``id_taken``).
        """
        parent = ParallelSampleRequest(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
            block_extra_keys=req.block_extra_keys,
            adapter_id=req.adapter_id,
            prompt_embeds=prompt_embeds,
        )
        for rid in parent.request_ids:
            if id_taken(rid):
                raise ValueError(
                    f"request_id={req.request_id!r} must leave {rid!r} free for its "
                    "samples; a live request holds it"
                )
        arrival_time = req.arrival_time
        self.parents[parent.request_id] = parent
        for rid in parent.request_ids:
            self.parent_of[rid] = parent
        if prompt is not None:
            self.prompt_logprobs[parent.request_id] = prompt
        if parent.carrier_id is None:  # a one-token prompt has nothing to prefill first
            for sample_id, params in parent.samples:
                self._queue(parent, sample_id, parent.prompt_token_ids, params, arrival_time)
        else:
            carrier = carrier_params(parent.params)
            self._queue(parent, parent.carrier_id, parent.carrier_prompt, carrier, arrival_time)
            self.prefilling[parent.carrier_id] = parent

    def _queue(
        self,
        parent: ParallelSampleRequest,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None,
    ) -> None:
        """Queues a parent's carrier or one of its samples (computing the parent's prompt
        logprobs while they are incomplete)."""
        prompt = self.prompt_logprobs.get(parent.request_id)
        if prompt is not None and prompt.complete:
            prompt = None
        req = Request(
            request_id,
            prompt_token_ids,
            params,
            cache_salt=parent.cache_salt,
            block_extra_keys=parent.block_extra_keys,
            adapter_id=parent.adapter_id,
            priority=parent.priority,
            arrival_time=arrival_time,
            skip_reading_prefix_cache=prompt is not None and prompt.num_cacheable_tokens == 0,
            max_cache_hit_tokens=None if prompt is None else prompt.num_cacheable_tokens,
        )
        self.queue(req, prompt, parent.prompt_embeds)

    def after_step(
        self, finished: list[EngineOutput], requests: Mapping[str, Request]
    ) -> list[EngineOutput]:
        """What the engine calls after each step's tokens while a parent is live:
        parents whose carrier was just prefilled get their samples forked
        (``fork_prefilled``); finished samples are gathered into their parent, returned
        once, when its last sample finishes (``gather``)."""
        if self.prefilling:
            self.fork_prefilled(requests)
        if self.parent_of:
            finished = self.gather(finished)
        return finished

    def fork_prefilled(self, requests: Mapping[str, Request]) -> None:
        """Forks the samples of every parent whose carrier's first token was just read.

        A carrier that is not running (still queued, preempted, or ended) or a fork the
        batch has no room for falls back to plain requests of the whole prompt, which
        still find the prompt's full blocks in the prefix cache.

        Args:
            requests: the scheduler's live requests by id.
        """
        for carrier_id, parent in list(self.prefilling.items()):
            req = requests.get(carrier_id)
            alive = req is not None and req.status == RequestStatus.RUNNING
            if alive and req.num_output_tokens < 1:
                continue  # still prefilling
            for sample_id, params in parent.samples:
                try:
                    if not alive:
                        raise ValueError("the carrier is not running")
                    self.fork(req, sample_id, parent.prompt_token_ids, None, params)
                except ValueError:
                    # A fallback sample arrives now: it joins the queue behind what came since.
                    self._queue(parent, sample_id, parent.prompt_token_ids, params, None)
            if self.is_live(carrier_id):
                self.abort(carrier_id)  # its output is the parent's business: dropped
            del self.prefilling[carrier_id]

    def gather(self, finished: list[EngineOutput]) -> list[EngineOutput]:
        """Keeps finished samples in their parents; a parent's output replaces its last one.

        A carrier's own output (it ended before its samples were forked) is dropped:
        ``fork_prefilled`` then queued the samples as plain requests.
        """
        out = []
        for o in finished:
            parent = self.parent_of.get(o.request_id)
            if parent is None:
                out.append(o)
            elif o.request_id != parent.carrier_id:
                parent.record(o)
                if parent.done:
                    out.append(self.release(parent))
        return out

    def abort_request(self, request_id: str) -> EngineOutput | None:
        """Engine.abort_request for the ids of live parents: a parent ends now
        (``abort_parent``) and its output is returned; None when no live parent uses
        ``request_id``.

        Raises:
            ValueError: ``request_id`` is a parent's carrier or sample (abort the parent).
        """
        parent = self.parents.get(request_id)
        if parent is not None:
            return self.abort_parent(parent)
        owner = self.parent_of.get(request_id)
        if owner is not None:
            raise ValueError(
                f"request_id={request_id!r} must name a live request, not a part of the "
                f"parallel-sampling request {owner.request_id!r} (abort that one)"
            )
        return None

    def abort_parent(self, parent: ParallelSampleRequest) -> EngineOutput:
        """Ends a parent now: its carrier and unfinished samples are aborted; its output
        keeps the samples that had finished."""
        carrier_id = parent.carrier_id
        if carrier_id is not None:
            self.prefilling.pop(carrier_id, None)
            if self.is_live(carrier_id):
                self.abort(carrier_id)
        for sample_id in parent.unfinished_sample_ids():
            if self.is_live(sample_id):
                parent.record(self.abort(sample_id))
        return self.release(parent)

    def release(self, parent: ParallelSampleRequest) -> EngineOutput:
        """Forgets a parent whose samples all ended; returns its output."""
        del self.parents[parent.request_id]
        for rid in parent.request_ids:
            del self.parent_of[rid]
        out = parent.output(time.time())
        prompt = self.prompt_logprobs.pop(parent.request_id, None)
        if prompt is not None:
            out.prompt_logprobs, out.prompt_logprob_ranks = prompt.output()
        return out
