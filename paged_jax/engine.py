"""Engine core: requests in, finished outputs out; one scheduler step + one device step per call.

add_request -> Scheduler.schedule -> InputBatch.prepare -> Runner.dispatch
            -> Scheduler.update_from_output -> OutputProcessor -> finished EngineOutputs

The core schedules, executes, applies sampled tokens and rolls a failed step back; it
never looks at text. The output side is ``paged_jax.output_processor``; parallel
sampling, structured outputs and speculative decoding are components it calls from one
place each (docs/engine.md, docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from paged_jax.activations import ActivationCapture, PromptEmbeds, SteeringRows
from paged_jax.config import EngineConfig
from paged_jax.core.block_pool import KVCacheBlock
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request, RequestStatus, fork_child, new_request
from paged_jax.core.scheduler import Scheduler
from paged_jax.core.scheduler_output import SchedulerOutput
from paged_jax.distributed import LockstepGuard, lockstep_parts, num_processes, schedule_digest
from paged_jax.engine_types import (
    GRAMMAR_REFUSED_ERROR,
    HOST_PHASES,
    NONFINITE_LOGITS_ERROR,
    InFlightStep,
)
from paged_jax.lora import LoRAAdapters, LoRARegistry, LoRARequest
from paged_jax.model_api import check_paged_model, model_kv_cache_groups
from paged_jax.output_processor import CompileCounts, OutputProcessor
from paged_jax.outputs import EngineOutput
from paged_jax.parallel_sampling import ParallelSampling
from paged_jax.prompt_logprobs import PromptLogprobs
from paged_jax.sampling_params import SamplingParams
from paged_jax.spec_decode.proposer import Proposer, ProposerContext, build_proposer
from paged_jax.spec_decode.speculator import Speculator
from paged_jax.structured_outputs import StructuredOutputs
from paged_jax.worker.executable_cache import WarmupReport, engine_cache, model_identity
from paged_jax.worker.input_batch import InputBatch
from paged_jax.worker.runner import Runner

__all__ = ["HOST_PHASES", "NONFINITE_LOGITS_ERROR", "Engine", "EngineOutput", "InFlightStep"]


def _serialised(method):
    """Runs an Engine method under the engine's lock: one thread inside at a time."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def _sampling_params(value: Any, default: SamplingParams) -> SamplingParams:
    params = default if value is None else value
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params={params!r} must be a SamplingParams")
    return params


class Engine:
    """Continuous-batching engine over one model.

    Args:
        model: any object satisfying ``paged_jax.PagedModel`` (every paged_jax.models
            model does; see docs/research_integration.md for your own).
        config: engine settings; max_model_len None takes the model's.
        detokenize: optional token ids -> text function, needed for stop strings.
        owns_model: hand the model over: the runner frees its per-layer weights once it
            has stacked them (EngineConfig.scan_layers); the model's layers cannot run
            afterwards. LLM passes True for the models it loads itself.
        executable_cache_dir: where warmup() saves its compiled programs and a later
            engine with the same key loads them; None keeps them in memory.
        tokenizer: the checkpoint's ``tokenizers.Tokenizer`` (or its tokenizer.json path),
            needed for requests with ``SamplingParams.structured_outputs`` (their grammars
            compile against its vocabulary).

    Attributes:
        warmup_report: what warmup() built (programs compiled or loaded, seconds per
            phase; a ``WarmupReport``), None before it.
        phase_clock: the clock (seconds) of ``get_stats()["host_phase_time_ms"]``;
            ``time.perf_counter`` by default (``time.thread_time``: the thread's CPU).
        scheduler, kv_cache_manager, input_batch, runner: the core's parts.
        output: the OutputProcessor (per-request output state, step metrics).
        parallel_sampling, structured, speculator: the feature components (the last
            None without EngineConfig.speculative_config).

    Threads: the calls that read or change requests hold one re-entrant lock; each
    step() returns what finished in it to its caller (docs/engine.md, "Threads").
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
        self.async_scheduling_requested = config.async_scheduling
        config = config.fitted_to(mcfg.max_position_embeddings)
        self.config = config
        self.model_config = mcfg
        self.vocab_size = int(mcfg.vocab_size)
        self.eos_token_ids = tuple(int(t) for t in (mcfg.eos_token_ids or ()))
        self.output = OutputProcessor(detokenize)
        # Hidden states out (EngineConfig.hidden_state_layers): which rows to copy, per request.
        self.activations = ActivationCapture(config.hidden_state_layers)
        # A model without hidden_size (a test fake) cannot build activation options
        # (the runner refuses them), so 0 never sizes anything.
        hidden = int(getattr(mcfg, "hidden_size", 0) or 0)
        self.steering = SteeringRows(config.steering_layers, hidden)
        embed_dim = int(getattr(mcfg, "word_embed_proj_dim", None) or hidden)
        self.prompt_embeds = PromptEmbeds(config.enable_prompt_embeds, embed_dim)
        self.phase_clock: Callable[[], float] = time.perf_counter
        self._lock = threading.RLock()
        groups = model_kv_cache_groups(model)
        # Read before the runner may take the model's layers over.
        self._model_identity = model_identity(model)
        self._model_name = type(model).__name__
        self._executable_cache_dir = executable_cache_dir
        # The processes of one engine compare their schedules before the steps run.
        self._lockstep = (
            LockstepGuard(config.lockstep_check_interval, every_step=config.validate)
            if num_processes() > 1
            else None
        )
        self.warmup_report: WarmupReport | None = None
        proposer: Proposer | None = None
        if config.speculative_config is not None:
            context = ProposerContext(config, self.vocab_size, model, config.dtype)
            proposer = build_proposer(config.speculative_config, context)
        self.runner = Runner(
            model,
            config,
            owns_model=owns_model,
            extra_kv_bytes_per_block=(
                0 if proposer is None else proposer.kv_cache_bytes_per_block()
            ),
        )
        if proposer is not None:
            proposer.initialize(self.runner.num_kv_blocks)
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
        # Live requests (plain ones; a parallel-sampling parent's parts) -> their seeds.
        self._seeds: dict[str, int] = {}
        self._seed_rng = np.random.default_rng(config.seed)
        # The components: each is called from one place in the step.
        self.parallel_sampling = ParallelSampling(
            self._queue, self._fork, self._abort, self._seeds.__contains__
        )
        self.structured = StructuredOutputs(tokenizer, self.vocab_size)
        self.lora: LoRAAdapters | None = None
        device = self.runner.lora
        if device is not None:
            registry = LoRARegistry(
                device.shapes,
                device.num_layers,
                config.max_lora_rank,
                device.refused,
                device.repeated_heads,
            )
            self.lora = LoRAAdapters(registry, config.max_loras, self.runner.write_lora_slot)
        self.speculator: Speculator | None = None
        if proposer is not None:
            self.speculator = Speculator(
                proposer,
                config.speculative_config.method,
                config.num_speculative_tokens,
                self.scheduler,
                self.kv_cache_manager,
                self.input_batch,
                self.runner,
            )
        self._in_flight: InFlightStep | None = None
        # Outputs of requests that ended in a step() that then raised: the next returns them.
        self._undelivered: list[EngineOutput] = []
        self._synchronous = False
        self._num_steps = 0
        # Compiles of the engine's own programs (Runner.num_compiles), not the process's.
        self._compiles = CompileCounts(self._num_compiles)

    @property
    def proposer(self) -> Proposer | None:
        """The speculative decoding proposer (the speculator's); None without
        EngineConfig.speculative_config. Settable, to plant a proposer of your own."""
        return None if self.speculator is None else self.speculator.proposer

    @proposer.setter
    def proposer(self, value: Proposer) -> None:
        if self.speculator is None:
            raise ValueError(
                f"proposer={value!r} needs an engine built with EngineConfig.speculative_config"
            )
        self.speculator.proposer = value

    @property
    def detokenize(self) -> Callable[[Sequence[int]], str] | None:
        """The token ids -> text function stop strings are matched with (the output
        processor's); None: stop strings never match."""
        return self.output.detokenize

    @detokenize.setter
    def detokenize(self, value: Callable[[Sequence[int]], str] | None) -> None:
        self.output.detokenize = value

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
        lora_request: LoRARequest | None = None,
        prompt_embeds: Any = None,
    ) -> None:
        """Validates and queues one request; raises ValueError (and adds nothing) on bad input.

        ``lora_request`` serves the request with that LoRA adapter (enable_lora engines;
        None: the base model); a bad adapter raises ValueError naming it.
        ``prompt_embeds`` (f32[E, hidden_size], E <= len(prompt_token_ids), with
        EngineConfig.enable_prompt_embeds) replaces the embedding table's rows of the
        prompt's first E tokens; those ids are then placeholders (LLM passes zeros) that
        only the sampler's penalties read (beam search restarts a beam as its embedded
        prompt followed by its tokens).

        With ``sampling_params.n > 1`` the request is a parallel-sampling parent: its n
        samples (ids ``f"{request_id}_{j}"``, seeds ``(seed + j) % 2**32``) are forked from
        one prefill; it finishes as one EngineOutput, ``samples`` in index order.

        With ``sampling_params.prompt_logprobs`` every wanted prompt position runs through
        the model (never from cached blocks; with ``prompt_logprobs_tail`` the tokens before
        the tail may) and the EngineOutput carries ``prompt_logprobs``;
        the model needs ``forward_paged_hidden`` and ``logits``.
        """
        params = _sampling_params(sampling_params, SamplingParams())
        if self._id_taken(request_id):
            raise ValueError(f"request_id={request_id!r} must be unique among live requests")
        if lora_request is not None and self.lora is None:
            raise ValueError(
                f"lora_request={lora_request!r} needs an engine built with enable_lora=True"
            )
        adapter_id = None if self.lora is None else self.lora.adapter_id(lora_request)
        embeds = None
        block_keys: list[bytes] = []
        activations = params.return_hidden_states or params.steering_vectors is not None
        if activations or prompt_embeds is not None:  # paged_jax.activations' components
            self.activations.check(params)
            self.steering.check(params)
            cache_salt = self.steering.cache_salt(cache_salt, params)
            if prompt_embeds is not None:
                embeds = self.prompt_embeds.check(prompt_embeds)
                if len(embeds) > len(prompt_token_ids):
                    raise ValueError(
                        f"len(prompt_token_ids)={len(prompt_token_ids)} must be at least the "
                        f"prompt_embeds rows ({len(embeds)})"
                    )
                block_keys = self.prompt_embeds.block_keys(embeds, self.config.block_size)
        req = new_request(
            request_id,
            prompt_token_ids,
            params,
            vocab_size=self.vocab_size,
            max_model_len=self.config.max_model_len,
            cache_salt=cache_salt,
            priority=priority,
            arrival_time=arrival_time,
            adapter_id=adapter_id,
            block_extra_keys=block_keys,
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
            prompt = PromptLogprobs(
                req.prompt_token_ids, params.prompt_logprobs, params.prompt_logprobs_tail
            )
            req.skip_reading_prefix_cache = prompt.num_cacheable_tokens == 0
            req.max_cache_hit_tokens = prompt.num_cacheable_tokens
        if params.structured_outputs is not None:
            # A bad constraint raises here, naming its field.
            self.structured.new_matcher(params, self.eos_token_ids)
        if params.n > 1:  # a parent: its carrier, or its samples
            self.parallel_sampling.add(req, prompt, self._id_taken, embeds)
            return
        self._queue(req, prompt, embeds, owns_prompt=True)

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

        Call between steps. The child joins the batch at the next step with the tokens
        it shares with the parent (at most the parent's computed ones, a common prefix)
        already computed; a block the two still share is copied on its first write. A
        different prompt makes the child a new request whose outputs start empty.

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
        if request_id not in self._seeds:
            raise ValueError(f"request_id={request_id!r} must name a live request")
        return self.output.states[request_id].logprobs

    @_serialised
    def abort_request(self, request_id: str) -> EngineOutput:
        """Ends a live request now; its blocks go back to the pool.

        A parallel-sampling parent's carrier and unfinished samples are aborted with
        it; its output keeps the samples that had finished. Its samples cannot be
        aborted one by one.
        """
        sampling = self.parallel_sampling
        if sampling.parents:
            out = sampling.abort_request(request_id)
            if out is not None:
                return out
        if request_id not in self._seeds:
            raise ValueError(f"request_id={request_id!r} must name a live request")
        return self._abort(request_id)

    def is_live(self, request_id: str) -> bool:
        """True while ``request_id`` names a request that has not finished.

        A parallel-sampling parent is live until its last sample finishes.
        """
        return request_id in self._seeds or request_id in self.parallel_sampling.parents

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
        if request_id in self._seeds:
            return True
        sampling = self.parallel_sampling
        return bool(sampling.parents) and sampling.holds(request_id)

    def _register(
        self,
        request_id: str,
        params: SamplingParams,
        prompt: PromptLogprobs | None = None,
        *,
        owns_prompt: bool = False,
        matcher: Any = None,
    ) -> None:
        """Starts a live request's state: its grammar (``matcher`` or a new one), its
        seed, its output state (``prompt`` collects its prompt logprobs; reported by its
        own output when ``owns_prompt``)."""
        if params.structured_outputs is not None:
            self.structured.add_request(request_id, params, self.eos_token_ids, matcher)
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**32))
        self._seeds[request_id] = seed
        self.output.add_request(request_id, params, prompt, owns_prompt=owns_prompt)

    def _queue(
        self,
        req: Request,
        prompt: PromptLogprobs | None,
        prompt_embeds: Any = None,
        *,
        owns_prompt: bool = False,
    ) -> None:
        """Starts a validated request's state (see _register; ``prompt_embeds``: its
        checked f32[P, hidden] rows or None) and hands it to the scheduler."""
        self._register(req.request_id, req.sampling_params, prompt, owns_prompt=owns_prompt)
        if req.sampling_params.return_hidden_states:  # every prompt row computed
            req.skip_reading_prefix_cache = True
            self.activations.add(req.request_id, req.num_prompt_tokens)
        if prompt_embeds is not None:
            self.prompt_embeds.add(req.request_id, prompt_embeds)
        self.scheduler.add_request(req)

    def _unregister(self, request_id: str) -> None:
        """Drops a request's state (the inverse of _register)."""
        del self._seeds[request_id]
        if self.structured.matchers:
            self.structured.remove_request(request_id)
        self.output.remove_request(request_id)
        self._forget_activations(request_id)

    def _fork(
        self,
        parent: Request,
        child_id: str,
        prompt_token_ids: Sequence[int] | None,
        output_token_ids: Sequence[int] | None,
        sampling_params: SamplingParams | None,
    ) -> None:
        """fork_request once the parent is found and the child id is known to be free."""
        params = _sampling_params(sampling_params, parent.sampling_params)
        child, common = fork_child(
            parent,
            child_id,
            prompt_token_ids,
            output_token_ids,
            params,
            vocab_size=self.vocab_size,
            max_model_len=self.config.max_model_len,
        )
        rid = parent.request_id
        if params.return_hidden_states:
            self.activations.check(params)
            if rid not in self.activations.requests:
                raise ValueError(
                    f"SamplingParams.return_hidden_states=True for child {child_id!r} needs "
                    f"a parent that captures them; {rid!r} does not"
                )
            child.skip_reading_prefix_cache = True
        matcher = self.structured.fork_matcher(parent, child, params, self.eos_token_ids)
        self._register(child_id, params, matcher=matcher)
        try:
            self.scheduler.fork_request(rid, child, num_tokens=common)
        except ValueError:
            self._unregister(child_id)
            raise
        # The child's first `common` positions are its parent's: so are their rows.
        if params.return_hidden_states:
            self.activations.fork(rid, child_id, child.num_prompt_tokens, common)
        if rid in self.prompt_embeds.requests:
            self.prompt_embeds.add(child_id, self.prompt_embeds.requests[rid])

    def _abort(self, request_id: str) -> EngineOutput:
        req = self.scheduler.requests[request_id]
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return self._finish(req)

    def _finish(self, req: Request) -> EngineOutput:
        """The EngineOutput of a request the scheduler has ended; forgets its state."""
        rid = req.request_id
        del self._seeds[rid]
        if self.structured.matchers:
            self.structured.remove_request(rid)
        self.runner.drop_swapped(rid)
        out = self.output.finish(req, self.scheduler.errors.pop(rid, None))
        if rid in self.activations.requests:
            out = self.activations.attach(out)
        self._forget_activations(rid)
        return out

    def _forget_activations(self, request_id: str) -> None:
        """Drops a request's hidden-state collector and prompt embeddings, if it had any."""
        if request_id in self.activations.requests:
            self.activations.remove(request_id)
        if request_id in self.prompt_embeds.requests:
            self.prompt_embeds.remove(request_id)

    # ------------------------------------------------------------ step
    @_serialised
    def step(self) -> list[EngineOutput]:
        """Runs one scheduler + device step; returns the requests that finished.

        With async_scheduling the step just scheduled is left running on device and
        the previous step's tokens are read instead; otherwise the step's own tokens
        are read before returning. Parallel-sampling parents whose prompt was just
        prefilled get their samples forked; a parent is returned once, when its last
        sample finishes. While a constrained request is live every step reads its own
        tokens (outputs equal the synchronous engine's).

        A step that raises (KeyboardInterrupt included) is rolled back before the
        exception propagates: the steps not read yet are dropped, running requests go
        back to the waiting queue and recompute their KV (outputs equal a run without the
        failure), and outputs of requests that had already ended come back from the next
        step(); a request whose logits are not finite ends with finish_reason "error"
        (NONFINITE_LOGITS_ERROR). docs/engine.md, "Failures", has the details.
        """
        matchers = self.structured.matchers
        if matchers and self._in_flight is not None:
            return self._read_in_flight()
        t0 = time.perf_counter()
        clock = self.phase_clock
        sched = self.scheduler
        output = self.output
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
            output.peaks.record(out, self.kv_cache_manager, sched.requests)
            assert out.scheduled or not out.block_copies, "a block copied for nothing scheduled"
            if out.scheduled:
                c0 = clock()
                batch = self.input_batch
                for req_id, drafts in out.spec_token_ids.items():
                    batch.set_draft_tokens(req_id, drafts)
                step = batch.prepare(out.scheduled, out.block_copies, out.spec_token_ids)
                if matchers:
                    step = self.structured.bitmask(step, out.scheduled, self.runner.bitmask_width)
                if self.lora is not None:
                    step = self.lora.step_slots(step, self._scheduled_requests(out), sched.running)
                if self.steering.layers:
                    step = self.steering.apply(step, self._scheduled_requests(out))
                if self.prompt_embeds.requests:
                    step = self.prompt_embeds.apply(step, out.scheduled)
                rows = targets = prompt = None
                if output.prompt_logprobs:  # nothing to do for the steps of other requests
                    rows, targets, prompt = output.prompt_rows(out.scheduled)
                capture_rows, captured = None, []
                if self.activations.requests:
                    capture_rows, captured = self.activations.rows(out.scheduled)
                c1 = clock()
                pending = self.runner.dispatch(
                    step,
                    with_logprobs=output.num_logprobs_live > 0,
                    prompt_rows=rows,
                    prompt_targets=targets,
                    hidden_state_rows=capture_rows,
                )
                c2 = clock()
                prepare_s, dispatch_s = c1 - c0, c2 - c1
                requests = self._scheduled_requests(out)
                launched = InFlightStep(out, requests, pending, cached, prompt or [], captured)
                self._num_steps += 1
            ready = launched
            if self.config.async_scheduling and not self._synchronous and not matchers:
                ready, self._in_flight = previous, launched
            wait_s = process_s = 0.0
            if ready is not None:
                t_wait = time.perf_counter()
                result = ready.pending.result()
                wait_s = time.perf_counter() - t_wait
                c0 = clock()
                finished += self._process_outputs(ready, result)
                if self.speculator is not None:
                    self.speculator.propose(step, matchers)
                process_s = clock() - c0
        except BaseException:
            self.scheduler.spec_token_ids = {}
            self._roll_back(out, cached, previous, finished)
            raise
        finished = self._after_outputs(finished)
        step_s = time.perf_counter() - t0
        if launched is not None or ready is not None:
            output.times.record(step_s, wait_s, schedule_s, prepare_s, dispatch_s, process_s)
        return finished

    def _scheduled_requests(self, out: SchedulerOutput) -> list[Request]:
        """The Requests of ``out.scheduled``, in its (the step's row) order."""
        requests = out.scheduled_requests
        if len(requests) != len(out.scheduled):  # an output built by hand
            requests = [self.scheduler.requests[seq.req_id] for seq in out.scheduled]
        return requests

    def _read_in_flight(self) -> list[EngineOutput]:
        """step() without scheduling: reads the async step in flight (see step())."""
        finished, self._undelivered = self._undelivered, []
        previous, self._in_flight = self._in_flight, None
        try:
            finished += self._process_outputs(previous, previous.pending.result())
        except BaseException:
            self._roll_back(SchedulerOutput(), [], previous, finished)
            raise
        return self._after_outputs(finished)

    def _after_outputs(self, finished: list[EngineOutput]) -> list[EngineOutput]:
        """Parallel sampling's turn after a step's tokens (ParallelSampling.after_step)."""
        sampling = self.parallel_sampling
        if sampling.parents:
            finished = sampling.after_step(finished, self.scheduler.requests)
        return finished

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
        self.structured.replay(touched)  # a grammar past tokens that were dropped
        for req in touched:  # ended while its tokens were applied, not reported yet
            rid = req.request_id
            if req.is_finished() and rid in self._seeds and live.get(rid) is not req:
                finished.append(self._finish(req))
        self.input_batch.remove_all()
        kv = self.kv_cache_manager
        if self.runner.replace_lost_device_state():
            reset = kv.reset_prefix_cache()
            assert reset, "a block is still held after every running request was rolled back"
        else:
            kv.uncache_blocks(unconfirmed)
        self._undelivered.extend(finished)

    def _process_outputs(self, step: InFlightStep, result: Any) -> list[EngineOutput]:
        """Applies one finished device step's tokens; returns the finished requests.

        The order: prompt logprobs; tokens read (and speculative stop strings cut);
        grammars accept; the scheduler appends and checks token stops; then string stops,
        errors and grammar ends; the input batch gets the tokens.
        """
        output = self.output
        if step.prompt:  # before a request that finishes in this step reports them
            output.record_prompt_logprobs(step, result)
        if step.hidden_states:
            self.activations.record(step.hidden_states, result.hidden_states)
        sched = self.scheduler
        requests = sched.requests
        spec = result.num_emitted is not None
        if spec:
            sampled, broken = self.speculator.read(step, result, requests.get)
            output.record_emitted(step, result, sampled)
            string_stops = output.cut_at_stop_strings(sampled, requests)
        else:
            sampled, broken = output.read_sampled(step, result, requests.get)
        structured = self.structured
        refused, grammar_done = (
            structured.accept(sampled, requests, self.eos_token_ids)
            if structured.matchers
            else ((), ())
        )
        done = sched.update_from_output(step.out, sampled, self.eos_token_ids)
        live = sampled
        if done:
            for req in done:
                output.ended_by_tokens(req, sampled[req.request_id])
            done_ids = {req.request_id for req in done}
            live = {k: v for k, v in sampled.items() if k not in done_ids}

        def end(req: Request, status: RequestStatus, error: str | None = None) -> None:
            sched.finish_request(req.request_id, status, error)
            done.append(req)

        stopped = RequestStatus.FINISHED_STOPPED
        if spec:
            for req_id, stop in string_stops.items():
                if req_id in live:
                    end(requests[req_id], stopped)
                    output.set_stop_reason(req_id, stop)
                    live.pop(req_id)
        for req in broken:  # its token is garbage: it ends here, the others go on
            if not req.is_finished():  # else a stop among its kept speculative tokens came first
                end(req, RequestStatus.FINISHED_ERROR, NONFINITE_LOGITS_ERROR)
        for req, token in refused:  # with the backend's reason, when it gave one
            message = GRAMMAR_REFUSED_ERROR.format(token=token)
            reason = structured.refusal_reason(req.request_id)
            end(req, RequestStatus.FINISHED_ERROR, f"{message}: {reason}" if reason else message)
            live.pop(req.request_id, None)
        for req_id in grammar_done:  # EOS ended the grammar under ignore_eos: a stop
            req = requests.get(req_id)
            if req is not None and not req.is_finished():
                end(req, stopped)
                live.pop(req_id, None)
        batch = self.input_batch
        batch.append_step_tokens(live, emitted=spec)
        for req in output.string_stops(() if spec else live, requests):
            end(req, stopped)
        finished = []
        for req in done:
            if req.request_id in batch.row_of:
                batch.remove_request(req.request_id)
            finished.append(self._finish(req))
        return finished

    # ------------------------------------------------------------ helpers
    def _apply_to_device_state(self, out: SchedulerOutput) -> None:
        """Mirrors a schedule into the input batch rows and the KV swap space: swap-outs
        read their blocks before anything can reuse them, swap-ins fill fresh blocks
        before the step."""
        for req_id, block_ids in out.swap_out:
            self.runner.swap_out(req_id, block_ids)
        requests = self.scheduler.requests
        for row in out.new_rows:
            self.output.record_admission(requests[row.req_id], row.num_computed_tokens)
        self.input_batch.apply_schedule(out, requests, self._seeds, self.eos_token_ids)
        for req_id, block_ids in out.swap_in:
            self.runner.swap_in(req_id, block_ids)

    # ------------------------------------------------------------ warmup + stats
    @_serialised
    def warmup(self, on_program: Callable[[int, int, str, str], None] | None = None) -> int:
        """Builds every step program serving can call; returns how many it built.

        Each program (docs/engine.md, "Buckets, programs and warm-up") is loaded from the
        executable cache when it holds it, else compiled (and saved there). Afterwards no
        step compiles; ``warmup_report`` says what was done and how long it took.

        on_program: optional progress callback (i, num_programs, name, action), action
            "loading" or "compiling".
        """
        shapes = self.config.step_shapes()
        steps = [self.input_batch.dummy_step_input(t, s) for t, s in shapes]
        cache = engine_cache(
            self._executable_cache_dir, self._model_identity, self.config, self.runner.num_kv_blocks
        )
        self.warmup_report = self.runner.warmup(steps, on_program, cache=cache)
        if self.lora is not None:  # warm-up wrote zeros into a slot: reload on next use
            self.lora.slots.clear()
        if self._lockstep is not None:
            self._lockstep.warmup()
        if self.proposer is not None:
            self.proposer.warmup()
        self._compiles.mark_warmup()
        return len(self.warmup_report.programs)

    def _num_compiles(self) -> int:
        """Backend compiles of the engine's own programs: the runner's and the proposer's."""
        extra = 0 if self.proposer is None else self.proposer.num_compiles
        return self.runner.num_compiles + extra

    @_serialised
    def reset_peak_stats(self) -> None:
        """Starts the peaks of get_stats() again from now (KV usage, blocks per request)."""
        self.output.peaks.reset(self.kv_cache_manager.usage, self.scheduler.requests)

    def reset_step_times(self) -> None:
        """Forgets the step timings, so get_stats()' times cover the steps from now on."""
        self.output.times.reset()

    @_serialised
    def get_stats(self) -> dict[str, Any]:
        """Counters since construction and step times since the last reset_step_times()
        (the keys: docs/engine.md, "Stats"). Compiles count the engine's own programs
        only (total and after warm-up); host phases are timed with ``phase_clock``.
        """
        stats = self.kv_cache_manager.prefix_cache_stats
        return {
            "num_steps": self._num_steps,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": stats.queries,
            "prefix_cache_hits": stats.hits,
            "prefix_cache_hit_rate": stats.hit_rate,
            "kv_cache_usage": self.kv_cache_manager.usage,
            "kv_cache_usage_peak": self.output.peaks.usage,
            # Most KV blocks (all groups, nulls excluded) one request held in a decode step.
            "kv_blocks_per_request_peak": self.output.peaks.blocks_per_request,
            "num_kv_blocks": self.runner.num_kv_blocks,
            **self._compiles.summary(),
            **self.output.times.summary(),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "tensor_parallel_size": self.config.tensor_parallel_size,
            **self.runner.memory_per_device(),
            **({} if self.speculator is None else self.speculator.stats()),
        }
