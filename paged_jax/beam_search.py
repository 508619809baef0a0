"""Beam search over the paged engine: live beams are forked requests sharing KV blocks.

``LLM.beam_search(prompts, BeamSearchParams(...))`` (vLLM-shaped) runs one
``BeamSearch`` per prompt. Each step every live beam is one decode row; its top
2 * beam_width log-probabilities come back with the step; the search picks the
next beams; each survivor is a fork of its parent's request (sharing its blocks,
copying the partial last block on write) and each loser is aborted (its blocks
freed). Nothing here imports jax.

Semantics (see docs/beam_search.md): ``semantics="hf"`` (default) follows
transformers' ``generate(num_beams=W)``: the top 2W candidates over all beams,
EOS finishes a beam only when it ranks in the top W, finished scores are
cum_logprob / generated_len ** length_penalty (EOS counted, prompt not), the
``early_stopping`` heuristic, and the W best finished beams returned.
``semantics="vllm"`` follows vLLM's ``LLM.beam_search``: any EOS among a beam's
top 2W finishes, no early stop, scores divide by the full length (prompt
included, EOS not).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

from paged_jax.constants import fail, is_int, is_number
from paged_jax.core.request import RequestStatus
from paged_jax.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from paged_jax.engine import Engine

BeamSemantics = Literal["hf", "vllm"]
SEMANTICS: tuple[str, ...] = get_args(BeamSemantics)
EARLY_STOPPING = (False, True, "never")


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """Beam search settings (vLLM's fields, plus HF's early_stopping and a semantics switch).

    Args:
        beam_width: beams kept per step (W); 2W candidates per beam come back from
            the device, so at most MAX_LOGPROBS // 2 = 10.
        max_tokens: most tokens generated per beam.
        ignore_eos: keep EOS as an ordinary token (no beam finishes early).
        temperature: passed to the engine like vLLM does; it only changes the
            discarded sample of each step, not the scores: scores use the model's
            raw log-probabilities (vLLM V1's default logprobs mode).
        length_penalty: exponent of the length that divides a finished beam's
            cum_logprob (0 ranks by cum_logprob alone).
        early_stopping: "hf" only: False (HF default heuristic), True (stop when W
            beams finished) or "never".
        semantics: "hf" (transformers' generate) or "vllm" (vLLM's LLM.beam_search).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    semantics: BeamSemantics = "hf"

    def __post_init__(self) -> None:
        if not is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            fail(self, "beam_width", f"an int in [1, {MAX_LOGPROBS // 2}]")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            fail(self, "max_tokens", "an int >= 1")
        if not isinstance(self.ignore_eos, bool):
            fail(self, "ignore_eos", "a bool")
        if not is_number(self.temperature) or not 0.0 <= self.temperature < 1e6:
            fail(self, "temperature", "a number >= 0")
        if not is_number(self.length_penalty):
            fail(self, "length_penalty", "a number")
        if not any(self.early_stopping is v or self.early_stopping == v for v in EARLY_STOPPING):
            fail(self, "early_stopping", "False, True or 'never'")
        if self.semantics not in SEMANTICS:
            fail(self, "semantics", f"one of {SEMANTICS}")


@dataclasses.dataclass
class BeamSearchSequence:
    """One returned beam.

    Attributes:
        tokens: prompt + generated token ids (an EOS that finished it included).
        cum_logprob: sum of the generated tokens' log-probabilities.
        score: the ranking score (cum_logprob divided by the semantics' length
            to the power length_penalty).
        text: the decoded tokens (prompt included, as vLLM), "" without a tokenizer.
        finish_reason: "stop" (EOS) or "length".
        logprobs: log-probability of each generated token.
        num_prompt_tokens: how many of ``tokens`` are the prompt.
    """

    tokens: list[int]
    cum_logprob: float
    score: float
    text: str = ""
    finish_reason: str = "length"
    logprobs: list[float] = dataclasses.field(default_factory=list)
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens only."""
        return self.tokens[self.num_prompt_tokens :]


@dataclasses.dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first (vLLM's BeamSearchOutput)."""

    sequences: list[BeamSearchSequence]


@dataclasses.dataclass
class _Beam:
    tokens: list[int]  # generated tokens
    cum_logprob: float
    logprobs: list[float]
    parent: int = -1  # index of the running beam it extends (this step)


class BeamSearch:
    """The search of one prompt: which beams live, which finished, when to stop.

    Pure bookkeeping: ``step`` takes every running beam's top candidates (token,
    logprob) and returns the next running beams with the index of the beam each
    extends; the engine side turns those into forks and aborts.

    Args:
        prompt_len: prompt tokens (vLLM's length penalty counts them).
        params: the settings.
        eos_token_ids: ids that finish a beam (ignored with params.ignore_eos).
        max_tokens: generated-token limit (params.max_tokens, or less when
            max_model_len is closer).
    """

    def __init__(
        self,
        prompt_len: int,
        params: BeamSearchParams,
        eos_token_ids: Sequence[int],
        max_tokens: int | None = None,
    ) -> None:
        self.prompt_len = prompt_len
        self.params = params
        self.eos = () if params.ignore_eos else tuple(eos_token_ids)
        self.max_tokens = params.max_tokens if max_tokens is None else max_tokens
        self.width = params.beam_width
        # HF keeps max(2, 1 + #eos) * W candidates so W survive even if W end in EOS.
        self.num_candidates = max(2, 1 + len(self.eos)) * self.width
        if params.semantics == "vllm":
            self.num_candidates = 2 * self.width
        if self.num_candidates > MAX_LOGPROBS:
            raise ValueError(
                f"beam_width={self.width!r} with {len(self.eos)} EOS ids needs "
                f"{self.num_candidates} candidates per beam; at most {MAX_LOGPROBS}"
            )
        self.running = [_Beam([], 0.0, [])]
        self.finished: list[tuple[float, _Beam, str]] = []
        self.cur_len = 0  # generated tokens of the running beams
        self.improvable = True
        self.done = False

    # -- scores ----------------------------------------------------------------

    def score(self, beam: _Beam) -> float:
        """The ranking score of a beam under the chosen semantics."""
        lp = self.params.length_penalty
        if self.params.semantics == "vllm":
            length = self.prompt_len + len(beam.tokens)
            if beam.tokens and beam.tokens[-1] in self.eos:
                length -= 1
        else:
            length = len(beam.tokens)
        return beam.cum_logprob / (length**lp) if length else beam.cum_logprob

    # -- one step ----------------------------------------------------------------

    def step(self, candidates: Sequence[Sequence[tuple[int, float]]]) -> list[_Beam]:
        """Advances by one token.

        Args:
            candidates: per running beam (same order as ``self.running``), its top
                (token id, logprob) pairs, best first (at least num_candidates).

        Returns:
            The new running beams (``parent`` = index of the beam each extends);
            empty once ``done``.
        """
        assert not self.done, "step() after the search finished"
        assert len(candidates) == len(self.running), "one candidate list per running beam"
        if self.params.semantics == "vllm":
            self._step_vllm(candidates)
        else:
            self._step_hf(candidates)
        return self.running

    def _step_hf(self, candidates) -> None:
        w, k = self.width, self.num_candidates
        pool = []
        for b, (beam, cands) in enumerate(zip(self.running, candidates)):
            for tok, lp in cands[:k]:
                pool.append((beam.cum_logprob + lp, b, tok, lp))
        pool.sort(key=lambda c: -c[0])  # stable: ties keep beam, then rank order
        top = pool[:k]
        last = self.cur_len + 1 >= self.max_tokens
        hits = [last or tok in self.eos for _, _, tok, _ in top]
        new_beams = [self._extend(c) for c in top]
        full = len(self.finished) >= w and self.params.early_stopping is True
        if self.improvable and not full:
            for beam, hit in zip(new_beams[:w], hits[:w]):
                if hit:  # only EOS ranked within the top W can finish (HF)
                    reason = "stop" if beam.tokens[-1] in self.eos else "length"
                    self.finished.append((self.score(beam), beam, reason))
            self.finished.sort(key=lambda f: -f[0])
            del self.finished[w:]
        self.running = [b for b, hit in zip(new_beams, hits) if not hit][:w]
        self.cur_len += 1
        if self.running and len(self.finished) >= w:
            lp = self.params.length_penalty
            never = self.params.early_stopping == "never" and lp > 0
            best_len = self.max_tokens if never else self.cur_len
            best = self.running[0].cum_logprob / best_len**lp
            if best <= self.finished[-1][0]:
                self.improvable = False
        self.done = (
            not self.improvable
            or (self.params.early_stopping is True and len(self.finished) >= w)
            or all(hits)
            or not self.running
        )
        if self.done:
            self.running = []

    def _step_vllm(self, candidates) -> None:
        new_beams = []
        for b, (beam, cands) in enumerate(zip(self.running, candidates)):
            for c in cands[: self.num_candidates]:
                nb = self._extend((beam.cum_logprob + c[1], b, c[0], c[1]))
                if nb.tokens[-1] in self.eos:
                    self.finished.append((self.score(nb), nb, "stop"))
                else:
                    new_beams.append(nb)
        new_beams.sort(key=lambda nb: -self.score(nb))
        self.running = new_beams[: self.width]
        self.cur_len += 1
        if self.cur_len >= self.max_tokens or not self.running:
            self.finished.extend((self.score(b), b, "length") for b in self.running)
            self.running = []
            self.done = True

    def _extend(self, cand) -> _Beam:
        _, b, tok, lp = cand
        beam = self.running[b]
        return _Beam(beam.tokens + [tok], beam.cum_logprob + lp, beam.logprobs + [lp], b)

    def results(self, prompt: list[int], decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        """The best W finished beams, best first."""
        assert self.done, "results() before the search finished"
        best = sorted(self.finished, key=lambda f: -f[0])[: self.width]
        return BeamSearchOutput(
            [
                BeamSearchSequence(
                    tokens=prompt + beam.tokens,
                    cum_logprob=beam.cum_logprob,
                    score=score,
                    text=decode(prompt + beam.tokens),
                    finish_reason=reason,
                    logprobs=beam.logprobs,
                    num_prompt_tokens=len(prompt),
                )
                for score, beam, reason in best
            ]
        )


def top_candidates(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k best (token, logprob) pairs of one step's logprobs dict, best first."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


# -- the engine side -------------------------------------------------------------

_search_ids = itertools.count()


@dataclasses.dataclass
class _Live:
    search: BeamSearch
    prompt: list[int]
    request_ids: list[str]  # one engine request per running beam
    prompt_embeds: Any = None  # f32[len(prompt), hidden] or None (token ids)
    step: int = 0


def _engine_params(params: BeamSearchParams, search: BeamSearch) -> SamplingParams:
    # The driver decides every token; the engine computes and reports 2W candidates.
    return SamplingParams(
        temperature=params.temperature,
        max_tokens=search.max_tokens + 1,
        ignore_eos=True,
        logprobs=search.num_candidates,
    )


def run_beam_search(
    engine: Engine,
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    *,
    decode: Callable[[list[int]], str] = lambda ids: "",
    forks: bool = True,
    on_step: Callable[[Engine], None] | None = None,
    prompt_embeds: Sequence[Any] | None = None,
) -> list[BeamSearchOutput]:
    """Runs a beam search per prompt on the engine; returns one output per prompt, in order.

    Prompts run in rounds of (max_num_seqs - 1) // W prompts, so W beams per prompt
    (plus one during forking) fit within max_num_seqs.

    Args:
        engine: an idle engine (other requests would be stepped too).
        prompts: token-id prompts.
        params: the settings.
        decode: token ids -> text for BeamSearchSequence.text.
        forks: True (default): survivors are forks of their parent's request (KV
            shared, copy-on-write). False: every beam of every step is a new
            request of its whole token list that finds its prefix through the
            prefix cache (vLLM V1's LLM.beam_search); for comparison.
        on_step: called after every engine step (memory accounting in studies).
        prompt_embeds: per prompt, f32[len(prompt), hidden_size] that replaces its
            tokens' embeddings (EngineConfig.enable_prompt_embeds; the prompt's ids are
            then placeholders), or None; forked beams share their root's rows, and a
            beam started afresh (forks=False) passes them as the first rows of its
            tokens.

    If anything raises (a failed engine step, KeyboardInterrupt), the search's live
    requests are aborted before the exception propagates, so the engine is idle again.
    """
    if engine.has_unfinished():
        raise ValueError("engine must be idle for beam search (it steps every live request)")
    max_len = engine.config.max_model_len
    for i, p in enumerate(prompts):
        if len(p) >= max_len:
            raise ValueError(f"prompts[{i}] has {len(p)} tokens; must be < max_model_len={max_len}")
    if prompt_embeds is not None and len(prompt_embeds) != len(prompts):
        raise ValueError(
            f"len(prompt_embeds)={len(prompt_embeds)} must equal len(prompts)={len(prompts)}"
        )
    embeds = list(prompt_embeds) if prompt_embeds is not None else [None] * len(prompts)
    per_round = max(1, (engine.config.max_num_seqs - 1) // params.beam_width)
    outputs: list[BeamSearchOutput | None] = [None] * len(prompts)
    started: list[str] = []  # every request id the search added or forked
    # Each step's candidates decide the next step's forks: read every step's tokens in
    # the call that ran it (an async engine would run the parents one token ahead).
    try:
        with engine.synchronous():
            for start in range(0, len(prompts), per_round):
                batch = range(start, min(len(prompts), start + per_round))
                _run_round(
                    engine, prompts, embeds, batch, params, outputs, decode, forks, on_step, started
                )
    except BaseException:
        for rid in started:
            if engine.is_live(rid):
                engine.abort_request(rid)
        raise
    return outputs  # type: ignore[return-value]


def _run_round(
    engine, prompts, embeds, batch, params, outputs, decode, forks, on_step, started
) -> None:
    """Searches the prompts of one round (indices ``batch``) to the end; every request id
    it adds or forks is appended to ``started``."""
    max_len = engine.config.max_model_len
    uid = next(_search_ids)
    live: dict[int, _Live] = {}
    for i in batch:
        prompt = list(prompts[i])
        search = BeamSearch(
            len(prompt),
            params,
            engine.eos_token_ids,
            min(params.max_tokens, max_len - len(prompt)),
        )
        rid = f"beam{uid}-{i}-0-0"
        engine_params = _engine_params(params, search)
        if not forks:
            engine_params = dataclasses.replace(engine_params, max_tokens=1)
        engine.add_request(rid, prompt, engine_params, prompt_embeds=embeds[i])
        started.append(rid)
        live[i] = _Live(search, prompt, [rid], embeds[i])
    finished: dict[str, list[dict[int, float]]] = {}
    while live:
        for out in engine.step():
            finished[out.request_id] = out.logprobs or []
        if on_step is not None:
            on_step(engine)
        for i in list(live):
            state = live[i]
            entries = [_first_entry(engine, rid, finished) for rid in state.request_ids]
            if any(e is None for e in entries):
                continue  # a beam is still prefilling (or was preempted): wait for it
            k = state.search.num_candidates
            parents = state.request_ids
            new_beams = state.search.step([top_candidates(e, k) for e in entries])
            state.step += 1
            state.request_ids = _next_requests(
                engine, state, parents, new_beams, params, uid, i, forks
            )
            started.extend(state.request_ids)
            for rid in parents:
                finished.pop(rid, None)
            if state.search.done:
                outputs[i] = state.search.results(state.prompt, decode)
                del live[i]


def _next_requests(engine, state, parents, new_beams, params, uid, i, forks) -> list[str]:
    """Engine requests of the new running beams: forks of their parents (or fresh requests).

    Losers are aborted first, then each surviving parent is forked into its children
    and aborted, so at most one request more than the beams is ever running.
    """
    children: dict[int, list[int]] = {}
    for j, beam in enumerate(new_beams):
        children.setdefault(beam.parent, []).append(j)
    for b, rid in enumerate(parents):
        if b not in children and engine.is_live(rid):
            engine.abort_request(rid)
    out = [""] * len(new_beams)
    for b, js in children.items():
        parent = parents[b]
        for j in js:
            out[j] = _start_beam(engine, state, parent, j, new_beams[j], params, uid, i, forks)
        if engine.is_live(parent):
            engine.abort_request(parent)
    return out


def _first_entry(engine, rid: str, finished) -> dict[int, float] | None:
    if rid in finished:
        logprobs = finished[rid]
    else:
        logprobs = engine.get_logprobs(rid)
    return logprobs[0] if logprobs else None


def _start_beam(engine, state, parent, j, beam, params, uid, i, forks) -> str:
    """The engine request of one new running beam."""
    rid = f"beam{uid}-{i}-{state.step}-{j}"
    tokens = state.prompt + beam.tokens
    req = engine.get_request(parent)
    if forks and req is not None and req.status == RequestStatus.RUNNING:
        outputs = tokens[req.num_prompt_tokens :]
        engine.fork_request(parent, rid, output_token_ids=outputs)
    else:
        engine_params = _engine_params(params, state.search)
        if not forks:  # vLLM V1: one max_tokens=1 request per beam and step
            engine_params = dataclasses.replace(engine_params, max_tokens=1)
        engine.add_request(rid, tokens, engine_params, prompt_embeds=state.prompt_embeds)
    return rid
