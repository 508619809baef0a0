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

This module keeps one parent's bookkeeping (ids, per-sample settings, finished
samples, the merged output); the Engine runs the requests. Pure Python; never imports jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from paged_jax.outputs import EngineOutput
from paged_jax.sampling_params import SamplingParams

CARRIER_SUFFIX = "__prefill"
# The carrier's sampled token is discarded (greedy is enough); ignore_eos and a second
# token keep it running until the samples are forked from it.
CARRIER_PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
# When samples end differently, the parent reports the first of these any sample has.
_REASON_ORDER = ("stop", "length", "abort")


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
    ) -> None:
        assert params.n > 1, "an n == 1 request is a plain request, never a parent"
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
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
        )
