"""The generate CLI's job, made before the model loads: each prompts-file line rendered and
tokenized into a request, and the engine sized to those requests.

Doing this on the host first means a line that cannot be served (no chat template, a bad
conversation, empty text, no tokenizer) is known before any warm-up, and the step
buckets (so the warm-up) can follow the job: 8 short prompts need neither 64 sequences
nor 512 tokens per step. Host module: no jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from paged_jax.chat_template import ChatTemplate, check_messages
from paged_jax.config import EngineConfig, bucket_for
from paged_jax.constants import MIN_SEQ_BUCKET, PROMPT_BYTES_PER_TOKEN
from paged_jax.entrypoints.prompts_file import PromptLine, params_for
from paged_jax.lora import LoRARequest
from paged_jax.sampling_params import SamplingParams

NO_CHAT_TEMPLATE = (
    "the model has no chat template (no chat_template.jinja and no 'chat_template' in "
    "tokenizer_config.json): pass --chat-template FILE"
)
# The fields size_engine chooses when the command line does not.
SIZED_FIELDS = ("max_num_seqs", "max_num_batched_tokens")


@dataclasses.dataclass
class JobRequest:
    """One servable line: the prompt handed to LLM.generate_iter and its SamplingParams.

    Attributes:
        line: the prompts-file line.
        prompt: {"prompt": text, "prompt_token_ids": ids}, or {"prompt_token_ids": ids}
            for a line of token ids (checked against the vocabulary by the engine).
        params: the run's SamplingParams with the line's overrides.
        lora: the line's adapter (its "lora" key among --lora-modules), or None.
    """

    line: PromptLine
    prompt: dict[str, Any]
    params: SamplingParams
    lora: LoRARequest | None = None


def make_requests(
    lines: Sequence[PromptLine],
    base: SamplingParams,
    *,
    tokenizer: Any,
    chat_template: ChatTemplate | None,
    max_model_len: int,
    lora_modules: Mapping[str, LoRARequest] | None = None,
) -> list[JobRequest]:
    """The servable lines as requests; every other line gets its `.error` set.

    Text is tokenized as LLM.encode does (special tokens added), a conversation is
    rendered with `chat_template` and tokenized without adding them again (LLM.chat).

    Args:
        lines: the prompts file's lines (bad ones already carry an error and are skipped).
        base: the run's SamplingParams, before each line's overrides.
        tokenizer: a ``tokenizers.Tokenizer``, or None (text lines are then errors).
        chat_template: the template for "messages" lines, or None (they are errors).
        max_model_len: the run's context length; longer text is refused untokenized.
        lora_modules: --lora-modules' adapters by name (a line's "lora" key picks one).
    """
    longest = max_model_len * PROMPT_BYTES_PER_TOKEN
    requests = []
    for line in lines:
        if line.error:
            continue
        try:
            params = params_for(base, line)
            lora = lora_of(line, lora_modules or {})
            if line.kind == "prompt_token_ids":
                prompt: dict[str, Any] = {"prompt_token_ids": list(line.value)}
            else:
                text, special = _text_of(line, chat_template)
                ids = _encode(text, special, tokenizer, longest, max_model_len)
                prompt = {"prompt": text, "prompt_token_ids": ids}
        except ValueError as err:
            msg = str(err)
            line.error = msg if msg.startswith("line ") else f"line {line.line}: {msg}"
            continue
        requests.append(JobRequest(line, prompt, params, lora))
    return requests


def lora_of(line: PromptLine, lora_modules: Mapping[str, LoRARequest]) -> LoRARequest | None:
    """The adapter a line names with its "lora" key (None: the base model)."""
    if line.lora is None:
        return None
    if line.lora not in lora_modules:
        raise ValueError(
            f"lora={line.lora!r} must be one of the --lora-modules names {sorted(lora_modules)}"
        )
    return lora_modules[line.lora]


def parse_lora_modules(values: Sequence[str]) -> dict[str, LoRARequest]:
    """--lora-modules NAME=PATH ... -> {name: LoRARequest(name, i, path)}, ids 1, 2, ...

    Raises:
        ValueError: a value without "=", an empty name or path, or a repeated name.
    """
    modules: dict[str, LoRARequest] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r} must be NAME=PATH")
        if name in modules:
            raise ValueError(f"--lora-modules {value!r}: the name {name!r} is given twice")
        modules[name] = LoRARequest(name, len(modules) + 1, path)
    return modules


def _text_of(line: PromptLine, chat_template: ChatTemplate | None) -> tuple[str, bool]:
    """(prompt text, whether tokenizing it adds special tokens) of a text or chat line."""
    if line.kind != "messages":
        if not line.value:
            raise ValueError("prompt='' must be a non-empty string")
        return line.value, True
    if chat_template is None:
        raise ValueError(NO_CHAT_TEMPLATE)
    return chat_template.render(check_messages(line.value), add_generation_prompt=True), False


def _encode(text: str, special: bool, tokenizer: Any, longest: int, max_model_len: int):
    if tokenizer is None:
        raise ValueError(
            f"prompt={text[:40]!r} is a string but the model directory has no "
            "tokenizer.json: give prompt_token_ids instead"
        )
    # Refused before tokenizing (which costs ~200 bytes of memory per character).
    if len(text) > longest:
        raise ValueError(
            f"prompt of {len(text)} characters cannot fit max_model_len={max_model_len}: a "
            f"token covers at most {PROMPT_BYTES_PER_TOKEN} bytes of text, so a prompt that "
            f"fits has at most {longest} characters"
        )
    ids = tokenizer.encode(text, add_special_tokens=special).ids
    if not ids:
        raise ValueError(f"prompt={text[:40]!r} tokenizes to no tokens")
    return ids


@dataclasses.dataclass(frozen=True)
class JobSize:
    """What size_engine chose and from what.

    Attributes:
        max_num_seqs: the chosen (or given) sequences per step.
        max_num_batched_tokens: the chosen (or given) token budget per step.
        num_sequences: sequences the job can run at once (each request's n summed).
        num_prompt_tokens: prompt tokens of the whole job.
        num_requests: servable requests.
        sized: the fields chosen here (the others were given).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    num_sequences: int
    num_prompt_tokens: int
    num_requests: int
    sized: tuple[str, ...]

    def note(self) -> str | None:
        """One line on what was chosen and why; None when every size was given."""
        if not self.sized:
            return None
        default = EngineConfig()
        given = [f"--{f.replace('_', '-')} given" for f in SIZED_FIELDS if f not in self.sized]
        return (
            f"engine sized to the job ({self.num_requests} requests, {self.num_sequences} "
            f"sequences, {self.num_prompt_tokens} prompt tokens): max_num_seqs="
            f"{self.max_num_seqs}, max_num_batched_tokens={self.max_num_batched_tokens} "
            f"(defaults {default.max_num_seqs} and {default.max_num_batched_tokens}"
            + "".join(f"; {g}" for g in given)
            + "; pass --max-num-seqs / --max-num-batched-tokens to choose)"
        )


def size_engine(
    engine_args: Mapping[str, Any],
    *,
    num_sequences: int,
    num_prompt_tokens: int,
    num_requests: int | None = None,
) -> tuple[dict[str, Any], JobSize]:
    """EngineConfig arguments with the step sizes the user did not give fitted to the job.

    A step never needs more sequences than the job runs at once, nor more tokens than
    all its prompts together, so each size is the smallest that covers the job, capped
    at EngineConfig's default: max_num_seqs a power of two >= MIN_SEQ_BUCKET,
    max_num_batched_tokens one of the default config's token buckets (16, 64, 256, 512).
    Both round up, so jobs of similar size share their compiled programs.

    Args:
        engine_args: the given EngineConfig arguments; a missing or None
            max_num_seqs / max_num_batched_tokens is chosen here.
        num_sequences: sequences the job can run at once (every request's n, summed).
        num_prompt_tokens: the prompt tokens of all requests.
        num_requests: for the note; default num_sequences.

    Returns:
        (the arguments with both sizes set, what was chosen).
    """
    default = EngineConfig()
    args = {k: v for k, v in engine_args.items() if v is not None or k not in SIZED_FIELDS}
    sized = tuple(f for f in SIZED_FIELDS if args.get(f) is None)
    seqs = args.get("max_num_seqs")
    if seqs is None:
        seqs = min(default.max_num_seqs, _power_of_two_at_least(max(num_sequences, 1)))
        seqs = max(seqs, min(MIN_SEQ_BUCKET, default.max_num_seqs))
        budget = args.get("max_num_batched_tokens")
        if budget is not None:
            seqs = min(seqs, budget)  # a step holds at least one token per sequence
    tokens = args.get("max_num_batched_tokens")
    if tokens is None:
        need = max(num_prompt_tokens, 1)
        ladder = default.token_buckets
        tokens = bucket_for(need, ladder) if need <= ladder[-1] else ladder[-1]
        tokens = max(tokens, seqs)
    args.update(max_num_seqs=seqs, max_num_batched_tokens=tokens)
    size = JobSize(
        seqs,
        tokens,
        num_sequences,
        num_prompt_tokens,
        num_sequences if num_requests is None else num_requests,
        sized,
    )
    return args, size


def _power_of_two_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()
