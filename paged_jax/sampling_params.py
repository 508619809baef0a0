"""SamplingParams: how one request's tokens are chosen and when it stops (host side)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal, get_args

from paged_jax.constants import fail, is_int, is_number
from paged_jax.structured_params import StructuredOutputsParams

# The device sampler keeps a fixed number of top logprobs per row so its shape is static.
MAX_LOGPROBS = 20
# Stop token ids masked while min_tokens is unmet: a fixed width keeps the step's shape static.
MAX_MIN_TOKENS_STOP_IDS = 16
# vLLM's logprobs_mode values this engine serves (its "raw_logits" / "processed_logits" not).
LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request, validated at construction.

    Args:
        n: number of completions sampled for the prompt (they share its KV blocks).
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 (or -1) disables it.
        min_p: drop tokens whose probability is below min_p times the top one.
        seed: per-request seed; the same seed gives the same tokens whatever else
            is in the batch. None draws one from the engine's seed.
        max_tokens: most tokens to generate.
        min_tokens: stop tokens and EOS are masked until this many were generated.
        stop: strings that end the output (the stop string is not in the text
            unless include_stop_str_in_output).
        stop_token_ids: token ids that end the output (in addition to EOS). Like
            EOS, the stop token stays in token_ids but its text is left out of text
            unless include_stop_str_in_output.
        ignore_eos: keep generating past EOS.
        logprobs: return this many top logprobs per generated token (plus the
            sampled token's own); None returns none.
        prompt_logprobs: return this many top logprobs per prompt token (plus the
            prompt token's own) from the raw model distribution; None returns none.
            The request then never reads the prefix cache (every prompt position
            must be computed), as in vLLM, unless prompt_logprobs_tail limits them.
        prompt_logprobs_tail: with prompt_logprobs: only the last this many prompt
            tokens get entries (the others None), so the prompt's head may come from
            the prefix cache (lm-eval's loglikelihood scores a continuation after a
            context many requests share); at most len(prompt) - 1 count. None: every
            prompt token.
        presence_penalty: subtracted once from the logit of every token already in
            the output (vLLM/OpenAI semantics); in [-2, 2], 0 disables it.
        frequency_penalty: subtracted from a token's logit once per occurrence in
            the output; in [-2, 2], 0 disables it.
        repetition_penalty: tokens in the prompt or the output get their logit
            divided by it when positive, multiplied when negative (Hugging Face's
            RepetitionPenaltyLogitsProcessor, as vLLM); > 0, 1 disables it.
        include_stop_str_in_output: keep the matched stop string (or the stop
            token's text) at the end of the output text.
        skip_special_tokens: leave special tokens out of the decoded text.
        structured_outputs: a constraint the output must satisfy (JSON schema, regex,
            choice, grammar; docs/structured_outputs.md), or None.
        logprobs_mode: which distribution ``logprobs`` (the sampled token's and the top
            ones) are read from (vLLM's name and values): "raw_logprobs", the model's
            log-softmax (after a structured-outputs mask only); "processed_logprobs",
            the distribution actually sampled from: after min_tokens bans, penalties,
            temperature (not for greedy rows), top-k, top-p and min-p (-inf outside the
            kept set). Prompt logprobs stay raw. Not with speculative decoding yet.
        return_hidden_states: return the residual stream of the engine's
            EngineConfig.hidden_state_layers as RequestOutput.prompt_hidden_states and
            CompletionOutput.hidden_states ({layer: f32[num_tokens, hidden_size]}). The
            request then never reads the prefix cache (every prompt row is computed).
        steering_vectors: {layer: vector of hidden_size floats} added to the residual
            stream after that decoder layer (one of the engine's
            EngineConfig.steering_layers) for every token of the request, prompt and
            generated. Stored as a tuple of (layer, tuple of floats) pairs in layer order,
            so the params stay hashable; None: unsteered.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_tail: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logprobs_mode: LogprobsMode = "raw_logprobs"
    return_hidden_states: bool = False
    steering_vectors: tuple[tuple[int, tuple[float, ...]], ...] | None = None

    def __post_init__(self) -> None:
        # Normalise list/str inputs to tuples so the object stays hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        elif isinstance(self.stop, Sequence):
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", ())
        elif isinstance(self.stop_token_ids, Sequence):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

        if not is_int(self.n) or self.n < 1:
            fail(self, "n", "an int >= 1")
        if not is_number(self.temperature) or not 0.0 <= self.temperature < 1e6:
            fail(self, "temperature", "a number >= 0 (0 means greedy)")
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail(self, "top_p", "in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            fail(self, "top_k", "an int >= 0 (0 or -1 disables it)")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail(self, "min_p", "in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**32):
            fail(self, "seed", "None or an int in [0, 2**32)")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            fail(self, "max_tokens", "an int >= 1")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            fail(self, "min_tokens", f"an int in [0, max_tokens={self.max_tokens}]")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            fail(self, "stop", "a string or a list of non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail(self, "stop_token_ids", "a list of non-negative ints")
        if self.min_tokens > 0 and len(self.stop_token_ids) > MAX_MIN_TOKENS_STOP_IDS // 2:
            fail(
                self,
                "stop_token_ids",
                f"at most {MAX_MIN_TOKENS_STOP_IDS // 2} ids when min_tokens > 0",
            )
        if not isinstance(self.ignore_eos, bool):
            fail(self, "ignore_eos", "a bool")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                fail(self, name, f"None or an int in [0, {MAX_LOGPROBS}]")
        tail = self.prompt_logprobs_tail
        if tail is not None and (not is_int(tail) or tail < 1):
            fail(self, "prompt_logprobs_tail", "None or an int >= 1")
        if tail is not None and self.prompt_logprobs is None:
            fail(self, "prompt_logprobs_tail", "None unless prompt_logprobs is set")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value):
                fail(self, name, "a number in [-2, 2]")
            if not -2.0 <= value <= 2.0:
                fail(self, name, "in [-2, 2]")
        rp = self.repetition_penalty
        if not is_number(rp) or not 0.0 < rp < 1e6:
            fail(self, "repetition_penalty", "a number > 0 (1 disables it)")
        for name in ("include_stop_str_in_output", "skip_special_tokens", "return_hidden_states"):
            if not isinstance(getattr(self, name), bool):
                fail(self, name, "a bool")
        self._normalise_steering_vectors()
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            fail(self, "structured_outputs", "None or a StructuredOutputsParams")
        if self.logprobs_mode not in LOGPROBS_MODES:
            fail(self, "logprobs_mode", f"one of {LOGPROBS_MODES}")

    def _normalise_steering_vectors(self) -> None:
        vectors = self.steering_vectors
        if vectors is None:
            return
        pairs = vectors.items() if isinstance(vectors, dict) else vectors
        want = "None or {layer (int): vector (a non-empty sequence of finite floats)}"
        try:
            pairs = [(k, v) for k, v in pairs]
        except (TypeError, ValueError):
            fail(self, "steering_vectors", want)
        out = []
        for layer, vector in pairs:
            if isinstance(layer, str) and layer.lstrip("-").isdigit():  # a JSON object's key
                layer = int(layer)
            if not is_int(layer):
                fail(self, "steering_vectors", want)
            try:
                values = tuple(float(x) for x in vector)
            except (TypeError, ValueError):
                fail(self, "steering_vectors", want)
            if not values or not all(math.isfinite(x) for x in values):
                fail(self, "steering_vectors", want)
            out.append((int(layer), values))
        layers = [layer for layer, _ in out]
        if not out or len(set(layers)) != len(layers):
            fail(self, "steering_vectors", want + " with distinct layers")
        object.__setattr__(self, "steering_vectors", tuple(sorted(out)))

    @property
    def has_penalties(self) -> bool:
        """True when any of presence, frequency or repetition penalty is active."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token."""
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int:
        """top_k with both "disabled" spellings (0 and -1) mapped to 0."""
        return max(self.top_k, 0)
