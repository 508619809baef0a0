"""Tiny random PEFT LoRA adapters of the tiny checkpoints, and transformers + peft as their oracle.

PEFT initialises lora_B to zero (an adapter that changes nothing); here every factor is
random, so an adapter's rows visibly differ from the base model's. torch, transformers and
peft are imported only when called.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR_TARGETS = ATTENTION_TARGETS + ("gate_proj", "up_proj", "down_proj")


def build_tiny_peft_adapter(
    base_dir: pathlib.Path,
    directory: pathlib.Path,
    *,
    rank: int,
    target_modules: Sequence[str] = ATTENTION_TARGETS,
    lora_alpha: float | None = None,
    use_rslora: bool = False,
    seed: int = 0,
    scale: float = 0.1,
) -> pathlib.Path:
    """Saves a PEFT LoRA adapter of the checkpoint at ``base_dir`` with random A and B."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=lora_alpha if lora_alpha is not None else 2 * rank,
        target_modules=list(target_modules),
        lora_dropout=0.0,
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(scale * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
    return directory


def peft_model(base_dir: pathlib.Path, adapter_dir: pathlib.Path | None) -> Any:
    """The eager-attention transformers model of ``base_dir`` with the adapter applied
    (None: the base model), in eval mode, f32."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, attn_implementation="eager", dtype=torch.float32
    )
    if adapter_dir is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def greedy_with_logits(model: Any, prompt: Sequence[int], max_new: int) -> tuple[list[int], Any]:
    """(greedy token ids, f32[max_new, V] logits of each generated position) by a full
    forward per token (no cache: the plainest oracle)."""
    import torch

    ids = list(prompt)
    logits = []
    with torch.no_grad():
        for _ in range(max_new):
            out = model(torch.tensor([ids])).logits[0, -1].float()
            logits.append(out.numpy())
            ids.append(int(out.argmax()))
    import numpy as np

    return ids[len(prompt) :], np.stack(logits)


def write_numpy_peft_adapter(
    directory: pathlib.Path,
    *,
    num_layers: int,
    shapes: dict[str, tuple[int, int]],
    rank: int,
    target_modules: Sequence[str] = ALL_LINEAR_TARGETS,
    seed: int = 0,
    scale: float = 0.05,
) -> pathlib.Path:
    """A PEFT LoRA adapter directory written with numpy alone (no torch, no peft), in the
    layout PEFT saves: random A and B for ``target_modules`` of every layer.

    Args:
        shapes: module -> (in, out) of the base model's projections.
    """
    import json

    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(num_layers):
        for module in target_modules:
            d_in, d_out = shapes[module]
            where = "self_attn" if module in ATTENTION_TARGETS else "mlp"
            key = f"base_model.model.model.layers.{layer}.{where}.{module}"
            a = scale * rng.standard_normal((rank, d_in))
            b = scale * rng.standard_normal((d_out, rank))
            tensors[f"{key}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = b.astype(np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(
        peft_type="LORA",
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory
