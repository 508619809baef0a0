"""LLM: offline batched generation over a Hugging Face checkpoint directory (vLLM-style API).

llm = LLM("path/to/hf_model", max_num_seqs=64)
outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))
outs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))
for index, out in llm.generate_iter(prompts, params): ...   # finish order, errors isolated

Calls from several threads are serialised step by step by one lock, and each call gets
exactly its own outputs; an exception (Ctrl-C included) withdraws the call's requests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import pathlib
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from paged_jax.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from paged_jax.chat_template import ChatTemplate, check_messages, model_special_tokens
from paged_jax.compile_cache import (
    enable_compile_cache,
    executable_cache_dir,
    resolve_compile_cache_dir,
)
from paged_jax.config import EngineConfig
from paged_jax.constants import PROMPT_BYTES_PER_TOKEN, is_int
from paged_jax.distributed import (
    broadcast_from_primary,
    check_same_config,
    is_primary,
    settings_from,
)
from paged_jax.distributed import initialize as initialize_distributed
from paged_jax.engine import Engine
from paged_jax.lora import LoRARequest, lora_requests_per_prompt
from paged_jax.model_api import PagedModel, check_paged_model
from paged_jax.output_processor import request_output
from paged_jax.outputs import EngineOutput, RequestMetrics, RequestOutput
from paged_jax.sampling_params import SamplingParams

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
_PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_embeds")


def _resolve_dtype(dtype: str) -> str:
    if dtype != "auto":
        return dtype
    import jax

    return "bfloat16" if jax.default_backend() in ("gpu", "tpu") else "float32"


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        return dtype
    import numpy as np

    try:
        return np.dtype(dtype).name
    except TypeError:
        return getattr(dtype, "__name__", str(dtype))


# vLLM's LLM(...) switches whose meaning does not carry over: why each is ignored.
_IGNORED_VLLM_SWITCHES = {
    "enforce_eager": "the engine always compiles its step (one jitted program per step "
    "shape, built at warm-up)",
    "trust_remote_code": "paged_jax never runs code from a checkpoint (its architectures "
    "are implemented here)",
}


def _accept_vllm_switches(**switches: Any) -> None:
    """Checks vLLM's bool switches; warns once for each one set to True (it is ignored)."""
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be a bool")
        if value:
            warnings.warn(
                f"{name}=True is ignored: {_IGNORED_VLLM_SWITCHES[name]}",
                UserWarning,
                stacklevel=3,
            )


class LLM:
    """Loads a checkpoint (or takes your model) and serves batches of prompts through the engine.

    Args:
        model: a Hugging Face model directory (config.json, *.safetensors, and
            tokenizer.json for string prompts), or any object satisfying
            ``paged_jax.PagedModel`` (a model of your own; see docs/research_integration.md).
        tokenizer: for a model object only: a ``tokenizers.Tokenizer`` or a path to a
            tokenizer.json; without one, prompts must be token ids.
        warmup: compile every step bucket at construction (so generate never compiles).
        compile_cache: JAX's persistent compilation cache and the engine's serialized
            step programs (a warm start loads them: paged_jax.compile_cache): False
            (default) leaves JAX's setting alone and keeps programs in memory, True uses
            $PAGED_JAX_COMPILE_CACHE or ~/.cache/paged_jax/jax_compile_cache, a path
            chooses the directory. PAGED_JAX_COMPILE_CACHE=0 turns it off whatever is
            passed.
        chat_template: Jinja text used by chat() and render_chat() when the call passes
            none; it overrides the checkpoint's chat template. Like the checkpoint's own
            (and as in transformers and vLLM), it sees the checkpoint's special tokens
            ({{ bos_token }}, {{ eos_token }}, ...: tokenizer_config.json, else
            special_tokens_map.json); with a model object there are none.
        enforce_eager: vLLM's switch, accepted and ignored (True warns once): the
            engine always runs its step as one compiled program.
        trust_remote_code: vLLM's switch, accepted and ignored (True warns once): no
            checkpoint code is ever run (every architecture is implemented here).
        **engine_args: EngineConfig fields (block_size, num_kv_blocks, kv_cache_memory,
            gpu_memory_utilization (vLLM's: the share of the device's memory for
            weights + KV cache + activations; ignored with a warning on CPU), max_num_seqs, max_num_batched_tokens, max_model_len, enable_prefix_caching,
            preemption_mode, scheduling_policy, attention_backend, dtype, kv_cache_dtype,
            seed, hash_algo, tensor_parallel_size, quantization: "int8" / "fp8" 8-bit
            weights, quantize_embeddings: the embedding and LM head 8-bit too,
            docs/quantization.md). ``kv_cache_dtype="fp8_e4m3"`` (or
            "fp8_e5m2") stores the KV cache in fp8 with the checkpoint's k_scale/v_scale,
            else 1.0.

    Threads and failures: an LLM may be shared by several threads. One lock serialises
    every engine call, a step at a time, so concurrent generate / generate_iter /
    chat calls share the engine's batches and each returns exactly its own requests'
    outputs (beam_search holds the lock for its whole run). A call that raises (a
    failed device step, KeyboardInterrupt in a notebook) aborts its own unfinished
    requests before the exception propagates; the engine rolls the failed step back
    (``Engine.step``), so the next call serves correctly. Closing a generate_iter
    iterator early (``close()``, leaving its for loop, dropping it) aborts its
    unfinished requests too.

    Raises:
        ValueError: an unknown engine argument or a bad value (naming it).
        FileNotFoundError: the model directory or its config.json is missing.
        TypeError: a model object that does not satisfy PagedModel (naming the member).
    """

    def __init__(
        self,
        model: str | pathlib.Path | PagedModel,
        *,
        tokenizer: Any = None,
        warmup: bool = True,
        compile_cache: bool | str | pathlib.Path = False,
        chat_template: str | None = None,
        enforce_eager: bool = False,
        trust_remote_code: bool = False,
        **engine_args: Any,
    ):
        _accept_vllm_switches(enforce_eager=enforce_eager, trust_remote_code=trust_remote_code)
        unknown = sorted(set(engine_args) - _ENGINE_FIELDS)
        if unknown:
            raise ValueError(
                f"engine argument {unknown[0]}={engine_args[unknown[0]]!r} is not an "
                f"EngineConfig field; expected one of {sorted(_ENGINE_FIELDS)}"
            )
        config = EngineConfig(**engine_args)
        job = settings_from(config)
        if job is not None:  # join the job before anything asks jax for a device
            initialize_distributed(job)
            check_same_config(config)  # engines sized alike, or one line on every process
        # With several processes, process 0's inputs are every process's (admission).
        self.is_multiprocess = job is not None
        from pallas_kernels.backend import check_backend

        check_backend(config.attention_backend)
        cache_dir = resolve_compile_cache_dir(compile_cache) if compile_cache else None
        self.compile_cache_dir = None if cache_dir is None else enable_compile_cache(cache_dir)
        self.tokenizer = None
        # The variables a chat template sees (bos_token, ...): the checkpoint's.
        self._special_tokens: dict[str, str] = {}
        self.chat_template: ChatTemplate | None = None
        if isinstance(model, (str, pathlib.Path)):
            path = pathlib.Path(model)
            if not path.is_dir():
                raise FileNotFoundError(
                    f"model={str(model)!r} must be a Hugging Face model directory"
                )
            from paged_jax.models import load_model

            dtype = _resolve_dtype(config.dtype)
            config = dataclasses.replace(config, dtype=dtype)
            mesh = None
            if config.tensor_parallel_size > 1:  # place each weight split, straight from disk
                from paged_jax.worker.sharding import make_mesh

                mesh = make_mesh(config.tensor_parallel_size)
            self.model = load_model(
                path,
                dtype=dtype,
                attention_backend=config.attention_backend,
                mesh=mesh,
                quantization=config.quantization,
                quantize_embeddings=config.quantize_embeddings,
            )
            # load_weights takes tensors of the checkpoint's shapes; a model loaded onto a
            # mesh repeats its KV heads when they are fewer than the devices.
            self._checkpoint_config = self.model.config
            if mesh is not None:
                from paged_jax.models.loader import family_config

                self._checkpoint_config = family_config(path, dtype)[1]
            if tokenizer is None and (path / "tokenizer.json").is_file():
                tokenizer = path / "tokenizer.json"
            self._special_tokens = model_special_tokens(path)
            if chat_template is None:
                self.chat_template = ChatTemplate.from_model_dir(path)
        else:
            check_paged_model(model)
            if config.quantization is not None:  # a quantized copy; the caller's model stays
                from paged_jax.models.quantized_model import is_quantized, quantize_model

                if not is_quantized(model):
                    model = quantize_model(
                        model, config.quantization, embeddings=config.quantize_embeddings
                    )
            self.model = model
            self._checkpoint_config = getattr(model, "config", None)  # never split here
            config = dataclasses.replace(config, dtype=_dtype_name(model.config.dtype))
        if chat_template is not None:
            self.chat_template = self._given_template(chat_template)
        if isinstance(tokenizer, (str, pathlib.Path)):
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(tokenizer))
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}  # Logprob.decoded_token, per token id
        self.engine = Engine(
            self.model,
            config,
            detokenize=None if self.tokenizer is None else self.decode,
            # A model loaded here from a path is the engine's to consume (its layer weights
            # are freed once stacked for the scan); a model object passed in stays usable.
            owns_model=isinstance(model, (str, pathlib.Path)),
            executable_cache_dir=executable_cache_dir(self.compile_cache_dir),
            tokenizer=self.tokenizer,  # structured outputs compile against its vocabulary
        )
        self.config = self.engine.config
        self._ids = itertools.count()
        # Serialises engine access between threads; held one step at a time, never
        # across a generate_iter yield.
        self._lock = threading.Lock()
        self._holder: int | None = None  # the thread inside _locked(), if any
        # Ids some live call still waits for, and finished outputs of such requests
        # that another call's step produced (kept for their own call).
        self._claimed: set[str] = set()
        self._unclaimed: dict[str, EngineOutput] = {}
        # Ids of calls that ended early (an exception, a closed iterator), aborted at
        # the start of every locked section.
        self._abandoned: list[str] = []
        self._live: Any = None  # paged_jax.worker.live_weights.LiveWeights, on first use
        # A model loaded here is the engine's: it follows the served weights (no copy),
        # so no stale copy stays on the device; a model passed in is left as it was.
        self._owns_model = isinstance(model, (str, pathlib.Path))
        if warmup:
            self._warm_up_live_weights()
            self.engine.warmup()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (the tokenizer's post-processor adds BOS etc. by default);
        ValueError when there is no tokenizer."""
        if self.tokenizer is None:
            raise ValueError(
                f"prompt={text[:40]!r} is a string but the model directory has no "
                "tokenizer.json: pass token ids instead"
            )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; "" when there is no tokenizer."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def get_tokenizer(self) -> Any:
        """The tokenizer this LLM encodes prompts and decodes outputs with (vLLM's
        LLM.get_tokenizer): a ``tokenizers.Tokenizer`` (``encode(text).ids``,
        ``decode(ids)``), or None when the model has none (prompts must be token ids,
        texts are "")."""
        return self.tokenizer

    def decode_token(self, token_id: int) -> str | None:
        """One token's text, special tokens included (Logprob.decoded_token); None
        without a tokenizer."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates completions for every prompt; outputs come back in input order.

        Input is checked before anything runs, as in vLLM: one prompt that cannot be
        served (empty, too long, a token id outside the vocabulary, text without a
        tokenizer, a bad SamplingParams) raises and no prompt is run. A request that
        fails while running (non-finite logits, say) does not raise: its completions
        end with finish_reason "error" and, when all of them did, the RequestOutput's
        ``error`` says why. ``generate_iter`` serves the others instead of raising,
        returning a rejected prompt as a RequestOutput with ``error`` set.

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one SamplingParams for all prompts or one per prompt.
            use_tqdm: show a progress bar with running output tokens/s.
            lora_request: a paged_jax.LoRARequest for every prompt, or one (or None)
                per prompt; None serves the base model (needs enable_lora=True).

        Raises:
            ValueError: a bad prompt, SamplingParams or adapter, the message starting
                with its index (``prompts[3]: ...``); nothing is run in that case.
        """
        prompts, sampling_params, lora_request = self._from_primary(
            prompts, sampling_params, lora_request
        )
        use_tqdm = use_tqdm and (not self.is_multiprocess or is_primary())
        prompts = self._as_prompt_list(prompts)
        params = self._as_params_list(sampling_params, len(prompts))
        loras = (
            [None] * len(prompts)
            if lora_request is None
            else lora_requests_per_prompt(lora_request, len(prompts))
        )
        submitted: list[tuple[str, str | None, list[int]]] = []
        with self._locked():
            try:
                for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras)):
                    submitted.append(self._submit(i, prompt, p, lora))
            except ValueError:
                for rid, *_ in submitted:  # nothing ran yet: withdraw this call's requests
                    if self.engine.is_live(rid):
                        self.engine.abort_request(rid)
                raise
            self._claimed.update(rid for rid, *_ in submitted)
        pending = {rid for rid, *_ in submitted}
        try:
            finished = self._run(pending, sum(p.n for p in params), use_tqdm)
        finally:
            if pending:  # an exception: withdraw what is left of this call
                self._abandon(pending)
        return [self._collect(*s, finished, p) for s, p in zip(submitted, params)]

    def generate_iter(
        self,
        prompts: Sequence[str | Sequence[int] | Mapping[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Like generate, but yields (prompt index, output) as each prompt finishes.

        A prompt that cannot be served (empty, too long, a token id outside the
        vocabulary, text without a tokenizer) does not stop the others: it is yielded
        as a RequestOutput whose `error` says why (``prompts[i]: ...``, the message
        generate would raise), with no completions. A request that fails while running
        comes back as in generate: completions with finish_reason "error" and `error`
        set when all failed. Rejected prompts come first, then the rest in finish order.

        ``lora_request`` is as generate's (one adapter for all prompts or one per
        prompt). The prompts are submitted at the first ``next()``. Closing the iterator before
        its end (``close()``, leaving its for loop, dropping the last reference) aborts
        its unfinished requests; other calls may run between two ``next()`` calls.
        """
        prompts, sampling_params, lora_request = self._from_primary(
            prompts, sampling_params, lora_request
        )
        prompts = self._as_prompt_list(prompts)
        params = self._as_params_list(sampling_params, len(prompts))
        loras = (
            [None] * len(prompts)
            if lora_request is None
            else lora_requests_per_prompt(lora_request, len(prompts))
        )
        pending: dict[str, tuple[int, tuple, SamplingParams]] = {}
        rejected: list[tuple[int, RequestOutput]] = []
        with self._locked():
            for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras)):
                try:
                    sub = self._submit(i, prompt, p, lora)
                except ValueError as err:
                    rejected.append((i, self._error_output(i, prompt, str(err))))
                    continue
                pending[sub[0]] = (i, sub, p)
            self._claimed.update(pending)
        waiting = set(pending)
        try:
            yield from rejected
            while waiting:
                for out in self._step_for(waiting):
                    i, sub, p = pending.pop(out.request_id)
                    yield i, self._collect(*sub, {out.request_id: out}, p)
        finally:
            if waiting:  # closed early, dropped, or an exception: abort the rest
                self._abandon(waiting)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of them (vLLM's LLM.chat).

        Each conversation is rendered with the checkpoint's chat template (or
        `chat_template`) and tokenized without adding special tokens again.

        Raises:
            ValueError: no chat template, or a malformed conversation (naming its index).
        """
        messages, sampling_params = self._from_primary(messages, sampling_params)
        return self.generate(
            self.render_chat(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
            ),
            sampling_params,
            use_tqdm=use_tqdm,
        )

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> list[dict[str, Any]]:
        """Conversations -> prompt dicts {"prompt": text, "prompt_token_ids": ids}."""
        is_one = (
            isinstance(messages, Sequence)
            and len(messages) > 0
            and isinstance(messages[0], Mapping)
        )
        conversations = [messages] if is_one else list(messages)
        if not conversations:
            raise ValueError(f"messages={messages!r} must be a conversation or a list of them")
        template = self.chat_template
        if chat_template is not None:
            template = self._given_template(chat_template)
        if template is None:
            raise ValueError(
                "the model has no chat template (no chat_template.jinja and no "
                "'chat_template' in tokenizer_config.json): pass chat_template="
            )
        prompts = []
        for i, conv in enumerate(conversations):
            where = "messages" if is_one else f"messages[{i}]"
            text = template.render(
                check_messages(conv, where),
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
            ids = self.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return prompts

    def _given_template(self, source: str) -> ChatTemplate:
        """A template passed by the caller, seeing the checkpoint's special tokens."""
        return ChatTemplate(source, self._special_tokens, origin="chat_template=")

    def _prompt_ids(
        self, prompt: str | list[int] | Mapping[str, Any]
    ) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of one prompt; ValueError when it cannot be served."""
        if isinstance(prompt, Mapping):
            unknown = sorted(set(prompt) - set(_PROMPT_KEYS))
            if unknown:
                raise ValueError(f"prompt key {unknown[0]!r} must be one of {_PROMPT_KEYS}")
            text = prompt.get("prompt")
            if "prompt_embeds" in prompt:  # placeholders: the embeddings stand for the tokens
                if "prompt_token_ids" in prompt:
                    raise ValueError(
                        "a prompt takes 'prompt_embeds' or 'prompt_token_ids', not both"
                    )
                shape = getattr(prompt["prompt_embeds"], "shape", None)
                if shape is None or len(shape) != 2:
                    raise ValueError(
                        f"prompt_embeds of shape {shape} must be an array [T, hidden_size]"
                    )
                return text, [0] * int(shape[0])
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, str | bytes | Mapping) or not isinstance(ids, Iterable):
                    raise ValueError(f"prompt_token_ids={ids!r} must be a list of token ids")
                return text, list(ids)
            if not isinstance(text, str):
                raise ValueError(f"prompt={prompt!r} must hold 'prompt' or 'prompt_token_ids'")
            prompt = text
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt='' must be a non-empty string")
            # Refused before tokenizing (which costs ~200 bytes of memory per character).
            longest = self.config.max_model_len * PROMPT_BYTES_PER_TOKEN
            if len(prompt) > longest:
                raise ValueError(
                    f"prompt of {len(prompt)} characters cannot fit max_model_len="
                    f"{self.config.max_model_len}: a token covers at most "
                    f"{PROMPT_BYTES_PER_TOKEN} bytes of text, so a prompt that fits has at "
                    f"most {longest} characters"
                )
            ids = self.encode(prompt)
            if not ids:
                raise ValueError(f"prompt={prompt[:40]!r} tokenizes to no tokens")
            return prompt, ids
        return None, list(prompt)

    def _submit(
        self, i: int, prompt: Any, p: SamplingParams, lora: LoRARequest | None = None
    ) -> tuple[str, str | None, list[int]]:
        """Adds one prompt (n > 1: one parent request, see Engine.add_request); on
        ValueError nothing of it stays in the engine."""
        self._check_awake("generate")
        try:
            text, ids = self._prompt_ids(prompt)
        except ValueError as e:
            raise ValueError(f"prompts[{i}]: {e}") from e
        if p.logprobs_mode != "raw_logprobs" and self.config.speculative_config is not None:
            raise ValueError(
                f"prompts[{i}]: logprobs_mode={p.logprobs_mode!r} is not supported with "
                "speculative_config yet; use 'raw_logprobs'"
            )
        rid = str(next(self._ids))
        embeds = prompt.get("prompt_embeds") if isinstance(prompt, Mapping) else None
        try:
            if lora is None:
                self.engine.add_request(rid, ids, p, prompt_embeds=embeds)
            else:
                self.engine.add_request(rid, ids, p, lora_request=lora, prompt_embeds=embeds)
        except ValueError as e:
            raise ValueError(f"prompts[{i}]: {e}") from e
        return rid, text, ids

    def _error_output(self, i: int, prompt: Any, error: str) -> RequestOutput:
        now = time.time()
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str):
            text = prompt["prompt"]
        return RequestOutput(
            request_id=str(next(self._ids)),
            prompt=text,
            prompt_token_ids=[],
            outputs=[],
            metrics=RequestMetrics(now, None, now, 0, 0, 0),
            error=error,
        )

    def beam_search(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int] | Mapping[str, Any]],
        params: BeamSearchParams,
    ) -> list[BeamSearchOutput]:
        """Beam search per prompt (vLLM's LLM.beam_search); beams share KV blocks by forks.

        Prompts take the forms generate takes: a string, a list of token ids, a dict
        with "prompt" and/or "prompt_token_ids" (vLLM's TextPrompt / TokensPrompt), a
        dict with "prompt_embeds" (EngineConfig.enable_prompt_embeds; its sequences'
        tokens then start with the prompt's placeholder ids, zeros), or a list of these.
        Returns one BeamSearchOutput per prompt, in order, whose
        ``sequences`` are the beam_width best beams, best first. See
        paged_jax.beam_search for semantics.

        Raises:
            ValueError: a bad prompt (the message starting with its index, ``prompts[3]:
                ...``) or params; nothing is run in that case.
        """
        prompts, params = self._from_primary(prompts, params)
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params={params!r} must be a BeamSearchParams")
        vocab_size = self.engine.vocab_size
        ids, embeds = [], []
        for i, prompt in enumerate(self._as_prompt_list(prompts)):
            rows = prompt.get("prompt_embeds") if isinstance(prompt, Mapping) else None
            try:
                _, p = self._prompt_ids(prompt)
                if rows is not None:  # checked here, so nothing runs on a bad one
                    rows = self.engine.prompt_embeds.check(rows)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from e
            embeds.append(rows)
            if not p or not all(is_int(t) and 0 <= t < vocab_size for t in p):
                raise ValueError(
                    f"prompts[{i}]={p!r} must be a non-empty list of token ids >= 0 and "
                    f"< vocab_size={vocab_size}"
                )
            ids.append(p)
        with self._locked():
            self._check_awake("beam_search")
            return run_beam_search(
                self.engine,
                ids,
                params,
                decode=self.decode,
                prompt_embeds=embeds if any(e is not None for e in embeds) else None,
            )

    def _from_primary(self, *inputs: Any) -> tuple[Any, ...]:
        """The call's inputs as process 0 passed them (itself with one process).

        Every process of a multi-process engine must admit the same requests in the
        same order; process 0 decides, the others may pass None.
        """
        return broadcast_from_primary(inputs) if self.is_multiprocess else inputs

    # ------------------------------------------------------------------ stepping
    def _step_for(self, pending: set[str]) -> list[EngineOutput]:
        """Outputs of ``pending`` (ids of one call) finished by now; at most one engine step.

        Under the lock: outputs another call's steps produced for this call come first;
        with none, one engine step runs, and its outputs for other live calls are kept
        for them. Finished ids leave ``pending``.
        """
        with self._locked():
            unclaimed = self._unclaimed
            mine = [unclaimed.pop(rid) for rid in list(pending) if rid in unclaimed]
            if not mine:
                if not self.engine.has_unfinished():
                    raise RuntimeError(
                        f"requests {sorted(pending)} of this call are no longer in the "
                        "engine (aborted through LLM.engine?)"
                    )
                claimed = self._claimed
                for out in self.engine.step():
                    rid = out.request_id
                    if rid in pending:
                        mine.append(out)
                    elif rid in claimed:
                        unclaimed[rid] = out
                    # else: a request added to LLM.engine directly; its output is dropped
            for out in mine:
                pending.discard(out.request_id)
                self._claimed.discard(out.request_id)
            return mine

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Holds the lock; first aborts the requests of calls that ended early."""
        with self._lock:
            self._holder = threading.get_ident()
            try:
                self._abort_abandoned()
                yield
            finally:
                self._holder = None

    def _abandon(self, request_ids: set[str]) -> None:
        """Aborts a call's unfinished requests (waiting for the lock). Inside this
        thread's own locked section (an iterator garbage-collected during a step) they
        are aborted at the start of the next one instead."""
        self._abandoned.extend(request_ids)
        if self._holder != threading.get_ident():
            with self._locked():
                pass

    def _abort_abandoned(self) -> None:
        """Aborts the requests of calls that ended early (call with the lock held)."""
        while self._abandoned:
            rid = self._abandoned.pop()
            self._claimed.discard(rid)
            self._unclaimed.pop(rid, None)
            if self.engine.is_live(rid):
                self.engine.abort_request(rid)

    def _run(self, pending: set[str], num_requests: int, use_tqdm: bool) -> dict[str, EngineOutput]:
        """Steps until every id of ``pending`` has finished; returns their outputs."""
        finished: dict[str, EngineOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=num_requests, desc="requests", unit="req", dynamic_ncols=True)
        start, num_out = time.perf_counter(), 0
        try:
            while pending:
                for out in self._step_for(pending):
                    finished[out.request_id] = out
                    completions = out.samples or [out]  # EngineOutput.completions
                    num_out += sum(len(o.token_ids) for o in completions)
                    if bar is not None:
                        rate = num_out / max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"out {rate:.0f} tok/s", refresh=False)
                        bar.update(len(completions))
            if bar is not None:
                # The last rate shown is the run's own total, as a summary would compute it.
                rate = num_out / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"out {rate:.0f} tok/s", refresh=True)
        finally:
            if bar is not None:
                bar.close()
        return finished

    def _collect(
        self,
        rid: str,
        text: str | None,
        ids: list[int],
        finished: dict[str, EngineOutput],
        params: SamplingParams,
    ) -> RequestOutput:
        """The RequestOutput of one finished request (``error`` set when every
        completion failed)."""
        decode_token = self.decode_token if self.tokenizer is not None else None
        return request_output(rid, text, ids, finished.pop(rid), params, self.decode, decode_token)

    # ------------------------------------------------------------------ inputs
    @staticmethod
    def _as_prompt_list(prompts) -> list[str | list[int]]:
        if isinstance(prompts, str | Mapping):
            return [prompts]
        if not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError(f"prompts={prompts!r} must be a non-empty string or list of prompts")
        if all(map(is_int, prompts)):
            return [list(prompts)]
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str | Mapping):
                out.append(p)
            elif isinstance(p, Sequence):
                out.append(list(p))
            else:
                raise ValueError(f"prompts[{i}]={p!r} must be a string or a list of token ids")
        return out

    @staticmethod
    def _as_params_list(sampling_params, num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise ValueError(
                f"len(sampling_params)={len(params)} must equal the number of prompts {num_prompts}"
            )
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}]={p!r} must be a SamplingParams")
        return params

    def get_stats(self) -> dict[str, Any]:
        """The engine's counters (see Engine.get_stats)."""
        return self.engine.get_stats()

    # ------------------------------------------------------------------ live weights
    # docs/research_integration.md ("Training loops"): the structure, the copy rules, sleep.
    def get_weights(self) -> Any:
        """The served parameters as the model's ``nnx.State`` (one structure on every
        platform: every layer's own parameters, as ``nnx.merge(graphdef, weights)`` and
        the dense forward ``model(input_ids)`` take them), with the engine's shardings.

        Unscanned (the CPU default) these are the served arrays themselves: do not donate
        or delete them while the engine serves them. With EngineConfig.scan_layers the
        engine serves stacked copies, and this returns one unstacked copy.

        Raises:
            RuntimeError: while asleep.
        """
        with self._locked():
            return self._live_weights().get()

    def update_weights(self, weights: Any) -> None:
        """Serves ``weights`` from now on, without compiling anything.

        ``weights`` has get_weights()'s structure (an ``nnx.State`` or its
        ``nnx.to_pure_dict``), shapes and dtypes. An array already on the engine's
        devices with the served sharding is used as is (no copy); any other (numpy, or
        on another device) is copied there once. With EngineConfig.scan_layers the layers
        are restacked on the device (one copy, no host round trip). The prefix cache is
        reset: no block computed under the old weights is served again. Callable while
        asleep (the weights go to the device; wake_up then restores the KV cache).

        Raises:
            ValueError: a structure, shape or dtype that differs (naming the first path).
            RuntimeError: requests are unfinished (a generate_iter in progress, another
                thread's call): finish or abort them first.
        """
        from paged_jax.models.quantized_model import refuse_weight_updates

        refuse_weight_updates(self.model, "update_weights")
        with self._locked():
            self._check_idle("update_weights")
            self._live_weights().update(weights)
            self._reset_prefix_cache()

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Loads (Hugging Face name, array) pairs, numpy or jax (vLLM's load_weights).

        The model family's weight table converts each tensor as loading a checkpoint
        does (transposes, fused tensors split, MoE experts stacked: every expert of a
        layer's stacked parameter must be given together). The parameters not named keep
        their values. Nothing compiles; the prefix cache is reset. Tensors pass through
        host memory for the conversion; under tensor parallelism each converted array
        (KV heads repeated as loading does) is placed with the served sharding.

        Raises:
            ValueError: a name the model has not (naming it), a wrong shape, a model that
                is not a paged_jax.models family.
            RuntimeError: as update_weights.
        """
        from paged_jax.models.loader import params_from_named_tensors
        from paged_jax.models.quantized_model import refuse_weight_updates

        refuse_weight_updates(self.model, "load_weights")

        rules = getattr(type(self.model), "weight_rules", None)
        if rules is None:
            raise ValueError(
                f"load_weights needs a paged_jax.models family with a weight table; "
                f"{type(self.model).__name__} has none (use update_weights)"
            )
        values = params_from_named_tensors(
            type(self.model),
            self._checkpoint_config,
            named_tensors,
            tensor_parallel_size=self.config.tensor_parallel_size,
        )
        with self._locked():
            self._check_idle("load_weights")
            self._live_weights().update_some(values)
            self._reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Hands the device memory back (vLLM's LLM.sleep), compiling nothing.

        Level 1 deletes the KV cache (the prefix cache is reset) and moves the weights to
        host memory; level 2 deletes the weights too: update_weights or load_weights (of
        every parameter) must supply them before wake_up. generate, chat, beam_search and
        get_weights raise while asleep. Arrays get_weights returned unscanned are the
        served ones, and are deleted too. With a speculative draft model, its KV cache is
        deleted and its weights go to host memory at either level (update_weights and
        load_weights change the target's weights only).

        Raises:
            ValueError: a level other than 1 or 2.
            RuntimeError: already asleep, or requests are unfinished.
        """
        if level not in (1, 2):
            raise ValueError(f"level={level!r} must be 1 or 2")
        with self._locked():
            self._check_idle("sleep")
            live = self._live_weights()
            if live.asleep is not None:
                raise RuntimeError(f"sleep(level={level}): the engine is asleep already")
            self._reset_prefix_cache()
            live.sleep(level)
            self._proposer_hook("sleep")

    def wake_up(self) -> None:
        """Puts the weights back on the device (unless new ones were supplied) and
        allocates the KV cache again, empty; outputs are then those before sleep. No-op
        when awake.

        Raises:
            RuntimeError: after sleep(level=2) without update_weights / load_weights.
        """
        with self._locked():
            if self._live is not None and self._live.asleep is not None:
                self._live.wake_up()
                self._proposer_hook("wake_up")
                self._follow_served_weights()

    def _proposer_hook(self, name: str) -> None:
        """Calls the speculative proposer's sleep / wake_up, where it has one (a draft
        model's device state; n-gram lookup has none)."""
        hook = getattr(self.engine.proposer, name, None)
        if hook is not None:
            hook()

    def is_sleeping(self) -> bool:
        """Whether sleep() was called without a wake_up() since."""
        return self._live is not None and self._live.asleep is not None

    def _warm_up_live_weights(self) -> None:
        """Compiles a scanned engine's unstack / restack programs with the step programs
        (before them, so they count as warm-up's): get_weights, update_weights,
        load_weights, sleep and wake_up then compile nothing."""
        runner = self.engine.runner
        if runner.layer_scan is not None and runner.canonical_treedef is not None:
            self._live_weights().warmup()

    def _live_weights(self) -> Any:
        if self._live is None:
            from paged_jax.worker.live_weights import LiveWeights

            self._live = LiveWeights(self.engine.runner, owns_weights=self._owns_model)
        return self._live

    def _check_awake(self, what: str) -> None:
        if self.is_sleeping():
            raise RuntimeError(f"{what} while the engine sleeps: call wake_up() first")

    def _check_idle(self, what: str) -> None:
        if self.engine.has_unfinished():
            raise RuntimeError(
                f"{what} while requests are unfinished (a generate_iter in progress or "
                "another thread's call): let them finish or abort them first"
            )

    def _follow_served_weights(self) -> None:
        """Points the model this LLM loaded at the served arrays (its old ones are dropped);
        with stacked layers, its non-layer params (its layers were freed when stacked)."""
        if not self._owns_model or self.is_sleeping():
            return
        from flax import nnx

        weights = self.engine.runner.weights
        nnx.update(self.model, weights if self.engine.runner.layer_scan is None else weights[0])

    def _reset_prefix_cache(self) -> None:
        self._follow_served_weights()
        if not self.engine.kv_cache_manager.reset_prefix_cache():
            raise RuntimeError("the prefix cache cannot be reset: KV blocks are still held")
