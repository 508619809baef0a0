"""PagedJaxLM: EleutherAI lm-evaluation-harness's ``LM`` interface over ``paged_jax.LLM``.

Importing this module registers the model name ``paged-jax`` with lm-eval; the
``paged-jax-eval`` command (paged_jax.entrypoints.eval_cli) imports it, then runs lm-eval's
own CLI. docs/evaluation.md has the command, the model args and the training-loop use.

Every score comes from prompt logprobs: a request (context + continuation) asks for the
logprobs of its last len(continuation) prompt tokens only (SamplingParams.prompt_logprobs_tail),
so its context may come from the prefix cache. Requests that share a context are sent in
two waves: one per context first (it computes and caches the context's blocks), then the
others (they read them).
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    maybe_truncate,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from paged_jax.llm import LLM
from paged_jax.sampling_params import SamplingParams

MODEL_NAME = "paged-jax"
# The engine holds one more prompt token than lm-eval's context window (a scored window is
# max_length inputs + the last target token, which the engine takes as a prompt token) and
# needs room for the one token every request generates: max_model_len = max_length + 2.
ENGINE_EXTRA_TOKENS = 2
# Generation kwargs lm-eval tasks pass that map onto SamplingParams fields of the same name.
_SAMPLING_KWARGS = (
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
)


def _batch_size(value: Any) -> int | None:
    """lm-eval's batch_size ("auto", "auto:N", an int or its string) -> None (auto) or N."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return None
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = 0
    if isinstance(value, bool) or size < 1:
        raise ValueError(f"batch_size={value!r} must be 'auto' or an int >= 1")
    return size


@register_model(MODEL_NAME)
class PagedJaxLM(TemplateLM):
    """lm-eval's model ``paged-jax``: loglikelihood, rolling loglikelihood and generation.

    Args (lm-eval's vLLM backend's spelling where one applies):
        pretrained: a Hugging Face model directory (with tokenizer.json).
        llm: an existing ``paged_jax.LLM`` instead (a training loop's live weights:
            ``LLM.update_weights`` then evaluate); no engine argument may come with it.
        dtype: the weights' dtype ("auto": bfloat16 on GPU/TPU, float32 on CPU).
        max_model_len: lm-eval's context window (its ``max_length``); the engine is built
            with two more positions (ENGINE_EXTRA_TOKENS). None: the model's limit - 2.
            ``max_length`` is the vLLM backend's other spelling of it.
        tensor_parallel_size: devices the model is split over (one process).
        data_parallel_size: only 1; more is refused (see __init__).
        max_num_seqs: the engine's batch (sequences per step).
        seed: the engine's seed; sampled generations use seed + request index.
        batch_size: "auto" sends every request of a call to the engine at once (it
            schedules them max_num_seqs at a time); an int N sends N at a time.
        max_gen_toks: generated tokens when a task sets none.
        add_bos_token: force (True) or forbid (False) the tokenizer's special tokens when
            encoding; None: the tokenizer's default, off when the text starts with BOS.
        prefix_token_id: the token an empty context or a rolling window starts from
            (default BOS, else EOS).
        enable_prefix_caching: share contexts through the prefix cache (default True).
        chat_template: Jinja text for lm-eval's --apply_chat_template instead of the
            checkpoint's (LLM.render_chat's chat_template).
        **engine_args: other EngineConfig fields (block_size, num_kv_blocks, ...).

    lm-eval also passes ``device`` and ``max_batch_size``: accepted and unused (the
    engine places the model; batches are the engine's).
    """

    def __init__(
        self,
        pretrained: str | pathlib.Path | None = None,
        *,
        llm: LLM | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_length: int | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        max_num_seqs: int | None = None,
        seed: int = 1234,
        batch_size: int | str = "auto",
        max_batch_size: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        enable_prefix_caching: bool = True,
        chat_template: str | None = None,
        device: str | None = None,
        **engine_args: Any,
    ):
        super().__init__()
        del max_batch_size, device  # lm-eval's generic arguments; the engine batches and places
        if data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size={data_parallel_size!r} must be 1: PagedJaxLM runs one "
                "engine in this process (split the model with tensor_parallel_size, or run "
                "one paged-jax-eval per device on a share of the tasks)"
            )
        self.batch_size_per_call = _batch_size(batch_size)
        if max_length is not None:
            if max_model_len is not None and int(max_model_len) != int(max_length):
                raise ValueError(
                    f"max_length={max_length!r} and max_model_len={max_model_len!r} must "
                    "agree (two spellings of lm-eval's context window)"
                )
            max_model_len = max_length
        if llm is not None:
            given = dict(engine_args, pretrained=pretrained, max_model_len=max_model_len)
            given.update(max_num_seqs=max_num_seqs)
            extra = sorted(k for k, v in given.items() if v is not None)
            if extra:
                raise ValueError(
                    f"{extra[0]}={given[extra[0]]!r} must not be given with llm=: the LLM "
                    "passed in is already built"
                )
            if not isinstance(llm, LLM):
                raise ValueError(f"llm={llm!r} must be a paged_jax.LLM")
            self.llm = llm
            self.model_name = type(llm.model).__name__
        else:
            if pretrained is None:
                raise ValueError("pretrained=None: pass a model directory or llm=")
            if max_model_len is not None:
                max_model_len = int(max_model_len) + ENGINE_EXTRA_TOKENS
            if max_num_seqs is not None:
                engine_args["max_num_seqs"] = int(max_num_seqs)
            self.llm = LLM(
                str(pretrained),
                dtype=dtype,
                max_model_len=max_model_len,
                tensor_parallel_size=int(tensor_parallel_size),
                seed=int(seed),
                enable_prefix_caching=bool(enable_prefix_caching),
                **engine_args,
            )
            self.model_name = str(pretrained)
        if self.llm.get_tokenizer() is None:
            raise ValueError(
                "the model has no tokenizer (tokenizer.json): lm-eval sends text, pass a "
                "model directory with one or an LLM built with tokenizer="
            )
        self.seed = int(seed)
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.given_chat_template = chat_template
        config = self.llm.model.config
        self.bos_token_id: int | None = getattr(config, "bos_token_id", None)
        eos = tuple(getattr(config, "eos_token_ids", ()) or ())
        if not eos:
            raise ValueError(f"the model {self.model_name!r} names no eos_token_id in its config")
        self._eot_token_id = int(eos[0])

    # ------------------------------------------------------------ lm-eval's properties
    @property
    def eot_token_id(self) -> int:
        return self._eot_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return int(self.custom_prefix_token_id)
        return self.bos_token_id if self.bos_token_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        """lm-eval's context window: the engine's max_model_len - ENGINE_EXTRA_TOKENS."""
        return self.llm.config.max_model_len - ENGINE_EXTRA_TOKENS

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.model_name.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The chat template's source (lm-eval hashes it into its cache keys)."""
        if self.given_chat_template is not None:
            return self.given_chat_template
        template = self.llm.chat_template
        return None if template is None else template.source

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The conversation rendered by the checkpoint's template (LLM.render_chat); an open
        assistant turn continues the last message, as lm-eval's hf backend does."""
        rendered = self.llm.render_chat(
            chat_history,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
            chat_template=self.given_chat_template,
        )
        return rendered[0]["prompt"]

    # ------------------------------------------------------------ tokens
    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """Token ids of ``string``; special tokens as lm-eval's hf backend adds them."""
        if add_special_tokens is None:
            add_special_tokens = True if self.add_bos_token is None else self.add_bos_token
            if self.bos_token_id is not None:
                bos = self.llm.decode_token(self.bos_token_id)
                if bos and string.startswith(bos):
                    add_special_tokens = False  # a chat template wrote BOS already
        ids = self.llm.encode(string, add_special_tokens=bool(add_special_tokens))
        left = kwargs.get("left_truncate_len")
        return ids[-left:] if left else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.llm.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------ scoring
    def _score(
        self, sequences: list[tuple[list[int], int]], disable_tqdm: bool = True
    ) -> list[tuple[float, bool]]:
        """(token ids, K) -> (summed logprob of the last K tokens, all of them greedy).

        Sequences sharing everything before their last K tokens (more than a block) form
        a group; a first wave sends one of each group, a second the others, so these read
        the shared blocks the first wave cached.
        """
        first_of: dict[tuple[int, ...], int] = {}
        waves: tuple[list[int], list[int]] = ([], [])
        block_size = self.llm.config.block_size
        for i, (ids, k) in enumerate(sequences):
            head = tuple(ids[:-k])
            later = len(head) > block_size and head in first_of  # a full block to share
            waves[later].append(i)
            first_of.setdefault(head, i)
        results: list[tuple[float, bool] | None] = [None] * len(sequences)
        for wave in waves:
            size = self.batch_size_per_call or max(len(wave), 1)
            for start in range(0, len(wave), size):
                chunk = wave[start : start + size]
                params = [
                    SamplingParams(
                        temperature=0.0,
                        max_tokens=1,
                        prompt_logprobs=0,
                        prompt_logprobs_tail=sequences[i][1],
                    )
                    for i in chunk
                ]
                outs = self.llm.generate(
                    [sequences[i][0] for i in chunk], params, use_tqdm=not disable_tqdm
                )
                for i, out in zip(chunk, outs):
                    ids, k = sequences[i]
                    total, greedy = 0.0, True
                    for token, entry in zip(ids[-k:], out.prompt_logprobs[-k:]):
                        logprob = entry[token]
                        total += logprob.logprob
                        greedy = greedy and logprob.rank == 1
                    results[i] = (total, greedy)
        return results  # type: ignore[return-value]

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Scores (context, continuation) pairs; a pair longer than max_length + 1 tokens
        loses its context's oldest tokens (as lm-eval's hf backend truncates)."""
        sequences = []
        for _, context_ids, continuation_ids in requests:
            if not 0 < len(continuation_ids) <= self.max_length:
                raise ValueError(
                    f"len(continuation)={len(continuation_ids)} tokens must be in "
                    f"[1, max_length={self.max_length}]"
                )
            whole = (list(context_ids) + list(continuation_ids))[-(self.max_length + 1) :]
            sequences.append((whole, len(continuation_ids)))
        results = self._score(sequences, disable_tqdm=kwargs.get("disable_tqdm", True))
        for (pair, *_), result in zip(requests, results):
            if pair is not None:
                self.cache_hook.add_partial("loglikelihood", pair, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Whole-document logprobs over lm-eval's rolling windows of max_length tokens
        (lm_eval.utils.get_rolling_token_windows, made disjoint), every window of every
        document in one batch."""
        sequences: list[tuple[list[int], int]] = []
        owners: list[int] = []
        for doc, (string,) in enumerate(req.args for req in requests):
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, targets in map(lm_utils.make_disjoint_window, windows):
                sequences.append((context + targets, len(targets)))
                owners.append(doc)
        totals = [0.0] * len(requests)
        for doc, (logprob, _) in zip(owners, self._score(sequences, disable_tqdm)):
            totals[doc] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------ generation
    def _generation_params(
        self, index: int, gen_kwargs: dict[str, Any]
    ) -> tuple[SamplingParams, list[str]]:
        """lm-eval's gen_kwargs -> (SamplingParams, stop strings to cut the text at)."""
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        eos = self.llm.decode_token(self.eot_token_id)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = kwargs.pop("max_gen_toks")
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 0.0))  # 0.0 unless do_sample
        sampling = {name: kwargs.pop(name) for name in _SAMPLING_KWARGS if name in kwargs}
        if kwargs:
            name = sorted(kwargs)[0]
            raise ValueError(
                f"gen_kwargs {name}={kwargs[name]!r} is not a generation setting paged-jax "
                f"serves; expected until, max_gen_toks, do_sample, temperature or one of "
                f"{_SAMPLING_KWARGS}"
            )
        if "seed" not in sampling:
            sampling["seed"] = (self.seed + index) % 2**32
        params = SamplingParams(
            temperature=temperature if do_sample else 0.0,
            max_tokens=max_gen_toks,
            stop=[s for s in until if s and s != eos],  # EOS itself ends a request already
            **sampling,
        )
        return params, until

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Generations cut at the first stop string; a context longer than
        max_length - max_gen_toks loses its oldest tokens (as the hf backend)."""
        prompts, params, stops = [], [], []
        for i, (context, gen_kwargs) in enumerate(req.args for req in requests):
            p, until = self._generation_params(i, gen_kwargs)
            ids, _ = maybe_truncate(
                self.tok_encode(context), p.max_tokens, self.max_length, verbose=False
            )
            prompts.append(ids)
            params.append(p)
            stops.append(until)
        size = self.batch_size_per_call or max(len(prompts), 1)
        texts: list[str] = []
        for start in range(0, len(prompts), size):
            outs = self.llm.generate(
                prompts[start : start + size],
                params[start : start + size],
                use_tqdm=not disable_tqdm,
            )
            for out, until in zip(outs, stops[start : start + size]):
                # The engine's text is cut at the stop string already; decoding the tokens
                # again and cutting there gives lm-eval's text for a stop inside the
                # last token too.
                text = self.tok_decode(out.outputs[0].token_ids)
                texts.append(postprocess_generated_text(text, until, None))
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts
