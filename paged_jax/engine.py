"""Engine: requests in, finished outputs out; one scheduler step + one device step per call.

add_request -> Scheduler.schedule -> InputBatch.prepare -> Runner.dispatch
            -> Scheduler.update_from_output -> finished EngineOutputs

The engine also owns forks: ``fork_request`` starts a child on its parent's KV blocks,
and a request with ``SamplingParams.n > 1`` is a parent whose samples it forks after
one prefill (``paged_jax.parallel_sampling``). A step that raises is rolled back (see
``Engine.step``); one lock serialises the public calls of several threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import os
import statistics
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from paged_jax.config import EngineConfig
from paged_jax.core.block_pool import KVCacheBlock
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request, RequestStatus
from paged_jax.core.scheduler import Scheduler
from paged_jax.core.scheduler_output import SchedulerOutput
from paged_jax.distributed import LockstepGuard, num_processes, schedule_digest
from paged_jax.model_api import check_paged_model, model_kv_cache_groups
from paged_jax.outputs import EngineOutput, LogprobEntry, RankEntry, logprob_entry
from paged_jax.parallel_sampling import CARRIER_PARAMS, ParallelSampleRequest
from paged_jax.prompt_logprobs import PromptLogprobs
from paged_jax.sampling_params import SamplingParams
from paged_jax.spec_decode.proposer import (
    Proposal,
    ProposalBatch,
    ProposalSampling,
    Proposer,
    ProposerContext,
    build_proposer,
    check_proposal,
)
from paged_jax.structured_outputs import GrammarCompiler, Matcher
from paged_jax.worker.executable_cache import (
    ExecutableCache,
    WarmupReport,
    model_identity,
    program_context,
)
from paged_jax.worker.input_batch import InputBatch
from paged_jax.worker.runner import PendingStep, Runner
from paged_jax.worker.step_input import StepInput

__all__ = ["HOST_PHASES", "NONFINITE_LOGITS_ERROR", "Engine", "EngineOutput", "InFlightStep"]

_req_id_of = operator.attrgetter("req_id")
_samples_of = operator.attrgetter("samples")

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

# The parts of a step() call's host time that get_stats()["host_phase_time_ms"] reports.
HOST_PHASES = ("schedule", "prepare", "dispatch", "process_outputs")

# EngineOutput.error of a request whose logits held a NaN or an infinity.
NONFINITE_LOGITS_ERROR = (
    "the model's logits for this request are not finite (NaN or Inf): likely NaN/Inf "
    "weights in the checkpoint or a bad config value such as rms_norm_eps <= 0 or "
    "rope_theta <= 0"
)


def _serialised(method):
    """Runs an Engine method under the engine's lock: one thread inside at a time."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


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

    @classmethod
    def launch(
        cls,
        out: SchedulerOutput,
        live: dict[str, Request],
        pending: PendingStep,
        cached: list[KVCacheBlock] | None = None,
        prompt: list[tuple[PromptLogprobs, range]] | None = None,
    ) -> InFlightStep:
        requests = out.scheduled_requests
        if len(requests) != len(out.scheduled):  # an output built by hand
            requests = [live[seq.req_id] for seq in out.scheduled]
        return cls(out, requests, pending, cached or [], prompt or [])


@dataclasses.dataclass
class _ReqState:
    """The engine's side of one live request: sampling settings and what it returns.

    ``prompt`` collects the prompt logprobs this request computes (shared by a
    parallel-sampling parent's carrier and fallback samples); ``owns_prompt`` says its
    own output reports them (a plain request), not its parent's.
    """

    params: SamplingParams
    seed: int
    logprobs: list[LogprobEntry] | None
    logprob_ranks: list[RankEntry] | None = None
    first_token_time: float | None = None
    stop_reason: str | int | None = None
    prompt: PromptLogprobs | None = None
    owns_prompt: bool = False


class _StepTimes:
    """Host timings of the step() calls since the last reset, one value per call.

    ``wall`` and ``host`` (wall less the wait for device tokens) are perf_counter
    seconds; the phases are in the engine's ``phase_clock`` seconds. Arrays of doubles
    keep a long run's record compact.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.wall = array("d")
        self.host = array("d")
        self.phases = {name: array("d") for name in HOST_PHASES}

    def record(self, wall: float, wait: float, *phases: float) -> None:
        self.wall.append(wall)
        self.host.append(wall - wait)
        for name, seconds in zip(HOST_PHASES, phases):
            self.phases[name].append(seconds)

    def summary(self) -> dict[str, Any]:
        """Medians per step (ms), the host time's minimum and total (ms)."""

        def median_ms(values: array) -> float:
            return 1e3 * statistics.median(values) if values else 0.0

        host = self.host
        return {
            "step_time_ms": median_ms(self.wall),
            # Host work per step call: the call's wall time less the wait for device tokens.
            "host_time_ms": median_ms(host),
            "host_time_min_ms": 1e3 * min(host) if host else 0.0,
            "host_time_total_ms": 1e3 * sum(host),
            "host_phase_time_ms": {name: median_ms(v) for name, v in self.phases.items()},
        }


def lockstep_parts(out: SchedulerOutput) -> tuple:
    """What a step's schedule decides, for the processes' lockstep checksum."""
    return (
        out.scheduled,
        [row.req_id for row in out.new_rows],
        sorted(out.new_block_ids.items()),
        out.preempted_req_ids,
        out.block_copies,
    )


class Engine:
    """Continuous-batching engine over one model.

    Args:
        model: any object satisfying ``paged_jax.PagedModel`` (every paged_jax.models
            model does; see docs/research_integration.md for your own).
        config: engine settings; max_model_len None takes the model's.
        detokenize: optional token ids -> text function, needed for stop strings.
        owns_model: hand the model over: the runner frees its per-layer weights once it
            has stacked them for the scan over layers (EngineConfig.scan_layers), so they
            are not held twice; the model's layers cannot run afterwards. LLM passes True
            for the models it loads itself.
        executable_cache_dir: where warmup() saves its compiled programs and a later
            engine with the same key loads them (paged_jax.worker.executable_cache);
            None keeps them in memory. LLM passes <compile cache dir>/executables.
        tokenizer: the checkpoint's ``tokenizers.Tokenizer`` (or its tokenizer.json path),
            needed for requests with ``SamplingParams.structured_outputs``: their grammars
            compile against its vocabulary (one ``GrammarCompiler``, built on the first
            such request). LLM passes its own.

    Attributes:
        warmup_report: what warmup() built (programs compiled or loaded, seconds per
            phase; a ``WarmupReport``), None before it.
        phase_clock: the clock (seconds) the host phases of ``get_stats()
            ["host_phase_time_ms"]`` are timed with; ``time.perf_counter`` (wall) by
            default. A benchmark on a shared machine sets ``time.thread_time`` to count
            only the engine thread's CPU time.

    Threads: the calls that read or change requests (add_request, fork_request,
    abort_request, get_logprobs, step, warmup, get_stats, reset_peak_stats) hold one
    re-entrant lock, so calls from several threads run one at a time and never see
    half-updated state. Each step() returns the requests that finished in it to the
    thread that called it; ``paged_jax.LLM`` routes outputs to the call that added them.
    """

    def __init__(
        self,
        model: Any,
        config: EngineConfig | None = None,
        *,
        detokenize: Callable[[Sequence[int]], str] | None = None,
        owns_model: bool = False,
        executable_cache_dir: str | os.PathLike | None = None,
        tokenizer: Any = None,
    ):
        check_paged_model(model)
        config = config or EngineConfig()
        mcfg = model.config
        limit = int(mcfg.max_position_embeddings)
        if config.max_model_len is None:
            config = dataclasses.replace(config, max_model_len=limit)
        elif config.max_model_len > limit:
            raise ValueError(
                f"EngineConfig.max_model_len={config.max_model_len!r} must be <= the model's "
                f"max_position_embeddings={limit}"
            )
        # Speculative decoding: proposals for step t + 1 need step t's tokens on the host,
        # so steps run synchronously (async_scheduling=True gives the same outputs).
        self.async_scheduling_requested = config.async_scheduling
        if config.speculative_config is not None and config.async_scheduling:
            config = dataclasses.replace(config, async_scheduling=False)
        self.config = config
        self.model_config = mcfg
        self.vocab_size = int(mcfg.vocab_size)
        self.eos_token_ids = tuple(int(t) for t in (mcfg.eos_token_ids or ()))
        self.detokenize = detokenize
        self.phase_clock: Callable[[], float] = time.perf_counter
        self._lock = threading.RLock()
        groups = model_kv_cache_groups(model)
        # Read before the runner may take the model's layers over.
        self._model_identity = model_identity(model)
        self._model_name = type(model).__name__
        # A program built for several processes is not reloaded from disk: each
        # process compiles its own part of the job at warm-up.
        multiprocess = num_processes() > 1
        self._executable_cache_dir = None if multiprocess else executable_cache_dir
        # The processes of one engine compare their schedules before the steps run.
        self._lockstep = (
            LockstepGuard(config.lockstep_check_interval, every_step=config.validate)
            if multiprocess
            else None
        )
        self.warmup_report: WarmupReport | None = None
        self.proposer: Proposer | None = None
        if config.speculative_config is not None:
            context = ProposerContext(config, self.vocab_size, model, config.dtype)
            self.proposer = build_proposer(config.speculative_config, context)
        self.runner = Runner(
            model,
            config,
            owns_model=owns_model,
            extra_kv_bytes_per_block=(
                0 if self.proposer is None else self.proposer.kv_cache_bytes_per_block()
            ),
        )
        if self.proposer is not None:
            self.proposer.initialize(self.runner.num_kv_blocks)
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_kv_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            hash_algo=config.hash_algo,
            max_model_len=config.max_model_len,
            kv_cache_groups=groups,
        )
        self.scheduler = Scheduler(config, self.kv_cache_manager)
        # Start recording the blocks each schedule hashes (InFlightStep.cached).
        self.kv_cache_manager.take_newly_cached_blocks()
        self.input_batch = InputBatch(config, kv_cache_groups=groups)
        self._blocks_per_request_peak = 0
        # Requests whose block count may have grown since a decode step last measured it.
        self._peak_dirty: set[str] = set()
        self._seed_rng = np.random.default_rng(config.seed)
        self._states: dict[str, _ReqState] = {}
        # Per-step shortcuts over _states: live requests still waiting for their first
        # token, with stop strings, and how many want logprobs (0: the device step's
        # logprob outputs are never copied to the host).
        self._awaiting_first_token: set[str] = set()
        self._stop_string_ids: set[str] = set()
        self._num_logprobs_live = 0
        # Parallel sampling: live parents by id; every id a parent uses (its carrier and
        # samples) -> the parent; carriers whose samples are not forked yet.
        self._parents: dict[str, ParallelSampleRequest] = {}
        self._parent_of: dict[str, ParallelSampleRequest] = {}
        self._prefilling: dict[str, ParallelSampleRequest] = {}
        self._times = _StepTimes()
        self._in_flight: InFlightStep | None = None
        # Outputs of requests that ended in a step() that then raised: the next step()
        # returns them.
        self._undelivered: list[EngineOutput] = []
        self._synchronous = False
        self._num_steps = 0
        self._usage_peak = 0.0
        self._num_cached_tokens: dict[str, int] = {}
        # Live requests that compute prompt logprobs, and the parents asking for them.
        self._prompt_logprobs: dict[str, PromptLogprobs] = {}
        self._parent_prompt_logprobs: dict[str, PromptLogprobs] = {}
        # Compiles of the engine's own programs (Runner.num_compiles), not the process's.
        self._compiles_at_start = self._num_compiles()
        self._compiles_after_warmup: int | None = None
        # Structured outputs: the compiler (built on the first constrained request) and
        # the matcher of every live constrained request.
        self._tokenizer = tokenizer
        self._grammar_compiler: GrammarCompiler | None = None
        self._matchers: dict[str, Matcher] = {}
        # Speculative decoding: the step the proposer reads next, and the counters.
        k = config.num_speculative_tokens
        self._spec_k = k
        self._spec_num_drafts = 0  # sequence-steps that verified at least one draft
        self._spec_draft_tokens = 0
        self._spec_accepted_tokens = 0
        self._spec_drafted_at = np.zeros(k, np.int64)  # drafts proposed at position j
        self._spec_accepted_at = np.zeros(k, np.int64)  # ... and accepted there
        self._last_accepted: dict[str, int] = {}  # drafts each row accepted last step

    # ------------------------------------------------------------ requests
    @_serialised
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validates and queues one request; raises ValueError (and adds nothing) on bad input.

        With ``sampling_params.n > 1`` the request is a parallel-sampling parent: its
        prompt is prefilled once, its n samples (ids ``f"{request_id}_{j}"``) are forked
        from that prefill inside ``step()``, and it finishes as one EngineOutput whose
        ``samples`` hold theirs in index order. Sample j has seed ``(seed + j) % 2**32``
        when ``seed`` is set.

        With ``sampling_params.prompt_logprobs`` every prompt position runs through the
        model: the request never starts from cached blocks
        (``Request.skip_reading_prefix_cache``, as vLLM does; its own full blocks are
        cached for others). Its EngineOutput carries ``prompt_logprobs``. The model must have
        ``forward_paged_hidden`` and ``logits`` (``Runner.supports_prompt_logprobs``).
        """
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params={params!r} must be a SamplingParams")
        if self._id_taken(request_id):
            raise ValueError(f"request_id={request_id!r} must be unique among live requests")
        req = Request(
            request_id,
            prompt_token_ids,
            params,
            cache_salt=cache_salt,
            priority=priority,
            arrival_time=arrival_time,
        )
        bad = [t for t in req.prompt_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids contains {bad[0]!r}: token ids must be < vocab_size="
                f"{self.vocab_size}"
            )
        max_len = self.config.max_model_len
        if req.num_prompt_tokens >= max_len:
            raise ValueError(
                f"len(prompt_token_ids)={req.num_prompt_tokens} must be < max_model_len="
                f"{max_len} (room for at least one generated token)"
            )
        need = self.kv_cache_manager.max_blocks_per_request(
            req.num_prompt_tokens + 1, self.config.max_num_batched_tokens
        )
        if need > self.kv_cache_manager.num_usable_blocks:
            raise ValueError(
                f"len(prompt_token_ids)={req.num_prompt_tokens} needs {need} KV blocks but the "
                f"pool has {self.kv_cache_manager.num_usable_blocks}: raise num_kv_blocks"
            )
        prompt = None
        if params.prompt_logprobs is not None:
            if not self.runner.supports_prompt_logprobs:
                raise ValueError(
                    f"SamplingParams.prompt_logprobs={params.prompt_logprobs!r} needs a model "
                    f"with forward_paged_hidden and logits (every paged_jax.models model has "
                    f"them); {self._model_name} has not: pass prompt_logprobs=None"
                )
            req.skip_reading_prefix_cache = True
            prompt = PromptLogprobs(req.prompt_token_ids, params.prompt_logprobs)
        if params.structured_outputs is not None:
            self._new_matcher(params)  # a bad constraint raises here, naming its field
        if params.n > 1:
            self._add_parent(req, prompt)
            return
        self._register(request_id, params, prompt, owns_prompt=True)
        self.scheduler.add_request(req)

    @_serialised
    def fork_request(
        self,
        parent_id: str,
        child_id: str,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        output_token_ids: Sequence[int] | None = None,
        sampling_params: SamplingParams | None = None,
    ) -> None:
        """Starts ``child_id`` as a running request sharing ``parent_id``'s KV blocks.

        Call between steps. The child joins the batch at the next step with the
        tokens it shares with the parent already computed; the first write into a
        block the two still share is copied on write inside that step. The child's
        tokens are the parent's prompt and outputs unless given; the shared tokens
        (at most the parent's computed ones, and only a common prefix) are not
        recomputed. A different prompt (for example the full prompt when the parent
        prefilled all but its last token) makes the child a new request whose
        outputs start empty.

        Args:
            parent_id: a running request.
            child_id: a new, unique request id.
            prompt_token_ids: the child's prompt; default the parent's.
            output_token_ids: the child's outputs so far; default the parent's (or none
                with a new prompt).
            sampling_params: the child's; default the parent's.

        A child computes none of its prompt, so it reports no prompt logprobs whatever
        its SamplingParams.prompt_logprobs. A child with structured outputs starts its
        grammar over its output tokens (a refused one raises ValueError).

        Raises:
            ValueError: an unknown or not-running parent, a taken child id, token ids
                outside the vocabulary, a full batch (max_num_seqs), or a child that
                shares no computed token with the parent.
        """
        parent = self.scheduler.requests.get(parent_id)
        if parent is None:
            raise ValueError(f"parent_id={parent_id!r} must name a live request")
        if self._id_taken(child_id):
            raise ValueError(f"child_id={child_id!r} must be unique among live requests")
        self._fork(parent, child_id, prompt_token_ids, output_token_ids, sampling_params)

    @_serialised
    def get_logprobs(self, request_id: str) -> list[dict[int, float]] | None:
        """The live request's logprobs so far (one dict per sampled token), or None."""
        if request_id not in self._states:
            raise ValueError(f"request_id={request_id!r} must name a live request")
        return self._states[request_id].logprobs

    @_serialised
    def abort_request(self, request_id: str) -> EngineOutput:
        """Ends a live request now; its blocks go back to the pool.

        A parallel-sampling parent's carrier and unfinished samples are aborted with
        it; its output keeps the samples that had finished. Its samples cannot be
        aborted one by one.
        """
        if self._parents:
            parent = self._parents.get(request_id)
            if parent is not None:
                return self._abort_parent(parent)
            owner = self._parent_of.get(request_id)
            if owner is not None:
                raise ValueError(
                    f"request_id={request_id!r} must name a live request, not a part of the "
                    f"parallel-sampling request {owner.request_id!r} (abort that one)"
                )
        if request_id not in self._states:
            raise ValueError(f"request_id={request_id!r} must name a live request")
        return self._abort(request_id)

    def is_live(self, request_id: str) -> bool:
        """True while ``request_id`` names a request that has not finished.

        A parallel-sampling parent is live until its last sample finishes.
        """
        return request_id in self._states or request_id in self._parents

    def get_request(self, request_id: str) -> Request | None:
        """The scheduler's Request of a live request (status, tokens), or None.

        Read it, never change it: the scheduler owns its state.
        """
        return self.scheduler.requests.get(request_id)

    def has_unfinished(self) -> bool:
        """True while any request is waiting, running or swapped out, or an output of a
        step that raised is still to be returned."""
        return self.scheduler.has_unfinished() or bool(self._undelivered)

    @contextlib.contextmanager
    def synchronous(self) -> Iterator[None]:
        """Within the block every step() reads its own tokens before it returns.

        For callers whose next requests depend on this step's tokens (beam search
        forks from each step's candidates): with async scheduling a parent would run
        one token ahead of the forks. Enter it on an idle engine.
        """
        previous, self._synchronous = self._synchronous, True
        try:
            yield
        finally:
            self._synchronous = previous

    # ------------------------------------------------------------ request state
    def _id_taken(self, request_id: str) -> bool:
        """True when a live request (or a live parent, for one of its ids) holds the id."""
        if request_id in self._states:
            return True
        return bool(self._parents) and (
            request_id in self._parents or request_id in self._parent_of
        )

    def _grammars(self) -> GrammarCompiler:
        """The engine's GrammarCompiler, built on first use; ValueError without a tokenizer."""
        if self._grammar_compiler is None:
            if self._tokenizer is None:
                raise ValueError(
                    "SamplingParams.structured_outputs needs the checkpoint's tokenizer: "
                    "pass Engine(tokenizer=...) (LLM does when it has one)"
                )
            self._grammar_compiler = GrammarCompiler(
                self._tokenizer, eos_token_ids=self.eos_token_ids, vocab_size=self.vocab_size
            )
        return self._grammar_compiler

    def _new_matcher(self, params: SamplingParams, output_token_ids: Sequence[int] = ()) -> Matcher:
        """A matcher for params.structured_outputs past ``output_token_ids``.

        Raises:
            ValueError: the constraint does not compile (naming the field), or the grammar
                refuses one of the tokens.
        """
        matcher = self._grammars().matcher(params.structured_outputs)
        if output_token_ids and not matcher.replay(output_token_ids):
            raise ValueError(
                f"output_token_ids={list(output_token_ids)!r} must be allowed by "
                "SamplingParams.structured_outputs: its grammar refuses token "
                f"{int(output_token_ids[matcher.num_accepted])}"
            )
        return matcher

    def _register(
        self,
        request_id: str,
        params: SamplingParams,
        prompt: PromptLogprobs | None = None,
        *,
        owns_prompt: bool = False,
        matcher: Matcher | None = None,
    ) -> None:
        """Creates a request's engine state; ``prompt`` collects the prompt logprobs it
        computes (its own output reports them when ``owns_prompt``). A constrained request
        gets ``matcher`` or a new one at its grammar's start."""
        if params.structured_outputs is not None:
            self._matchers[request_id] = matcher or self._new_matcher(params)
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**32))
        wants = params.logprobs is not None
        self._states[request_id] = _ReqState(
            params,
            seed,
            [] if wants else None,
            [] if wants else None,
            prompt=prompt,
            owns_prompt=owns_prompt,
        )
        self._awaiting_first_token.add(request_id)
        if params.stop:
            self._stop_string_ids.add(request_id)
        if wants:
            self._num_logprobs_live += 1
        if prompt is not None:
            self._prompt_logprobs[request_id] = prompt

    def _unregister(self, request_id: str) -> _ReqState:
        """Drops a request's engine state (the inverse of _register)."""
        st = self._states.pop(request_id)
        self._matchers.pop(request_id, None)
        self._awaiting_first_token.discard(request_id)
        self._stop_string_ids.discard(request_id)
        self._prompt_logprobs.pop(request_id, None)
        if st.logprobs is not None:
            self._num_logprobs_live -= 1
        return st

    def _fork(
        self,
        parent: Request,
        child_id: str,
        prompt_token_ids: Sequence[int] | None,
        output_token_ids: Sequence[int] | None,
        sampling_params: SamplingParams | None,
    ) -> None:
        """fork_request once the parent is found and the child id is known to be free."""
        params = sampling_params if sampling_params is not None else parent.sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params={params!r} must be a SamplingParams")
        if prompt_token_ids is None:
            child = parent.fork(child_id, output_token_ids, sampling_params=params)
        else:
            child = Request(
                child_id,
                prompt_token_ids,
                params,
                cache_salt=parent.cache_salt,
                priority=parent.priority,
                arrival_time=parent.arrival_time,
            )
            if output_token_ids:
                child.append_output_token_ids(list(output_token_ids))
        bad = [t for t in child.all_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]!r} of child {child_id!r} must be < vocab_size={self.vocab_size}"
            )
        if child.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"child {child_id!r} has {child.num_tokens} tokens; must be <= max_model_len="
                f"{self.config.max_model_len}"
            )
        common = 0
        limit = min(parent.num_computed_tokens, child.num_tokens - 1)
        mine, theirs = parent.all_token_ids, child.all_token_ids
        if prompt_token_ids is None:
            common = parent.num_prompt_tokens  # same prompt: compare the outputs only
        while common < limit and mine[common] == theirs[common]:
            common += 1
        common = min(common, limit)
        if common <= 0:
            raise ValueError(
                f"child {child_id!r} must share at least one computed token with "
                f"{parent.request_id!r}"
            )
        matcher = None
        if params.structured_outputs is not None:
            source = self._matchers.get(parent.request_id)
            same = (
                source is not None
                and parent.sampling_params.structured_outputs == params.structured_outputs
                and source.accepted_token_ids == tuple(child.output_token_ids)
            )
            # A copy of the parent's state when it is the child's, else a replay.
            matcher = source.copy() if same else self._new_matcher(params, child.output_token_ids)
        self._register(child_id, params, matcher=matcher)
        try:
            self.scheduler.fork_request(parent.request_id, child, num_tokens=common)
        except ValueError:
            self._unregister(child_id)
            raise

    def _abort(self, request_id: str) -> EngineOutput:
        req = self.scheduler.requests[request_id]
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return self._finish(req)

    # ------------------------------------------------------------ parallel sampling
    def _add_parent(self, req: Request, prompt: PromptLogprobs | None) -> None:
        """Queues an n > 1 request (validated as ``req``): its carrier, or its samples.

        ``prompt`` collects the parent's prompt logprobs, computed by its carrier (or by
        samples that fell back to plain requests before the carrier finished them).
        """
        parent = ParallelSampleRequest(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
        )
        for rid in parent.request_ids:
            if self._id_taken(rid):
                raise ValueError(
                    f"request_id={req.request_id!r} must leave {rid!r} free for its "
                    "samples; a live request holds it"
                )
        self._parents[parent.request_id] = parent
        for rid in parent.request_ids:
            self._parent_of[rid] = parent
        if prompt is not None:
            self._parent_prompt_logprobs[parent.request_id] = prompt
        if parent.carrier_id is None:  # a one-token prompt has nothing to prefill first
            for sample_id, params in parent.samples:
                self._add_part(parent, sample_id, parent.prompt_token_ids, params, req.arrival_time)
        else:
            self._add_part(
                parent, parent.carrier_id, parent.carrier_prompt, CARRIER_PARAMS, req.arrival_time
            )
            self._prefilling[parent.carrier_id] = parent

    def _add_part(
        self,
        parent: ParallelSampleRequest,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None,
    ) -> None:
        """Queues a parent's carrier or one of its samples as a plain request (computing
        the parent's prompt logprobs while they are incomplete)."""
        prompt = self._parent_prompt_logprobs.get(parent.request_id)
        computes = prompt is not None and not prompt.complete
        self._register(request_id, params, prompt if computes else None)
        self.scheduler.add_request(
            Request(
                request_id,
                prompt_token_ids,
                params,
                cache_salt=parent.cache_salt,
                priority=parent.priority,
                arrival_time=arrival_time,
                skip_reading_prefix_cache=computes,
            )
        )

    def _fork_prefilled_samples(self) -> None:
        """Forks the samples of every parent whose carrier's first token was just read.

        A carrier that is not running (still queued, preempted, or ended) or a fork the
        batch has no room for falls back to plain requests of the whole prompt, which
        still find the prompt's full blocks in the prefix cache.
        """
        for carrier_id, parent in list(self._prefilling.items()):
            req = self.scheduler.requests.get(carrier_id)
            alive = req is not None and req.status == RequestStatus.RUNNING
            if alive and req.num_output_tokens < 1:
                continue  # still prefilling
            for sample_id, params in parent.samples:
                try:
                    if not alive:
                        raise ValueError("the carrier is not running")
                    self._fork(req, sample_id, parent.prompt_token_ids, None, params)
                except ValueError:
                    # A fallback sample arrives now: it joins the queue behind what came since.
                    self._add_part(parent, sample_id, parent.prompt_token_ids, params, None)
            if carrier_id in self._states:
                self._abort(carrier_id)  # its output is the parent's business: dropped
            del self._prefilling[carrier_id]

    def _gather_samples(self, finished: list[EngineOutput]) -> list[EngineOutput]:
        """Keeps finished samples in their parents; a parent's output replaces its last one.

        A carrier's own output (it ended before its samples were forked) is dropped:
        ``_fork_prefilled_samples`` then queued the samples as plain requests.
        """
        out = []
        for o in finished:
            parent = self._parent_of.get(o.request_id)
            if parent is None:
                out.append(o)
            elif o.request_id != parent.carrier_id:
                parent.record(o)
                if parent.done:
                    out.append(self._release_parent(parent))
        return out

    def _abort_parent(self, parent: ParallelSampleRequest) -> EngineOutput:
        carrier_id = parent.carrier_id
        if carrier_id is not None:
            self._prefilling.pop(carrier_id, None)
            if carrier_id in self._states:
                self._abort(carrier_id)
        for sample_id in parent.unfinished_sample_ids():
            if sample_id in self._states:
                parent.record(self._abort(sample_id))
        return self._release_parent(parent)

    def _release_parent(self, parent: ParallelSampleRequest) -> EngineOutput:
        """Forgets a parent whose samples all ended; returns its output."""
        del self._parents[parent.request_id]
        for rid in parent.request_ids:
            del self._parent_of[rid]
        out = parent.output(time.time())
        prompt = self._parent_prompt_logprobs.pop(parent.request_id, None)
        if prompt is not None:
            out.prompt_logprobs, out.prompt_logprob_ranks = prompt.output()
        return out

    # ------------------------------------------------------------ step
    @_serialised
    def step(self) -> list[EngineOutput]:
        """Runs one scheduler + device step; returns the requests that finished.

        With async_scheduling the step just scheduled is left running on device and
        the previous step's tokens are read instead (stops, outputs, hashing land one
        call later); otherwise the step's own tokens are read before returning. Then
        parallel-sampling parents whose prompt was just prefilled get their samples
        forked, and a parent is returned once, when its last sample finishes.

        A step that raises (any exception, KeyboardInterrupt included, from packing
        the inputs, dispatching the device step, reading its tokens or applying them)
        is rolled back before the exception propagates: the steps not read yet are
        dropped, every running request returns to the head of the waiting queue with
        its tokens so far and recomputes its KV when it resumes (as after a recompute
        preemption; outputs equal a run without the failure), the blocks those steps
        were to write lose their prefix-cache hashes (the whole prefix cache is
        forgotten when the device state was lost), and outputs of requests that had
        already ended come back from the next step(). A request whose logits are not
        finite ends with finish_reason "error" (NONFINITE_LOGITS_ERROR); the others
        continue.

        Structured outputs: while a constrained request is live every step reads its own
        tokens (a constrained row's mask needs its previous token), so outputs equal the
        synchronous engine's; a step() that finds an async step in flight then only reads
        that one.
        """
        if self._matchers and self._in_flight is not None:
            return self._read_in_flight()
        t0 = time.perf_counter()
        clock = self.phase_clock
        sched = self.scheduler
        c0 = clock()
        out = sched.schedule()
        schedule_s = clock() - c0
        cached = self.kv_cache_manager.take_newly_cached_blocks()
        # Requests the scheduler ended on its own (they can never fit) report their error.
        finished = [self._finish(req) for req in out.errored]
        if self._undelivered:
            finished[:0] = self._undelivered
            self._undelivered = []
        previous = self._in_flight
        launched = None
        prepare_s = dispatch_s = 0.0
        try:
            guard = self._lockstep
            if guard is not None and guard.due(self._num_steps, bool(out.new_rows)):
                guard.check(self._num_steps, schedule_digest(lockstep_parts(out)))
            self._apply_to_device_state(out)
            self._usage_peak = max(self._usage_peak, self.kv_cache_manager.usage)
            assert out.scheduled or not out.block_copies, "a block copied for nothing scheduled"
            if out.scheduled:
                self._record_blocks_per_request(out)
                c0 = clock()
                batch = self.input_batch
                for req_id, drafts in out.spec_token_ids.items():
                    batch.set_draft_tokens(req_id, drafts)
                step = batch.prepare(out.scheduled, out.block_copies, out.spec_token_ids)
                if self._matchers:
                    step = self._with_grammar_bitmask(step, out)
                rows = targets = prompt = None
                if self._prompt_logprobs:  # nothing to do for the steps of other requests
                    rows, targets, prompt = self._prompt_rows(out.scheduled)
                c1 = clock()
                pending = self.runner.dispatch(
                    step,
                    with_logprobs=self._num_logprobs_live > 0,
                    prompt_rows=rows,
                    prompt_targets=targets,
                )
                c2 = clock()
                prepare_s, dispatch_s = c1 - c0, c2 - c1
                launched = InFlightStep.launch(out, sched.requests, pending, cached, prompt)
                self._num_steps += 1
            ready = launched
            if self.config.async_scheduling and not self._synchronous and not self._matchers:
                ready, self._in_flight = previous, launched
            wait_s = process_s = 0.0
            if ready is not None:
                t_wait = time.perf_counter()
                result = ready.pending.result()
                wait_s = time.perf_counter() - t_wait
                c0 = clock()
                finished += self._process_outputs(ready, result)
                if self.proposer is not None:
                    self._propose(step)
                process_s = clock() - c0
        except BaseException:
            self.scheduler.spec_token_ids = {}
            self._roll_back(out, cached, previous, finished)
            raise
        if self._prefilling:
            self._fork_prefilled_samples()
        if self._parent_of:
            finished = self._gather_samples(finished)
        step_s = time.perf_counter() - t0
        if launched is not None or ready is not None:
            self._times.record(step_s, wait_s, schedule_s, prepare_s, dispatch_s, process_s)
        return finished

    def _read_in_flight(self) -> list[EngineOutput]:
        """step() without scheduling: reads the async step in flight (see step())."""
        finished, self._undelivered = self._undelivered, []
        previous, self._in_flight = self._in_flight, None
        try:
            finished += self._process_outputs(previous, previous.pending.result())
        except BaseException:
            self._roll_back(SchedulerOutput(), [], previous, finished)
            raise
        if self._prefilling:
            self._fork_prefilled_samples()
        if self._parent_of:
            finished = self._gather_samples(finished)
        return finished

    def _propose(self, step: StepInput) -> None:
        """Asks the proposer for the drafts the next step verifies (after this step's
        tokens are applied): every running request with exactly one token to compute
        and an input-batch row, constrained requests (structured outputs) excepted."""
        sched = self.scheduler
        if sched.trimmed_req_ids:  # rejected drafts' blocks went back: shorten the rows
            batch = self.input_batch
            for req_id in sched.trimmed_req_ids:
                if req_id in batch.row_of:
                    ids = self.kv_cache_manager.get_block_ids_per_group(req_id)
                    batch.truncate_block_ids(req_id, [len(g) for g in ids])
            sched.trimmed_req_ids = []
        row_of = self.input_batch.row_of
        reqs = [
            r
            for r in sched.running
            if r.num_tokens - r.num_computed_tokens == 1
            and r.request_id in row_of
            and r.request_id not in self._matchers
        ]
        # Called with no proposing request too: a draft model still writes its KV for
        # the step's tokens (prefill chunks), or its later proposals miss them.
        batch = self.input_batch
        rows = np.fromiter((row_of[r.request_id] for r in reqs), np.int32, len(reqs))
        proposal_batch = ProposalBatch(
            step_input=step,
            req_ids=[r.request_id for r in reqs],
            rows=rows,
            token_ids=[r.all_token_ids for r in reqs],
            next_token_ids=np.array([r.all_token_ids[-1] for r in reqs], np.int32),
            next_positions=np.array([r.num_tokens - 1 for r in reqs], np.int32),
            num_accepted=np.array(
                [self._last_accepted.get(r.request_id, 0) for r in reqs], np.int32
            ),
            block_ids=[self.kv_cache_manager.get_block_ids_per_group(r) for r in reqs],
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
        check_proposal(proposal, len(reqs), self._spec_k)
        if proposal.draft_probs is not None:
            self.runner.draft_probs = proposal.draft_probs
        counts = proposal.num_tokens.tolist()
        ids = proposal.token_ids.tolist()
        sched.spec_token_ids = {
            r.request_id: ids[i][: counts[i]] for i, r in enumerate(reqs) if counts[i]
        }

    def _with_grammar_bitmask(self, step: StepInput, out: SchedulerOutput) -> StepInput:
        """The step with its constrained rows' allowed-token bitmask (unchanged when no row
        that samples is constrained: the runner then passes its resident all-ones one)."""
        matchers = self._matchers
        rows = [matchers.get(seq.req_id) if seq.samples else None for seq in out.scheduled]
        if not any(rows):
            return step
        words = np.empty((step.bucket[1], self.runner.bitmask_width), np.int32)
        self._grammars().fill_bitmasks(rows, words)
        return dataclasses.replace(step, sampling=step.sampling._replace(bitmask=words))

    def _roll_back(
        self,
        out: SchedulerOutput,
        cached: list[KVCacheBlock],
        previous: InFlightStep | None,
        finished: list[EngineOutput],
    ) -> None:
        """Makes the engine consistent after a step() that raised (see step()).

        The steps not read yet are the one just scheduled (``out``, whose schedule
        hashed ``cached``) and, with async scheduling, ``previous``, the one in flight
        before it. Outputs already built (``finished``) wait for the next step().
        """
        sched = self.scheduler
        live = sched.requests
        self._in_flight = None
        touched = out.scheduled_requests or [
            live[seq.req_id] for seq in out.scheduled if seq.req_id in live
        ]
        touched = list(touched)
        unconfirmed = list(cached)
        if previous is not None:
            touched += previous.requests
            unconfirmed += previous.cached
        # A request swapped out by this schedule may have no (or a partial) host copy.
        touched += [live[rid] for rid, _ in out.swap_out if rid in live]
        for rid in sched.roll_back(touched):
            self.runner.drop_swapped(rid)
        for req in touched:  # a grammar past tokens that were dropped starts over
            m = self._matchers.get(req.request_id)
            if m is not None and m.accepted_token_ids != tuple(req.output_token_ids):
                m.replay(req.output_token_ids)
        for req in touched:  # ended while its tokens were applied, not reported yet
            rid = req.request_id
            if req.is_finished() and rid in self._states and live.get(rid) is not req:
                finished.append(self._finish(req))
        batch = self.input_batch
        for rid in list(batch.row_of):  # nothing runs now: every row goes
            batch.remove_request(rid)
        kv = self.kv_cache_manager
        if self.runner.replace_lost_device_state():
            reset = kv.reset_prefix_cache()
            assert reset, "a block is still held after every running request was rolled back"
        else:
            kv.uncache_blocks(unconfirmed)
        self._undelivered.extend(finished)

    def _prompt_rows(
        self, seqs: Sequence[Any]
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[PromptLogprobs, range]]]:
        """The step's token rows whose logprobs some PromptLogprobs still lacks.

        Returns (rows i32[N] in the packed step, the prompt token each is scored at
        i32[N], per PromptLogprobs its positions in row order). Rows are packed in
        scheduling order (InputBatch.prepare); positions already recorded are skipped.
        """
        rows: list[int] = []
        targets: list[int] = []
        parts = []
        start = 0
        recorders = self._prompt_logprobs
        for seq in seqs:
            prompt = recorders.get(seq.req_id)
            if prompt is not None:
                first = seq.num_computed_tokens
                wanted = prompt.wanted(max(first, len(prompt.logprobs)), first + seq.num_new_tokens)
                if wanted:
                    rows.extend(range(start + wanted.start - first, start + wanted.stop - first))
                    targets.extend(prompt.prompt_token_ids[wanted.start + 1 : wanted.stop + 1])
                    parts.append((prompt, wanted))
            start += seq.num_new_tokens
        return np.asarray(rows, np.int32), np.asarray(targets, np.int32), parts

    def _record_prompt_logprobs(self, step: InFlightStep, result) -> None:
        """Files a read step's prompt logprobs with the PromptLogprobs they belong to.

        Kept even when the request has ended meanwhile: the values are the model's for
        those positions, and a parallel-sampling parent's fallback samples may resume
        from blocks its aborted carrier computed.
        """
        values = result.prompt_logprobs
        i = 0
        for prompt, positions in step.prompt:
            j = i + len(positions)
            prompt.add(
                positions,
                values.logprobs[i:j],
                values.ranks[i:j],
                values.top_token_ids[i:j],
                values.top_logprobs[i:j],
            )
            i = j

    def _process_outputs(self, step: InFlightStep, result) -> list[EngineOutput]:
        """Append one finished device step's tokens; stops; returns the finished requests."""
        if step.prompt:  # before a request that finishes in this step reports them
            self._record_prompt_logprobs(step, result)
        sched = self.scheduler
        spec = result.num_emitted is not None
        if spec:
            sampled, broken = self._record_spec_samples(step, result)
            string_stops = self._spec_string_stops(sampled)
        else:
            sampled, broken = self._record_samples(step, result)
        refused, grammar_done = self._accept_constrained(sampled) if self._matchers else ((), ())
        done = sched.update_from_output(step.out, sampled, self.eos_token_ids)
        live = sampled
        if done:
            done_ids = set()
            for req in done:
                done_ids.add(req.request_id)
                st = self._states[req.request_id]
                token = sampled[req.request_id]
                if spec:  # the last token appended is the one that stopped it
                    token = req.output_token_ids[-1]
                    if st.logprobs is not None:  # drop entries of tokens after the stop
                        del st.logprobs[req.num_output_tokens :]
                        del st.logprob_ranks[req.num_output_tokens :]
                if (
                    req.status == RequestStatus.FINISHED_STOPPED
                    and token in st.params.stop_token_ids
                ):
                    st.stop_reason = token
            live = {k: v for k, v in sampled.items() if k not in done_ids}
        if spec:
            for req_id, stop in string_stops.items():
                if req_id in live:
                    req = sched.requests[req_id]
                    sched.finish_request(req_id, RequestStatus.FINISHED_STOPPED)
                    self._states[req_id].stop_reason = stop
                    live.pop(req_id)
                    done.append(req)
        for req in broken:  # its token is garbage: it ends here, the others go on
            if req.is_finished():  # a stop among its kept speculative tokens came first
                continue
            sched.finish_request(
                req.request_id, RequestStatus.FINISHED_ERROR, NONFINITE_LOGITS_ERROR
            )
            done.append(req)
        for req, token in refused:
            message = GRAMMAR_REFUSED_ERROR.format(token=token)
            sched.finish_request(req.request_id, RequestStatus.FINISHED_ERROR, message)
            done.append(req)
        for req_id in grammar_done:  # EOS ended the grammar under ignore_eos: a stop
            req = sched.requests.get(req_id)
            if req is not None and not req.is_finished():
                sched.finish_request(req_id, RequestStatus.FINISHED_STOPPED)
                live.pop(req_id, None)
                done.append(req)
        batch = self.input_batch
        row_of = batch.row_of
        if spec:
            for req_id, tokens in live.items():
                if req_id in row_of:
                    batch.append_token_ids(req_id, tokens)
            live = {}
        rows = list(map(row_of.get, live))
        tokens = list(live.values())
        if None in rows:  # a request preempted meanwhile has no row
            keep = [i for i, row in enumerate(rows) if row is not None]
            rows = [rows[i] for i in keep]
            tokens = [tokens[i] for i in keep]
        stop_ids = self._stop_string_ids
        if stop_ids and self.detokenize is not None:
            for req_id in live:
                if req_id not in stop_ids:
                    continue
                stop = self._stop_string_hit(req_id)
                if stop is not None:
                    req = sched.requests[req_id]
                    sched.finish_request(req_id, RequestStatus.FINISHED_STOPPED)
                    self._states[req_id].stop_reason = stop
                    done.append(req)
        batch.append_sampled(rows, tokens)
        finished = []
        for req in done:
            if req.request_id in row_of:
                batch.remove_request(req.request_id)
            finished.append(self._finish(req))
        return finished

    def _accept_constrained(
        self, sampled: dict[str, int]
    ) -> tuple[list[tuple[Request, int]], list[str]]:
        """Advances each constrained request's matcher past its sampled token.

        A refused token is taken out of ``sampled`` and its request returned (it ends
        with an error); also returns the requests whose grammar EOS ended though they
        ignore EOS.
        """
        refused, ended = [], []
        eos = self.eos_token_ids
        requests = self.scheduler.requests
        for req_id, token in list(sampled.items()):
            matcher = self._matchers.get(req_id)
            if matcher is None:
                continue
            if type(token) is list:  # speculative engine: a constrained row has no drafts
                token = token[0]
            if not matcher.accept(token):
                del sampled[req_id]
                refused.append((requests[req_id], token))
            elif token in eos and self._states[req_id].params.ignore_eos:
                ended.append(req_id)
        return refused, ended

    # ------------------------------------------------------------ helpers
    def _apply_to_device_state(self, out) -> None:
        """Mirror a SchedulerOutput into the input batch rows and the KV swap space.

        Order matters: rows of removed requests go first, swap-outs read their blocks
        before anything can reuse them, and swap-ins fill fresh blocks before the step.
        """
        batch = self.input_batch
        for req_id in out.removed_req_ids:
            if req_id in batch.row_of:
                batch.remove_request(req_id)
        for req_id, block_ids in out.swap_out:
            self.runner.swap_out(req_id, block_ids)
        for row in out.new_rows:
            st = self._states[row.req_id]
            # The first admission's hit counts (a resume's hits are mostly its own blocks;
            # a rolled-back request resumes unpreempted but keeps its first count).
            cached = self._num_cached_tokens
            if (
                row.req_id not in cached
                and self.scheduler.requests[row.req_id].num_preemptions == 0
            ):
                cached[row.req_id] = row.num_computed_tokens
            batch.add_request(
                row.req_id,
                row.token_ids,
                row.block_ids,
                st.params,
                st.seed,
                min_tokens_stop_ids=self._min_tokens_stop_ids(st.params),
            )
        if out.new_block_ids:
            batch.append_new_block_ids(out.new_block_ids)
        for req_id, updates in out.replaced_block_ids.items():
            batch.replace_block_ids(req_id, updates)
        for req_id, block_ids in out.swap_in:
            self.runner.swap_in(req_id, block_ids)

    def _record_samples(self, step: InFlightStep, result) -> tuple[dict[str, int], list[Request]]:
        """req_id -> sampled token for sequences that reached their end; logprobs, TTFT.

        Also returns the live requests whose logits were not finite (none sampled).
        """
        live_get = self.scheduler.requests.get
        token_ids = result.token_ids.tolist()
        # A prefill chunk that does not reach the end samples nothing (seq.samples is
        # False); a request that ended while this step was in flight (async) drops its
        # extra token, even if a new request reuses its id.
        seqs = step.out.scheduled
        req_ids = list(map(_req_id_of, seqs))
        if all(map(_samples_of, seqs)) and all(
            map(operator.is_, map(live_get, req_ids), step.requests)
        ):  # the usual decode step, checked and built without a Python-level loop
            sampled = dict(zip(req_ids, token_ids))
        else:
            sampled = {
                req_id: token
                for req_id, seq, req, token in zip(req_ids, seqs, step.requests, token_ids)
                if seq.samples and live_get(req_id) is req
            }
        broken = []
        nonfinite = result.nonfinite
        if nonfinite is not None and nonfinite.any():
            for i in np.flatnonzero(nonfinite).tolist():
                req = step.requests[i]
                if live_get(req.request_id) is req:
                    broken.append(req)
                    sampled.pop(req.request_id, None)
        if self._awaiting_first_token:
            self._stamp_first_tokens(sampled)
        if self._num_logprobs_live:
            for i, seq in enumerate(step.out.scheduled):
                if seq.req_id not in sampled or live_get(seq.req_id) is not step.requests[i]:
                    continue
                st = self._states[seq.req_id]
                if st.logprobs is None:
                    continue
                k = st.params.logprobs
                entry, ranks = logprob_entry(
                    token_ids[i],
                    float(result.logprobs[i]),
                    int(result.ranks[i]),
                    result.top_token_ids[i, :k].tolist(),
                    result.top_logprobs[i, :k].tolist(),
                )
                st.logprobs.append(entry)
                st.logprob_ranks.append(ranks)
        return sampled, broken

    def _record_spec_samples(
        self, step: InFlightStep, result
    ) -> tuple[dict[str, list[int]], list[Request]]:
        """_record_samples for a speculative step: req_id -> its emitted tokens (accepted
        drafts, then the target's), their logprobs, and the acceptance counters.

        A request with a non-finite position among its emitted ones keeps the tokens
        emitted before the first such position (each was decided by finite logits at an
        earlier position, so the plain engine emits them too) and is returned as broken:
        it ends with an error unless those tokens stop it first.
        """
        live_get = self.scheduler.requests.get
        spec_ids = step.out.spec_token_ids
        emitted = result.num_emitted.tolist()
        token_ids = result.token_ids
        nonfinite = result.nonfinite
        sampled: dict[str, list[int]] = {}
        broken = []
        self._last_accepted = {}
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
                self._spec_num_drafts += 1
                self._spec_draft_tokens += num_draft
                self._spec_accepted_tokens += accepted
                self._spec_drafted_at[:num_draft] += 1
                self._spec_accepted_at[:accepted] += 1
                self._last_accepted[seq.req_id] = accepted
            sampled[seq.req_id] = token_ids[i, :e].tolist()
        if self._awaiting_first_token:
            self._stamp_first_tokens(sampled)
        if self._num_logprobs_live:
            for i, seq in enumerate(step.out.scheduled):
                tokens = sampled.get(seq.req_id)
                st = self._states.get(seq.req_id)
                if tokens is None or st is None or st.logprobs is None:
                    continue
                k = st.params.logprobs
                for j, token in enumerate(tokens):
                    entry, ranks = logprob_entry(
                        token,
                        float(result.logprobs[i, j]),
                        int(result.ranks[i, j]),
                        result.top_token_ids[i, j, :k].tolist(),
                        result.top_logprobs[i, j, :k].tolist(),
                    )
                    st.logprobs.append(entry)
                    st.logprob_ranks.append(ranks)
        return sampled, broken

    def _spec_string_stops(self, sampled: dict[str, list[int]]) -> dict[str, str]:
        """Cuts each emitted list after the token that completes a stop string (in place);
        returns req_id -> that stop string."""
        stops = {}
        if not self._stop_string_ids or self.detokenize is None:
            return stops
        requests = self.scheduler.requests
        for req_id, tokens in sampled.items():
            if req_id not in self._stop_string_ids:
                continue
            st = self._states[req_id]
            req = requests[req_id]
            tail = max(map(len, st.params.stop)) + 8
            for j in range(len(tokens)):
                if req.num_output_tokens + j + 1 < st.params.min_tokens:
                    continue
                text = self.detokenize((req.output_token_ids + tokens[: j + 1])[-tail:])
                stop = next((x for x in st.params.stop if x in text), None)
                if stop is not None:
                    del tokens[j + 1 :]
                    stops[req_id] = stop
                    break
        return stops

    def _stamp_first_tokens(self, sampled: dict[str, Any]) -> None:
        """Sets first_token_time of the requests in ``sampled`` that had no token yet."""
        awaiting = self._awaiting_first_token
        first = awaiting.intersection(sampled)
        if first:
            now = time.time()
            for req_id in first:
                self._states[req_id].first_token_time = now
            awaiting -= first

    def _record_blocks_per_request(self, out) -> None:
        """Peak real blocks held by one request in a decode step (one generated token in).

        A request's count only grows when it gets blocks (a new row, appended blocks),
        so only those requests are measured, at their next decode step.
        """
        dirty = self._peak_dirty
        for row in out.new_rows:
            dirty.add(row.req_id)
        dirty.update(out.new_block_ids)
        if not dirty:
            return
        kv = self.kv_cache_manager
        seqs = out.scheduled
        requests = out.scheduled_requests
        if len(requests) != len(seqs):
            live = self.scheduler.requests
            requests = [live[seq.req_id] for seq in seqs]
        index = dict(zip(map(_req_id_of, seqs), range(len(seqs))))
        live = self.scheduler.requests
        for req_id in list(dirty):
            if req_id not in live:
                dirty.discard(req_id)  # finished (a reused id is a new row again)
                continue
            i = index.get(req_id)
            if i is None:
                continue
            seq = seqs[i]
            if seq.num_new_tokens == 1 and seq.num_computed_tokens >= requests[i].num_prompt_tokens:
                dirty.discard(req_id)
                held = kv.get_num_blocks_held(req_id)
                if held > self._blocks_per_request_peak:
                    self._blocks_per_request_peak = held

    def _min_tokens_stop_ids(self, params: SamplingParams) -> list[int]:
        if params.min_tokens == 0:
            return []
        return list(dict.fromkeys([*params.stop_token_ids, *self.eos_token_ids]))

    def _stop_string_hit(self, req_id: str) -> str | None:
        """The stop string that the request's output text now contains, if any."""
        st = self._states[req_id]
        if not st.params.stop or self.detokenize is None:
            return None
        req = self.scheduler.requests[req_id]
        if req.num_output_tokens < st.params.min_tokens:
            return None
        # Only the tail can hold a new match: the longest stop string plus a few tokens.
        tail = max(map(len, st.params.stop)) + 8
        text = self.detokenize(req.output_token_ids[-tail:])
        return next((s for s in st.params.stop if s in text), None)

    def _finish(self, req: Request) -> EngineOutput:
        st = self._unregister(req.request_id)
        self.runner.drop_swapped(req.request_id)
        prompt = ranks = None
        if st.owns_prompt and st.prompt is not None:
            prompt, ranks = st.prompt.output()
        return EngineOutput(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            token_ids=list(req.output_token_ids),
            finish_reason=FINISH_REASONS[req.status],
            stop_reason=st.stop_reason,
            error=self.scheduler.errors.pop(req.request_id, None),
            logprobs=st.logprobs,
            arrival_time=req.arrival_time,
            first_token_time=st.first_token_time,
            finish_time=time.time(),
            num_cached_tokens=self._num_cached_tokens.pop(req.request_id, 0),
            num_preemptions=req.num_preemptions,
            logprob_ranks=st.logprob_ranks,
            prompt_logprobs=prompt,
            prompt_logprob_ranks=ranks,
        )

    # ------------------------------------------------------------ warmup + stats
    @_serialised
    def warmup(self, on_program: Callable[[int, int, str, str], None] | None = None) -> int:
        """Builds every step program serving can call; returns how many it built.

        One program per token bucket (EngineConfig.step_shapes), a decode-only one for
        each bucket decode steps reach, and the block copy: each loaded
        from the executable cache when it holds it, else compiled (and saved there).
        Afterwards no step compiles. ``warmup_report`` says what was done and how long
        each phase took.

        on_program: optional progress callback (i, num_programs, name, action), action
            "loading" or "compiling".
        """
        shapes = self.config.step_shapes()
        steps = [self.input_batch.dummy_step_input(t, s) for t, s in shapes]
        context = program_context(self._model_identity, self.config, self.runner.num_kv_blocks)
        cache = ExecutableCache(self._executable_cache_dir, context)
        self.warmup_report = self.runner.warmup(steps, on_program, cache=cache)
        if self._lockstep is not None:
            self._lockstep.warmup()
        if self.proposer is not None:
            self.proposer.warmup()
        self._compiles_after_warmup = self._num_compiles()
        return len(self.warmup_report.programs)

    def _num_compiles(self) -> int:
        """Backend compiles of the engine's own programs: the runner's and the proposer's."""
        extra = 0 if self.proposer is None else self.proposer.num_compiles
        return self.runner.num_compiles + extra

    @_serialised
    def reset_peak_stats(self) -> None:
        """Starts the peaks of get_stats() again from now (KV usage, blocks per request)."""
        self._usage_peak = self.kv_cache_manager.usage
        self._blocks_per_request_peak = 0
        self._peak_dirty.update(self.scheduler.requests)  # measured at their next decode

    def reset_step_times(self) -> None:
        """Forgets the step timings, so get_stats()' times cover the steps from now on."""
        self._times.reset()

    @_serialised
    def get_stats(self) -> dict[str, Any]:
        """Counters since construction and step times since the last reset_step_times().

        Counters: steps, preemptions, prefix-cache hits, KV usage (now and peak,
        fractions of usable blocks), compiles of the engine's own programs (total and
        after warm-up; compiles of other code in the process, a user's jnp calls among
        them, never count), running and waiting requests. Times per step() call that ran or read a device step, in ms:
        ``step_time_ms`` (median wall time), ``host_time_ms`` (median wall time less
        the wait for device tokens), ``host_time_min_ms``, ``host_time_total_ms``, and
        ``host_phase_time_ms``: the median of each of HOST_PHASES (scheduler,
        input packing, the jitted call's dispatch, reading outputs) in
        ``phase_clock`` time.
        """
        stats = self.kv_cache_manager.prefix_cache_stats
        compiles = self._num_compiles()
        total = compiles - self._compiles_at_start
        after = (
            None if self._compiles_after_warmup is None else compiles - self._compiles_after_warmup
        )
        return {
            "num_steps": self._num_steps,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": stats.queries,
            "prefix_cache_hits": stats.hits,
            "prefix_cache_hit_rate": stats.hit_rate,
            "kv_cache_usage": self.kv_cache_manager.usage,
            "kv_cache_usage_peak": self._usage_peak,
            # Most KV blocks (all groups, nulls excluded) one request held in a decode step.
            "kv_blocks_per_request_peak": self._blocks_per_request_peak,
            "num_kv_blocks": self.runner.num_kv_blocks,
            "num_compiles": total,
            "num_compiles_after_warmup": after,
            **self._times.summary(),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "tensor_parallel_size": self.config.tensor_parallel_size,
            **self.runner.memory_per_device(),
            **self._spec_stats(),
        }

    def _spec_stats(self) -> dict[str, Any]:
        """Speculative decoding's counters (empty without it)."""
        if self.proposer is None:
            return {}
        drafted = self._spec_drafted_at
        return {
            "spec_method": self.config.speculative_config.method,
            "spec_num_speculative_tokens": self._spec_k,
            "spec_num_drafts": self._spec_num_drafts,
            "spec_num_draft_tokens": self._spec_draft_tokens,
            "spec_num_accepted_tokens": self._spec_accepted_tokens,
            "spec_acceptance_rate": (
                self._spec_accepted_tokens / self._spec_draft_tokens
                if self._spec_draft_tokens
                else 0.0
            ),
            # Of the sequence-steps that proposed a draft at position j, the share that
            # accepted it.
            "spec_acceptance_rate_per_position": [
                float(a / d) if d else 0.0 for a, d in zip(self._spec_accepted_at, drafted)
            ],
        }
