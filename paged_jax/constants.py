"""The project's named values and the small checks every config and request shares.

One source for each: mode strings (as ``Literal`` types and their tuples; the attention
backends come from the kernels package, which owns them), bucket floors, ceiling
division (the kernels package's, re-exported), and the "int but not bool" and "field must be" checks that configs raise as
``ValueError(f"{Owner}.{field}={value!r} must be {expected}")``.
Pure Python; never imports jax.
"""

from __future__ import annotations

from typing import Literal, NoReturn, get_args

# The kernels package owns the backend and fp8 names; pallas_kernels.names is jax-free.
from pallas_kernels.names import BACKEND_NAMES, Fp8KVCacheDtype
from pallas_kernels.names import NULL_BLOCK_ID as NULL_BLOCK_ID  # re-exported
from pallas_kernels.names import AttentionBackend as AttentionBackend  # re-exported
from pallas_kernels.names import cdiv as cdiv  # re-exported: one ceiling division

PreemptionMode = Literal["recompute", "swap"]
SchedulingPolicy = Literal["fcfs", "priority"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
# "auto" = the model dtype; "fp8" is vLLM's alias of "fp8_e4m3".
KVCacheDtype = Literal["auto", "fp8", Fp8KVCacheDtype]
HashAlgo = Literal["sha256", "xxhash"]
# "auto" = scan on accelerators, unrolled on CPU (EngineConfig.scan_layers).
ScanLayers = Literal["auto", "on", "off"]
# 8-bit weights, vLLM's names: quantized on load, weight-only (docs/quantization.md).
Quantization = Literal["int8", "fp8"]

PREEMPTION_MODES: tuple[str, ...] = get_args(PreemptionMode)
SCHEDULING_POLICIES: tuple[str, ...] = get_args(SchedulingPolicy)
ATTENTION_BACKENDS: tuple[str, ...] = BACKEND_NAMES
DTYPES: tuple[str, ...] = get_args(Dtype)
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)
KV_CACHE_DTYPE_ALIASES: dict[str, str] = {"fp8": "fp8_e4m3"}
HASH_ALGOS: tuple[str, ...] = get_args(HashAlgo)
SCAN_LAYERS: tuple[str, ...] = get_args(ScanLayers)
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)

MIN_TOKEN_BUCKET = 16
# Token buckets grow 4x up to here, then 2x: padding a small step costs little (on a GPU
# it stays bound by reading the weights), so small steps share fewer programs.
COARSE_TOKEN_BUCKETS_UP_TO = 256
MIN_SEQ_BUCKET = 8
# The most bytes of text one token is assumed to cover (the longest tokens of common
# vocabularies, runs of spaces or dashes, are shorter). A text prompt of more than
# max_model_len * PROMPT_BYTES_PER_TOKEN characters (each at least one byte) cannot fit,
# so it is refused before it is tokenized; the CLI's prompts-file line limit derives
# from it too. Only a tokenizer whose normalizer deletes text could beat the bound.
PROMPT_BYTES_PER_TOKEN = 128
# The sampler's id for a row whose logits were not all finite; it rides in the sampled
# ids the host copies anyway, and the runner turns it into StepResult.nonfinite.
NONFINITE_TOKEN_ID = -1

# A warm-up's seconds per phase (WarmupReport's fields, summed over its programs) -> the
# key a run summary gives them under; "warmup_other_s" is the rest of warm-up's time.
WARMUP_SUMMARY_KEYS = {
    "trace_s": "warmup_trace_s",
    "lower_s": "warmup_lower_s",
    "compile_s": "warmup_compile_s",
    "load_s": "warmup_cache_load_s",
    "save_s": "warmup_cache_save_s",
    "run_s": "warmup_run_s",
}
WARMUP_OTHER_KEY = "warmup_other_s"


def is_int(x: object) -> bool:
    """True for an int that is not a bool (``True`` is not a block size)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: object) -> bool:
    """True for an int or float that is not a bool."""
    return isinstance(x, int | float) and not isinstance(x, bool)


def fail(owner: object, name: str, expected: str) -> NoReturn:
    """Raises the ValueError a config gives for a bad field: names owner, field, value, rule.

    Args:
        owner: the object being validated (its class name and current field value are used).
        name: the field.
        expected: what the value must be, e.g. "an int >= 1".
    """
    value = getattr(owner, name)
    raise ValueError(f"{type(owner).__name__}.{name}={value!r} must be {expected}")
