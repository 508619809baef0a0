"""LLM: offline batched generation over a Hugging Face checkpoint directory (vLLM-style API).

llm = LLM("path/to/hf_model", max_num_seqs=64)
outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import time
from collections.abc import Sequence
from typing import Any

from paged_jax.config import EngineConfig
from paged_jax.engine import Engine, EngineOutput
from paged_jax.model_api import PagedModel, check_paged_model
from paged_jax.outputs import CompletionOutput, RequestMetrics, RequestOutput
from paged_jax.sampling_params import SamplingParams

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


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


class LLM:
    """Loads a checkpoint (or takes your model) and serves batches of prompts through the engine.

    Args:
        model: a Hugging Face model directory (config.json, *.safetensors, and
            tokenizer.json for string prompts), or any object satisfying
            ``paged_jax.PagedModel`` (a model of your own; see docs/research_integration.md).
        tokenizer: for a model object only: a ``tokenizers.Tokenizer`` or a path to a
            tokenizer.json; without one, prompts must be token ids.
        warmup: compile every step bucket at construction (so generate never compiles).
        **engine_args: EngineConfig fields (block_size, num_kv_blocks, kv_cache_memory,
            max_num_seqs, max_num_batched_tokens, max_model_len, enable_prefix_caching,
            preemption_mode, scheduling_policy, attention_backend, dtype, seed, hash_algo).

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
        **engine_args: Any,
    ):
        unknown = sorted(set(engine_args) - _ENGINE_FIELDS)
        if unknown:
            raise ValueError(
                f"engine argument {unknown[0]}={engine_args[unknown[0]]!r} is not an "
                f"EngineConfig field; expected one of {sorted(_ENGINE_FIELDS)}"
            )
        config = EngineConfig(**engine_args)
        self.tokenizer = None
        if isinstance(model, (str, pathlib.Path)):
            path = pathlib.Path(model)
            if not path.is_dir():
                raise FileNotFoundError(
                    f"model={str(model)!r} must be a Hugging Face model directory"
                )
            from paged_jax.models import load_model

            dtype = _resolve_dtype(config.dtype)
            config = dataclasses.replace(config, dtype=dtype)
            self.model = load_model(path, dtype=dtype, attention_backend=config.attention_backend)
            if tokenizer is None and (path / "tokenizer.json").is_file():
                tokenizer = path / "tokenizer.json"
        else:
            check_paged_model(model)
            self.model = model
            config = dataclasses.replace(config, dtype=_dtype_name(model.config.dtype))
        if isinstance(tokenizer, (str, pathlib.Path)):
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(tokenizer))
        self.tokenizer = tokenizer
        self.engine = Engine(
            self.model, config, detokenize=None if self.tokenizer is None else self.decode
        )
        self.config = self.engine.config
        self._ids = itertools.count()
        if warmup:
            self.engine.warmup()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; ValueError when there is no tokenizer."""
        if self.tokenizer is None:
            raise ValueError(
                f"prompt={text[:40]!r} is a string but the model directory has no "
                "tokenizer.json: pass token ids instead"
            )
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (special tokens skipped); "" when there is no tokenizer."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates completions for every prompt; outputs come back in input order.

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one SamplingParams for all prompts or one per prompt.
            use_tqdm: show a progress bar with running output tokens/s.

        Raises:
            ValueError: a bad prompt or SamplingParams (naming its index); nothing
                is run in that case.
        """
        prompts = self._as_prompt_list(prompts)
        params = self._as_params_list(sampling_params, len(prompts))
        engine = self.engine
        submitted: list[tuple[str, str | None, list[int], list[str]]] = []
        added: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                text = prompt if isinstance(prompt, str) else None
                ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
                rid = str(next(self._ids))
                children = []
                for j in range(p.n):
                    child = p
                    if p.n > 1:
                        # Children differ by seed and share the prompt's blocks through
                        # the prefix cache.
                        seed = None if p.seed is None else (p.seed + j) % 2**32
                        child = dataclasses.replace(p, n=1, seed=seed)
                    child_id = rid if p.n == 1 else f"{rid}_{j}"
                    try:
                        engine.add_request(child_id, ids, child)
                    except ValueError as e:
                        raise ValueError(f"prompts[{i}]: {e}") from e
                    added.append(child_id)
                    children.append(child_id)
                submitted.append((rid, text, ids, children))
        except ValueError:
            for cid in added:  # nothing ran yet: withdraw this call's requests
                engine.abort_request(cid)
            raise
        finished = self._run(len(added), use_tqdm)
        return [self._collect(*s, finished) for s in submitted]

    def _run(self, num_requests: int, use_tqdm: bool) -> dict[str, EngineOutput]:
        finished: dict[str, EngineOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=num_requests, desc="requests", unit="req", dynamic_ncols=True)
        start, num_out = time.perf_counter(), 0
        while self.engine.has_unfinished():
            for out in self.engine.step():
                finished[out.request_id] = out
                num_out += len(out.token_ids)
                if bar is not None:
                    rate = num_out / max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"out {rate:.0f} tok/s", refresh=False)
                    bar.update(1)
        if bar is not None:
            bar.close()
        return finished

    def _collect(
        self,
        rid: str,
        text: str | None,
        ids: list[int],
        children: list[str],
        finished: dict[str, EngineOutput],
    ) -> RequestOutput:
        outs = [finished.pop(cid) for cid in children]
        firsts = [o.first_token_time for o in outs if o.first_token_time is not None]
        completions = [self._completion(j, o) for j, o in enumerate(outs)]
        return RequestOutput(
            request_id=rid,
            prompt=text,
            prompt_token_ids=ids,
            outputs=completions,
            metrics=RequestMetrics(
                arrival_time=min(o.arrival_time for o in outs),
                first_token_time=min(firsts) if firsts else None,
                finish_time=max(o.finish_time for o in outs),
                num_prompt_tokens=len(ids),
                num_generated_tokens=sum(len(o.token_ids) for o in outs),
                num_cached_tokens=max(o.num_cached_tokens for o in outs),
            ),
        )

    def _completion(self, index: int, out: EngineOutput) -> CompletionOutput:
        text = self.decode(out.token_ids)
        if isinstance(out.stop_reason, str) and out.stop_reason in text:
            text = text[: text.find(out.stop_reason)]
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(out.token_ids),
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            logprobs=out.logprobs,
            error=out.error,
        )

    # ------------------------------------------------------------------ inputs
    @staticmethod
    def _as_prompt_list(prompts) -> list[str | list[int]]:
        if isinstance(prompts, str):
            return [prompts]
        if not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError(f"prompts={prompts!r} must be a non-empty string or list of prompts")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
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
