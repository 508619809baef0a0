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

from paged_jax.testing.tiny_models import build_tiny_hf_checkpoint


def _require_torch_and_transformers() -> None:
    for name in ("torch", "transformers"):
        pytest.importorskip(name, reason=f"needs {name} (not installed in the torch-free venv)")


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
