"""Parallel sampling (SamplingParams.n > 1) with forks: one prefill, n children.

The prompt minus its last token is prefilled once by a carrier request. Right after
that step the n children are forked from it (sharing every block, the partial last
one included) and the carrier is aborted; each child then computes the last prompt
token as a one-token decode row and samples its own first token with its own seed.
Its write into the shared partial block is copied on write (n - 1 copies; the last
child writes in place). Without forks each child would prefill the whole prompt,
finding only its full blocks in the prefix cache. Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from paged_jax.core.request import RequestStatus
from paged_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_jax.engine import Engine

CARRIER_SUFFIX = "__prefill"


class ForkedParallelSampling:
    """Submits n-way requests through carriers and forks the children after the prefill.

    Call ``after_step()`` after every ``engine.step()``.

    Args:
        engine: the engine the requests run on.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # carrier id -> (prompt, [(child id, child params)])
        self.pending: dict[str, tuple[list[int], list[tuple[str, SamplingParams]]]] = {}

    def submit(
        self, request_id: str, prompt: list[int], children: list[tuple[str, SamplingParams]]
    ) -> list[str]:
        """Queues the children of one prompt; returns the engine ids it added (for withdrawal).

        Raises:
            ValueError: the engine refused the prompt (nothing of it stays queued).
        """
        if len(prompt) < 2 or len(children) < 2:
            added = []
            try:
                for child_id, params in children:
                    self.engine.add_request(child_id, prompt, params)
                    added.append(child_id)
            except ValueError:
                for cid in added:
                    self.engine.abort_request(cid)
                raise
            return added
        carrier = request_id + CARRIER_SUFFIX
        # Validate the real prompt first, so errors name its length, not the carrier's
        # (a fixed seed: the probe must not draw from the engine's seed stream).
        probe = dataclasses.replace(children[0][1], seed=0)
        self.engine.add_request(children[0][0], prompt, probe)
        self.engine.abort_request(children[0][0])
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        self.engine.add_request(carrier, prompt[:-1], params)
        self.pending[carrier] = (prompt, children)
        return [carrier]

    def withdraw(self, request_id: str) -> None:
        """Aborts a prompt's prefill request (if it has one) before it ran; forgets it."""
        carrier = request_id + CARRIER_SUFFIX
        if self.pending.pop(carrier, None) is not None and carrier in self.engine._states:
            self.engine.abort_request(carrier)

    def after_step(self) -> None:
        """Forks the children of every carrier whose prefill just finished."""
        engine = self.engine
        for carrier, (prompt, children) in list(self.pending.items()):
            req = engine.scheduler.requests.get(carrier)
            alive = req is not None and req.status == RequestStatus.RUNNING
            if alive and req.num_output_tokens < 1:
                continue  # still prefilling
            for child_id, params in children:
                try:
                    if not alive:
                        raise ValueError("the carrier ended before its prefill")
                    engine.fork_request(
                        carrier, child_id, prompt_token_ids=prompt, sampling_params=params
                    )
                except ValueError:
                    # Batch full (or the carrier failed): a plain request, which still
                    # finds the prompt's full blocks in the prefix cache.
                    engine.add_request(child_id, prompt, params)
            if carrier in engine._states:
                engine.abort_request(carrier)
            del self.pending[carrier]
