"""Hugging Face transformers baseline: static batches, left padding, greedy generate (torch).

As a competent user would run it: requests sorted by length (prompt, then output) so each
batch pads little, batch_size at a time. Every row of a batch is still padded to the
batch's longest prompt and runs for the batch's longest output, so short requests hold
their rows (and KV) until the whole batch ends. The KV actually held is measured on the
model's cache at every forward call. torch and transformers are imported inside the
functions only.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any

from paged_jax.baselines.workload import TraceRequest

# A small Llama for the benchmark: hidden 256, 4 layers, 8 query / 4 KV heads of dim 32
# (2.9M parameters).
BENCH_LLAMA_CONFIG: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

# An 80M-class Llama: Llama's own vocabulary (32,000) and MLP ratio (intermediate =
# 8/3 x hidden, rounded to a multiple of 256), hidden 768 in 12 query heads of dim 64,
# grouped-query attention with 4 KV heads (as Llama 2 70B and Llama 3 do; it keeps the
# KV cache at 16 KiB a token in float32), tied embeddings as small Llamas (Llama 3.2
# 1B/3B) do. 74.9M parameters.
LLAMA_80M_CONFIG: dict[str, Any] = dict(
    BENCH_LLAMA_CONFIG,
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)

MODEL_PRESETS: dict[str, dict[str, Any]] = {"tiny": BENCH_LLAMA_CONFIG, "80m": LLAMA_80M_CONFIG}


def llama_num_parameters(config: dict[str, Any]) -> int:
    """Parameters of a Llama config (the dict form above): embeddings, layers, head."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    layer = hidden * (2 * q + 2 * kv) + 3 * hidden * inter + 2 * hidden
    embed = config["vocab_size"] * hidden
    head = 0 if config.get("tie_word_embeddings") else embed
    return embed + config["num_hidden_layers"] * layer + hidden + head


def build_random_llama(
    directory: str | pathlib.Path,
    *,
    seed: int = 0,
    preset: str = "tiny",
    **config_overrides: Any,
) -> pathlib.Path:
    """Writes a seeded random-weight Llama checkpoint (safetensors) to `directory`.

    Weights are N(0, 0.05^2) and norm scales 1 + N(0, 0.05^2), larger than HF's init so
    the logits are well separated and greedy decoding is not decided by rounding.

    Args:
        directory: where save_pretrained writes the checkpoint.
        seed: torch seed of the weights.
        preset: a MODEL_PRESETS name, the config the overrides start from.
        **config_overrides: LlamaConfig fields replacing the preset's.
    """
    import torch
    import transformers

    if preset not in MODEL_PRESETS:
        raise ValueError(f"preset={preset!r} must be one of {sorted(MODEL_PRESETS)}")
    directory = pathlib.Path(directory)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**MODEL_PRESETS[preset], **config_overrides})
    model = transformers.LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            noise = 0.05 * torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + noise if param.ndim == 1 else noise)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@dataclasses.dataclass
class HFResult:
    """What the HF baseline measured.

    Attributes:
        outputs: request id -> the requested number of generated tokens.
        elapsed_s: wall time of all batches (warmup excluded).
        batch_size: rows per static batch.
        kv_utilization: summed over forward calls with a cache, the attention-mask
            positions of rows whose request still needs tokens / the cache's allocated
            token slots (rows x cache length), both read from the live tensors.
        num_generated_tokens: tokens generated including the padding-induced extra ones.
        max_concurrent_seqs: most rows, over forward calls, whose request still needed
            tokens (measured, not the batch size).
        num_threads: torch intra-op threads used.
    """

    outputs: dict[str, list[int]]
    elapsed_s: float
    batch_size: int
    kv_utilization: float
    num_generated_tokens: int
    max_concurrent_seqs: int = 0
    num_threads: int = 0


class _KVMeter:
    """Forward pre-hook that reads the live KV cache's size at every decode call.

    Reserved slots are the cache tensor's rows x length, read from the tensor; a row's
    held tokens are its prompt plus the tokens generated so far, counted only while its
    request still needs tokens (rows run to the batch's longest output).
    """

    def __init__(self) -> None:
        self.used = self.reserved = self.max_live = 0
        self.need: list[int] = []  # per row: tokens its request asked for
        self.prompts: list[int] = []  # per row: prompt length

    def __call__(self, module: Any, args: Any, kwargs: dict) -> None:
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if cache is None or cache.get_seq_length() == 0:
            return  # the prefill call: no cache yet
        keys = cache.layers[0].keys  # f[rows, kv_heads, cache_len, head_dim]
        rows, cache_len = int(keys.shape[0]), int(keys.shape[2])
        generated = cache_len - max(self.prompts) + 1  # tokens each row has produced
        live = [i for i in range(rows) if self.need[i] > generated]  # wants this call's token
        self.reserved += rows * cache_len
        self.used += sum(self.prompts[i] + generated - 1 for i in live)
        self.max_live = max(self.max_live, len(live))


def _generate_batch(model: Any, batch: list[TraceRequest], pad_token_id: int, gen_config: Any):
    import torch

    width = max(r.num_prompt_tokens for r in batch)
    ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):  # left padding: the last prompt token is in the last column
        ids[i, width - r.num_prompt_tokens :] = torch.tensor(r.prompt_token_ids)
        mask[i, width - r.num_prompt_tokens :] = 1
    gen_config.max_new_tokens = max(r.num_output_tokens for r in batch)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)
    return out[:, width:]


def run_hf_generate(
    model_path: str | pathlib.Path,
    trace: list[TraceRequest],
    batch_size: int,
    *,
    dtype: str = "float32",
    num_threads: int | None = None,
    sort_by_length: bool = True,
    model: Any = None,
) -> HFResult:
    """Greedy generate over the trace in static batches of `batch_size` (EOS ignored).

    Args:
        model_path: Hugging Face checkpoint directory.
        trace: the requests.
        batch_size: rows per static batch.
        dtype: torch dtype name of the weights.
        num_threads: torch intra-op threads while it runs (restored after); None keeps
            torch's default.
        sort_by_length: batch requests in order of (prompt, output) length, so a batch
            pads little; False takes them in trace order.
        model: an already loaded transformers model (skips loading; repeated runs).

    Returns:
        The measured HFResult; one small batch is run first as an untimed warmup.
    """
    import copy

    import torch
    import transformers

    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be >= 1")
    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype)
        ).eval()
    if sort_by_length:
        trace = sorted(trace, key=lambda r: (r.num_prompt_tokens, r.num_output_tokens))
    meter = _KVMeter()
    # ignore_eos: every row runs to max_new_tokens. generate() fills a None in the given
    # config from model.generation_config, so EOS has to be unset there too.
    model.generation_config.eos_token_id = None
    gen_config = copy.deepcopy(model.generation_config)
    gen_config.do_sample = False
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    gen_config.pad_token_id = pad
    gen_config.min_new_tokens = None
    old_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    threads = torch.get_num_threads()
    hook = model.register_forward_pre_hook(meter, with_kwargs=True)
    try:
        meter.need, meter.prompts = [1 << 30] * batch_size, [1 << 30] * batch_size
        _generate_batch(model, trace[: min(2, len(trace))], pad, gen_config)  # warmup
        meter.used = meter.reserved = meter.max_live = 0
        outputs: dict[str, list[int]] = {}
        generated = 0
        start = time.perf_counter()
        for b in range(0, len(trace), batch_size):
            batch = trace[b : b + batch_size]
            meter.need = [r.num_output_tokens for r in batch]
            meter.prompts = [r.num_prompt_tokens for r in batch]
            new_tokens = _generate_batch(model, batch, pad, gen_config)
            generated += new_tokens.numel()
            for i, r in enumerate(batch):
                outputs[r.request_id] = new_tokens[i, : r.num_output_tokens].tolist()
        elapsed = time.perf_counter() - start
    finally:
        hook.remove()
        torch.set_num_threads(old_threads)
    return HFResult(
        outputs,
        elapsed,
        batch_size,
        meter.used / max(1, meter.reserved),
        generated,
        max_concurrent_seqs=meter.max_live,
        num_threads=threads,
    )
