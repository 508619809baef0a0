"""Flax NNX decoder models with Hugging Face checkpoint loading (import as paged_jax.models).

model = load_model("path/to/hf_dir", dtype="bfloat16")
model = random_model(LLAMA3_8B_CONFIG, dtype="bfloat16")      # random weights, drawn on device
logits = model(input_ids)                                  # dense, f32[B, L, V]
kv_caches = model.init_kv_caches(num_blocks, block_size)
logits, kv_caches = model.forward_paged(token_ids, positions, kv_caches, attn_metadata)
"""

from __future__ import annotations

from paged_jax.models.attention import AttentionMetadata, KVCache
from paged_jax.models.checkpoint import load_model_from_orbax, save_params
from paged_jax.models.config import ModelConfig, MoEConfig, RopeConfig
from paged_jax.models.decoder import CausalLM
from paged_jax.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from paged_jax.models.gpt2 import GPT2LMHeadModel
from paged_jax.models.kv_scales import calibrate_kv_scales
from paged_jax.models.llama import LlamaForCausalLM
from paged_jax.models.loader import load_config, load_model
from paged_jax.models.mistral import MistralForCausalLM
from paged_jax.models.mixtral import MixtralForCausalLM
from paged_jax.models.opt import OPTForCausalLM
from paged_jax.models.qwen2 import Qwen2ForCausalLM
from paged_jax.models.qwen2_moe import Qwen2MoeForCausalLM
from paged_jax.models.qwen3 import Qwen3ForCausalLM
from paged_jax.models.qwen3_moe import Qwen3MoeForCausalLM
from paged_jax.models.random_init import LLAMA3_8B_CONFIG, random_model
from paged_jax.models.registry import MODEL_CLASSES, model_class_for, supported_architectures

__all__ = [
    "LLAMA3_8B_CONFIG",
    "MODEL_CLASSES",
    "AttentionMetadata",
    "CausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GPT2LMHeadModel",
    "KVCache",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "ModelConfig",
    "MoEConfig",
    "OPTForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "RopeConfig",
    "calibrate_kv_scales",
    "load_config",
    "load_model",
    "load_model_from_orbax",
    "model_class_for",
    "random_model",
    "save_params",
    "supported_architectures",
]
