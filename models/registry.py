"""Picks the model class for a config.json by model_type (or, failing that, architectures)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paged_jax.models.decoder import CausalLM
from paged_jax.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from paged_jax.models.gpt2 import GPT2LMHeadModel
from paged_jax.models.llama import LlamaForCausalLM
from paged_jax.models.mistral import MistralForCausalLM
from paged_jax.models.mixtral import MixtralForCausalLM
from paged_jax.models.opt import OPTForCausalLM
from paged_jax.models.qwen2 import Qwen2ForCausalLM
from paged_jax.models.qwen2_moe import Qwen2MoeForCausalLM
from paged_jax.models.qwen3 import Qwen3ForCausalLM
from paged_jax.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    cls.model_type: cls
    for cls in (
        LlamaForCausalLM,
        Qwen2ForCausalLM,
        MistralForCausalLM,
        GPT2LMHeadModel,
        OPTForCausalLM,
        Qwen3ForCausalLM,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        MixtralForCausalLM,
        Qwen2MoeForCausalLM,
        Qwen3MoeForCausalLM,
    )
}


def supported_architectures() -> list[str]:
    """Architecture names (config.json "architectures") that load_model accepts."""
    return [arch for cls in MODEL_CLASSES.values() for arch in cls.architectures]


def model_class_for(hf_config: Mapping[str, Any]) -> type[CausalLM]:
    """The CausalLM subclass for a Hugging Face config dict.

    Raises:
        ValueError: naming the architecture and listing the supported ones.
    """
    model_type = hf_config.get("model_type")
    if model_type in MODEL_CLASSES:
        return MODEL_CLASSES[model_type]
    architectures = list(hf_config.get("architectures") or [])
    for cls in MODEL_CLASSES.values():
        if set(architectures) & set(cls.architectures):
            return cls
    raise ValueError(
        f"unsupported architecture: model_type={model_type!r}, architectures={architectures!r}; "
        f"supported model types: {sorted(MODEL_CLASSES)} "
        f"(architectures {supported_architectures()})"
    )
