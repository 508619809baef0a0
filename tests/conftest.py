"""Shared fixtures: tiny seeded random-weight Hugging Face checkpoints and their reference logits.

    def test_x(tiny_hf_checkpoint, hf_logits):
        path = tiny_hf_checkpoint("llama", num_key_value_heads=1)   # cached per arguments
        ref = hf_logits(path, input_ids)                            # f32[B, L, V] numpy

transformers/torch are imported inside the fixtures only, so test modules that do not use
them never pay for the import; where they are not installed (the Python 3.12 newest-jax
venv of scripts/test_newest_jax.sh), every test using these fixtures skips with a reason.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import pytest

FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "opt", "qwen3", "gemma2", "gemma3_text")

# Tiny shapes: hidden 64, 2 layers, 4 query heads / 2 KV heads where the family has GQA.
_TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "gpt2": dict(
        vocab_size=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=256,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "opt": dict(
        vocab_size=128,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=64,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    ),
}
_TINY_CONFIGS["qwen2"] = dict(_TINY_CONFIGS["llama"], bos_token_id=None, eos_token_id=2)
_TINY_CONFIGS["mistral"] = dict(_TINY_CONFIGS["llama"], sliding_window=16)
# head_dim 32 != hidden / heads, so the q/k norms and projections see the explicit width.
_TINY_CONFIGS["qwen3"] = dict(_TINY_CONFIGS["llama"], head_dim=32, bos_token_id=None)
# Gemma 2: 4 layers (window on 0 and 2), a scale that is not head_dim ** -0.5 and soft
# caps small enough to bend the tiny model's scores and logits.
_TINY_CONFIGS["gemma2"] = dict(
    _TINY_CONFIGS["llama"],
    num_hidden_layers=4,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=8,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=10.0,
    pad_token_id=0,
)
# Gemma 3 text: 6 layers (5 windowed, layer 5 global) and distinct global/local rope bases.
_TINY_CONFIGS["gemma3_text"] = dict(
    _TINY_CONFIGS["gemma2"],
    num_hidden_layers=6,
    attn_logit_softcapping=None,
    final_logit_softcapping=None,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
    },
)


def _require_torch_and_transformers() -> None:
    for name in ("torch", "transformers"):
        pytest.importorskip(name, reason=f"needs {name} (not installed in the torch-free venv)")


def _config_class(family: str):
    import transformers

    return {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
        "gpt2": transformers.GPT2Config,
        "opt": transformers.OPTConfig,
        "qwen3": transformers.Qwen3Config,
        "gemma2": transformers.Gemma2Config,
        "gemma3_text": transformers.Gemma3TextConfig,
    }[family]


def _randomize(model, seed: int) -> None:
    """Replaces HF's tiny-std init so every weight (norm scales and biases too) matters."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim == 1:
                is_scale = name.endswith("weight")  # RMSNorm / LayerNorm scale
                param.copy_((1.0 if is_scale else 0.0) + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)


def build_tiny_hf_checkpoint(
    family: str,
    directory: pathlib.Path,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    **config_overrides: Any,
) -> pathlib.Path:
    """Builds a seeded tiny `family` model with transformers and save_pretrained()s it."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family={family!r} must be one of {FAMILIES}")
    torch.manual_seed(seed)
    config = _config_class(family)(**{**_TINY_CONFIGS[family], **config_overrides})
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    _randomize(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    """Factory `(family, *, seed=0, max_shard_size=None, **config_overrides) -> Path`.

    family is one of FAMILIES. Checkpoints are built once per
    distinct arguments and shared by the session: copy one before changing its files.
    """
    cache: dict[str, pathlib.Path] = {}

    def make(family: str, **kwargs: Any) -> pathlib.Path:
        _require_torch_and_transformers()
        key = json.dumps([family, kwargs], sort_keys=True)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"hf_{family}")
            cache[key] = build_tiny_hf_checkpoint(family, directory, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def hf_logits():
    """Callable `(path, input_ids i32[B, L], dtype="float32") -> f32[B, L, V]` from transformers.

    Runs the checkpoint's eager-attention torch model (CPU); models are cached per (path, dtype).
    """
    models: dict[tuple[str, str], Any] = {}

    def run(path: pathlib.Path, input_ids: np.ndarray, dtype: str = "float32") -> np.ndarray:
        _require_torch_and_transformers()
        import torch
        import transformers

        key = (str(path), dtype)
        if key not in models:
            models[key] = transformers.AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="eager", dtype=getattr(torch, dtype)
            ).eval()
        with torch.no_grad():
            out = models[key](torch.as_tensor(np.asarray(input_ids), dtype=torch.long))
        return out.logits.float().numpy()

    return run


@pytest.fixture(scope="session")
def hf_greedy():
    """Callable `(path, prompt ids, max_new) -> generated ids`: transformers' greedy generate.

    Stops at EOS like the engine; models are cached per path.
    """
    models: dict[str, Any] = {}

    def run(path: pathlib.Path, prompt: list[int], max_new: int) -> list[int]:
        _require_torch_and_transformers()
        import torch
        import transformers

        if str(path) not in models:
            models[str(path)] = transformers.AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="eager", dtype=torch.float32
            ).eval()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = models[str(path)].generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
        return out[0, len(prompt) :].tolist()

    return run


@pytest.fixture(scope="session")
def model_dir(tiny_hf_checkpoint, tmp_path_factory):
    """A tiny Llama whose vocabulary covers the byte tokenizer, with tokenizer.json beside it."""
    import shutil

    from paged_jax.entrypoints.demo import build_byte_tokenizer

    src = tiny_hf_checkpoint("llama", vocab_size=259)
    dst = tmp_path_factory.mktemp("llama_tok")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    build_byte_tokenizer().save(str(dst / "tokenizer.json"))
    return dst
