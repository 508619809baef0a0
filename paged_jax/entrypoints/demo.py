"""The built-in demo model: a small Llama-architecture checkpoint with seeded random weights.

Written once, without torch, as an ordinary Hugging Face directory (config.json,
generation_config.json, model.safetensors, tokenizer.json) into a cache directory and
reused, so the main job runs on a fresh machine with nothing to download. Its weights
are random ("dummy"), so its text is noise; everything else (tokenizer, loading,
paging, scheduling) is the real path. Host module: numpy, safetensors and tokenizers only.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

import numpy as np

DEMO_VERSION = "demo-llama-v2"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2; the 256 bytes follow
DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": len(SPECIAL_TOKENS) + 256,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def default_cache_dir() -> pathlib.Path:
    """$PAGED_JAX_CACHE, else ~/.cache/paged_jax."""
    root = os.environ.get("PAGED_JAX_CACHE") or pathlib.Path.home() / ".cache" / "paged_jax"
    return pathlib.Path(root)


def _byte_level_chars() -> list[str]:
    """The printable character that byte-level pre-tokenization uses for each byte 0..255.

    Printable Latin-1 bytes stand for themselves; the others are shifted past 255 in order.
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, shift = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shift))
            shift += 1
    return chars


def build_byte_tokenizer():
    """A byte-level tokenizer: token id = UTF-8 byte + 3, after three special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _byte_level_chars()
    assert set(chars) == set(pre_tokenizers.ByteLevel.alphabet()), "byte-level alphabet changed"
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + b for b, ch in enumerate(chars)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _random_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    hd = config["head_dim"]
    q_dim, kv_dim = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    vocab = config["vocab_size"]

    def dense(out_dim: int, in_dim: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) * gain / np.sqrt(in_dim)).astype(np.float32)

    w = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, h)).astype(np.float32),
        "model.norm.weight": np.ones(h, np.float32),
        # A larger output gain gives peaked next-token distributions, so greedy text
        # is not just the most frequent byte.
        "lm_head.weight": dense(vocab, h, gain=4.0),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = dense(q_dim, h)
        w[p + "self_attn.k_proj.weight"] = dense(kv_dim, h)
        w[p + "self_attn.v_proj.weight"] = dense(kv_dim, h)
        w[p + "self_attn.o_proj.weight"] = dense(h, q_dim)
        w[p + "mlp.gate_proj.weight"] = dense(inter, h)
        w[p + "mlp.up_proj.weight"] = dense(inter, h)
        w[p + "mlp.down_proj.weight"] = dense(h, inter)
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    return w


def write_demo_model(path: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """Writes the demo checkpoint (HF layout) into `path` and returns it."""
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(DEMO_CONFIG, indent=2))
    gen = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    save_file(_random_weights(DEMO_CONFIG, seed), str(path / "model.safetensors"))
    build_byte_tokenizer().save(str(path / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return path


def ensure_demo_model(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The demo checkpoint's directory, written on first use (atomically) and reused."""
    root = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / DEMO_VERSION
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".demo-", dir=root))
    try:
        write_demo_model(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; use its copy
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
