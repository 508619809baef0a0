"""The engine's output side: per-step results -> EngineOutputs -> RequestOutputs.

The core (paged_jax.engine) schedules, runs the step and appends each request's sampled
tokens; it never looks at text. This module reads a plain step's sampled tokens off its
result for the core (``read_sampled``) and keeps what only outputs need, per request:
logprob entries, the first-token time, stop strings (detokenized tails) and the stop
reason, prompt logprobs, the prefix-cache hit at admission; and per step the host
timings. ``request_output`` then turns a finished EngineOutput into vLLM's RequestOutput
(text, stop-string cuts, ``Logprob`` objects, metrics). Pure Python; never imports jax.
"""

from __future__ import annotations

import dataclasses
import operator
import statistics
import time
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from paged_jax.core.request import Request, RequestStatus
from paged_jax.engine_types import FINISH_REASONS, HOST_PHASES, InFlightStep
from paged_jax.outputs import (
    CompletionOutput,
    EngineOutput,
    Logprob,
    LogprobEntry,
    RankEntry,
    RequestMetrics,
    RequestOutput,
    logprob_entry,
)
from paged_jax.prompt_logprobs import PromptLogprobs
from paged_jax.sampling_params import SamplingParams

_req_id_of = operator.attrgetter("req_id")
_samples_of = operator.attrgetter("samples")

# Characters of output text past the longest stop string that a new match can start in
# (a token's text is rarely longer).
STOP_STRING_TAIL_TOKENS = 8


@dataclasses.dataclass
class RequestState:
    """The output side of one live request.

    ``prompt`` collects the prompt logprobs this request computes (shared by a
    parallel-sampling parent's carrier and fallback samples); ``owns_prompt`` says its
    own output reports them (a plain request), not its parent's. ``num_cached_tokens``
    is the prefix-cache hit of its first admission (None before it).
    """

    params: SamplingParams
    logprobs: list[LogprobEntry] | None
    logprob_ranks: list[RankEntry] | None = None
    first_token_time: float | None = None
    stop_reason: str | int | None = None
    prompt: PromptLogprobs | None = None
    owns_prompt: bool = False
    num_cached_tokens: int | None = None


class StepTimes:
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


class CompileCounts:
    """Compiles of the engine's own programs (``count()``: the running total) since
    construction and since the last warm-up."""

    def __init__(self, count: Callable[[], int]) -> None:
        self.count = count
        self.at_start = count()
        self.after_warmup: int | None = None

    def mark_warmup(self) -> None:
        self.after_warmup = self.count()

    def summary(self) -> dict[str, int | None]:
        now = self.count()
        after = None if self.after_warmup is None else now - self.after_warmup
        return {"num_compiles": now - self.at_start, "num_compiles_after_warmup": after}


class KVPeaks:
    """Peaks of KV use since construction or the last reset: the pool's usage, and the
    most real blocks (all groups, nulls excluded) one request held in a decode step."""

    def __init__(self) -> None:
        self.usage = 0.0
        self.blocks_per_request = 0
        # Requests whose block count may have grown since a decode step last measured it.
        self.dirty: set[str] = set()

    def reset(self, usage: float, live: Iterable[str]) -> None:
        """Starts again from now; live requests are measured at their next decode step."""
        self.usage = usage
        self.blocks_per_request = 0
        self.dirty.update(live)

    def record(self, out: Any, kv: Any, live: Mapping[str, Request]) -> None:
        """Takes a scheduled step's (a SchedulerOutput's) usage of ``kv`` (the
        KVCacheManager); ``live``: the scheduler's requests.

        A request's count only grows when it gets blocks (a new row, appended blocks),
        so only those requests are measured, at their next decode step (one generated
        token in).
        """
        self.usage = max(self.usage, kv.usage)
        if not out.scheduled:
            return
        dirty = self.dirty
        for row in out.new_rows:
            dirty.add(row.req_id)
        dirty.update(out.new_block_ids)
        if not dirty:
            return
        seqs = out.scheduled
        requests = out.scheduled_requests
        if len(requests) != len(seqs):
            requests = [live[seq.req_id] for seq in seqs]
        index = {seq.req_id: i for i, seq in enumerate(seqs)}
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
                if held > self.blocks_per_request:
                    self.blocks_per_request = held


class OutputProcessor:
    """Per-request output state, filled as the core reads each step's tokens.

    Args:
        detokenize: token ids -> text, needed for stop strings (None: they never match).

    Attributes:
        states: request id -> RequestState of every live request.
        prompt_logprobs: live requests that compute prompt logprobs -> their collector.
        times: the host timings of the engine's steps.
        peaks: the KV-use peaks of its steps.
    """

    def __init__(self, detokenize: Callable[[Sequence[int]], str] | None = None) -> None:
        self.detokenize = detokenize
        self.states: dict[str, RequestState] = {}
        self.prompt_logprobs: dict[str, PromptLogprobs] = {}
        self.times = StepTimes()
        self.peaks = KVPeaks()
        # Per-step shortcuts over states: live requests still waiting for their first
        # token, with stop strings, and how many want logprobs (0: the device step's
        # logprob outputs are never copied to the host).
        self.awaiting_first_token: set[str] = set()
        self.stop_string_ids: set[str] = set()
        self.num_logprobs_live = 0

    # ------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        params: SamplingParams,
        prompt: PromptLogprobs | None = None,
        *,
        owns_prompt: bool = False,
    ) -> None:
        """Starts a request's output state; ``prompt`` collects the prompt logprobs it
        computes (its own output reports them when ``owns_prompt``)."""
        wants = params.logprobs is not None
        self.states[request_id] = RequestState(
            params,
            [] if wants else None,
            [] if wants else None,
            prompt=prompt,
            owns_prompt=owns_prompt,
        )
        self.awaiting_first_token.add(request_id)
        if params.stop:
            self.stop_string_ids.add(request_id)
        if wants:
            self.num_logprobs_live += 1
        if prompt is not None:
            self.prompt_logprobs[request_id] = prompt

    def remove_request(self, request_id: str) -> RequestState:
        """Drops a request's output state (the inverse of add_request)."""
        st = self.states.pop(request_id)
        self.awaiting_first_token.discard(request_id)
        self.stop_string_ids.discard(request_id)
        self.prompt_logprobs.pop(request_id, None)
        if st.logprobs is not None:
            self.num_logprobs_live -= 1
        return st

    def record_admission(self, req: Request, num_computed_tokens: int) -> None:
        """Keeps the prefix-cache hit of a request's first admission (a resume's hits are
        mostly its own blocks; a rolled-back request resumes unpreempted but keeps its
        first count)."""
        st = self.states[req.request_id]
        if st.num_cached_tokens is None and req.num_preemptions == 0:
            st.num_cached_tokens = num_computed_tokens

    def finish(self, req: Request, error: str | None) -> EngineOutput:
        """The EngineOutput of a request the core has ended; forgets its state."""
        st = self.remove_request(req.request_id)
        prompt = ranks = None
        if st.owns_prompt and st.prompt is not None:
            prompt, ranks = st.prompt.output()
        return EngineOutput(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            token_ids=list(req.output_token_ids),
            finish_reason=FINISH_REASONS[req.status],
            stop_reason=st.stop_reason,
            error=error,
            logprobs=st.logprobs,
            arrival_time=req.arrival_time,
            first_token_time=st.first_token_time,
            finish_time=time.time(),
            num_cached_tokens=st.num_cached_tokens or 0,
            num_preemptions=req.num_preemptions,
            logprob_ranks=st.logprob_ranks,
            prompt_logprobs=prompt,
            prompt_logprob_ranks=ranks,
        )

    # ------------------------------------------------------------ sampled tokens
    def read_sampled(
        self, step: InFlightStep, result: Any, live_get: Callable[[str], Request | None]
    ) -> tuple[dict[str, int], list[Request]]:
        """Reads a plain (not speculative) step's tokens and records their first-token
        times and logprob entries.

        Returns req_id -> sampled token for the sequences that reached their end, and
        the live requests whose logits were not finite (none sampled).
        """
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
        self.record_sampled(step, result, sampled, live_get)
        return sampled, broken

    def record_sampled(
        self, step: InFlightStep, result: Any, sampled: dict[str, int], live_get: Callable
    ) -> None:
        """First-token times and logprob entries of a plain step's sampled tokens."""
        if self.awaiting_first_token:
            self.stamp_first_tokens(sampled)
        if not self.num_logprobs_live:
            return
        token_ids = result.token_ids
        for i, seq in enumerate(step.out.scheduled):
            if seq.req_id not in sampled or live_get(seq.req_id) is not step.requests[i]:
                continue
            st = self.states[seq.req_id]
            if st.logprobs is None:
                continue
            k = st.params.logprobs
            entry, ranks = logprob_entry(
                int(token_ids[i]),
                float(result.logprobs[i]),
                int(result.ranks[i]),
                result.top_token_ids[i, :k].tolist(),
                result.top_logprobs[i, :k].tolist(),
            )
            st.logprobs.append(entry)
            st.logprob_ranks.append(ranks)

    def record_emitted(
        self, step: InFlightStep, result: Any, sampled: dict[str, list[int]]
    ) -> None:
        """record_sampled for a speculative step: entries for every emitted token."""
        if self.awaiting_first_token:
            self.stamp_first_tokens(sampled)
        if not self.num_logprobs_live:
            return
        for i, seq in enumerate(step.out.scheduled):
            tokens = sampled.get(seq.req_id)
            st = self.states.get(seq.req_id)
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

    def stamp_first_tokens(self, sampled: dict[str, Any]) -> None:
        """Sets first_token_time of the requests in ``sampled`` that had no token yet."""
        awaiting = self.awaiting_first_token
        first = awaiting.intersection(sampled)
        if first:
            now = time.time()
            for req_id in first:
                self.states[req_id].first_token_time = now
            awaiting -= first

    def ended_by_tokens(self, req: Request, token: int | list[int]) -> None:
        """Notes how a request the core ended while appending ``token`` stopped (its stop
        token); a speculative row (a list of emitted tokens) drops the logprob entries
        of its tokens after the one that ended it."""
        st = self.states[req.request_id]
        if type(token) is list:  # the last token appended is the one that stopped it
            token = req.output_token_ids[-1]
            if st.logprobs is not None:
                del st.logprobs[req.num_output_tokens :]
                del st.logprob_ranks[req.num_output_tokens :]
        if req.status == RequestStatus.FINISHED_STOPPED and token in st.params.stop_token_ids:
            st.stop_reason = token

    # ------------------------------------------------------------ stop strings
    def _text_tail(self, params: SamplingParams, token_ids: list[int]) -> str:
        """The text a new stop-string match can lie in: the last tokens' text."""
        tail = max(map(len, params.stop)) + STOP_STRING_TAIL_TOKENS
        return self.detokenize(token_ids[-tail:])

    def stop_string_hit(self, req: Request) -> str | None:
        """The stop string that the request's output text now contains, if any."""
        st = self.states[req.request_id]
        if not st.params.stop or self.detokenize is None:
            return None
        if req.num_output_tokens < st.params.min_tokens:
            return None
        text = self._text_tail(st.params, req.output_token_ids)
        stop = next((s for s in st.params.stop if s in text), None)
        if stop is not None:
            st.stop_reason = stop
        return stop

    def string_stops(
        self, request_ids: Iterable[str], requests: Mapping[str, Request]
    ) -> list[Request]:
        """The requests among ``request_ids`` (each just given a token) whose output text
        now holds one of their stop strings; each one's stop_reason is set to it."""
        stop_ids = self.stop_string_ids
        if not stop_ids or self.detokenize is None:
            return []
        return [
            requests[req_id]
            for req_id in request_ids
            if req_id in stop_ids and self.stop_string_hit(requests[req_id]) is not None
        ]

    def cut_at_stop_strings(
        self, sampled: dict[str, list[int]], requests: dict[str, Request]
    ) -> dict[str, str]:
        """Cuts each emitted list after the token that completes a stop string (in place);
        returns req_id -> that stop string (a speculative step's tokens, not appended yet)."""
        stops = {}
        if not self.stop_string_ids or self.detokenize is None:
            return stops
        for req_id, tokens in sampled.items():
            if req_id not in self.stop_string_ids:
                continue
            params = self.states[req_id].params
            req = requests[req_id]
            for j in range(len(tokens)):
                if req.num_output_tokens + j + 1 < params.min_tokens:
                    continue
                text = self._text_tail(params, req.output_token_ids + tokens[: j + 1])
                stop = next((x for x in params.stop if x in text), None)
                if stop is not None:
                    del tokens[j + 1 :]
                    stops[req_id] = stop
                    break
        return stops

    def set_stop_reason(self, request_id: str, reason: str | int) -> None:
        self.states[request_id].stop_reason = reason

    # ------------------------------------------------------------ prompt logprobs
    def prompt_rows(
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
        recorders = self.prompt_logprobs
        for seq in seqs:
            prompt = recorders.get(seq.req_id)
            if prompt is not None:
                first = seq.num_computed_tokens
                wanted = prompt.wanted(max(first, prompt.next_position), first + seq.num_new_tokens)
                if wanted:
                    rows.extend(range(start + wanted.start - first, start + wanted.stop - first))
                    targets.extend(prompt.prompt_token_ids[wanted.start + 1 : wanted.stop + 1])
                    parts.append((prompt, wanted))
            start += seq.num_new_tokens
        return np.asarray(rows, np.int32), np.asarray(targets, np.int32), parts

    @staticmethod
    def record_prompt_logprobs(step: InFlightStep, result: Any) -> None:
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


# ---------------------------------------------------------------- RequestOutputs
def logprob_objects(
    entries: Sequence[LogprobEntry | None],
    ranks: Sequence[RankEntry | None] | None,
    decode_token: Callable[[int], str | None] | None = None,
) -> list[dict[int, Logprob] | None]:
    """The engine's entries as vLLM's ``{token id: Logprob}`` dicts (None stays None).

    Args:
        entries: per position {token id: logprob}.
        ranks: per position the ranks of the entry's tokens in its order; None when
            unknown (every rank is then None).
        decode_token: token id -> its text; None leaves decoded_token None.
    """
    out: list[dict[int, Logprob] | None] = []
    for i, entry in enumerate(entries):
        if entry is None:
            out.append(None)
            continue
        rank_list = ranks[i] if ranks is not None else None
        out.append(
            {
                tid: Logprob(
                    lp,
                    None if rank_list is None else rank_list[j],
                    None if decode_token is None else decode_token(tid),
                )
                for j, (tid, lp) in enumerate(entry.items())
            }
        )
    return out


def completion_output(
    index: int,
    out: EngineOutput,
    params: SamplingParams,
    decode: Callable[..., str],
    decode_token: Callable[[int], str | None] | None = None,
) -> CompletionOutput:
    """One completion with vLLM's text rules.

    A stop string is cut off, and so is the text of the stop token or EOS that
    ended the output; ``include_stop_str_in_output`` keeps both.

    Args:
        index: which of the prompt's completions this is.
        out: the finished (sample's) engine output.
        params: the prompt's SamplingParams (its text settings).
        decode: ``decode(token_ids, skip_special_tokens=...) -> str``.
        decode_token: token id -> text for Logprob.decoded_token; None leaves it None.
    """
    ids = list(out.token_ids)
    keep_stop = params.include_stop_str_in_output
    by_token = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
    text_ids = ids[:-1] if by_token and ids and not keep_stop else ids
    text = decode(text_ids, skip_special_tokens=params.skip_special_tokens)
    if isinstance(out.stop_reason, str) and out.stop_reason in text:
        end = text.find(out.stop_reason)
        text = text[: end + len(out.stop_reason)] if keep_stop else text[:end]
    logprobs = cumulative = None
    if out.logprobs is not None:
        logprobs = logprob_objects(out.logprobs, out.logprob_ranks, decode_token)
        cumulative = float(sum(lp[t] for lp, t in zip(out.logprobs, ids)))
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=ids,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        logprobs=logprobs,
        error=out.error,
        cumulative_logprob=cumulative,
        hidden_states=out.hidden_states,
    )


def request_output(
    request_id: str,
    prompt: str | None,
    prompt_token_ids: list[int],
    top: EngineOutput,
    params: SamplingParams,
    decode: Callable[..., str],
    decode_token: Callable[[int], str | None] | None = None,
) -> RequestOutput:
    """The RequestOutput of one finished request (``error`` set when every completion
    failed); ``top`` is its EngineOutput (a parallel-sampling parent's holds its
    samples)."""
    outs = top.samples or [top]  # EngineOutput.completions
    firsts = [o.first_token_time for o in outs if o.first_token_time is not None]
    completions = [
        completion_output(j, o, params, decode, decode_token) for j, o in enumerate(outs)
    ]
    prompt_logprobs = None
    if top.prompt_logprobs is not None:
        prompt_logprobs = logprob_objects(
            top.prompt_logprobs, top.prompt_logprob_ranks, decode_token
        )
    errors = [c.error for c in completions if c.finish_reason == "error"]
    error = (errors[0] or "request failed") if errors and len(errors) == len(outs) else None
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        outputs=completions,
        metrics=RequestMetrics(
            arrival_time=min(o.arrival_time for o in outs),
            first_token_time=min(firsts) if firsts else None,
            finish_time=max(o.finish_time for o in outs),
            num_prompt_tokens=len(prompt_token_ids),
            num_generated_tokens=sum(len(o.token_ids) for o in outs),
            num_cached_tokens=max(o.num_cached_tokens for o in outs),
        ),
        error=error,
        prompt_logprobs=prompt_logprobs,
        prompt_hidden_states=top.prompt_hidden_states,
    )
