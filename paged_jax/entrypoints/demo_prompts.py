"""The main job's built-in prompt set: varied lengths, half behind one long system prompt."""

from __future__ import annotations

import random

SYSTEM_PROMPT = (
    "You are a careful assistant for a team that serves language models in production. "
    "Answer briefly and precisely. When a question is about memory, count in bytes and "
    "say which buffers you counted. When it is about speed, name the bottleneck first, "
    "then the measurement that would confirm it, then the fix. Never invent numbers; "
    "say what you would measure instead. Prefer short lists to long paragraphs, and "
    "end every answer with one sentence the reader can act on today.\n\n"
)
_SUBJECTS = [
    "paged attention",
    "a KV cache block",
    "prefix caching",
    "continuous batching",
    "preemption by recompute",
    "swapping KV blocks to host memory",
    "chunked prefill",
    "a block table",
    "the null block",
    "copy-on-write",
    "static shape buckets",
    "XLA compilation",
    "HBM bandwidth",
    "flash decoding",
    "a slot mapping",
    "beam search",
    "parallel sampling",
    "an LRU free queue",
    "reference counting",
]
_ASKS = [
    "Explain {s} to a new engineer.",
    "What breaks first when {s} is misconfigured?",
    "Give three ways to measure the cost of {s}.",
    "Compare {s} with the simplest alternative.",
    "Write a short checklist for reviewing code that implements {s}.",
    "Why does {s} matter for throughput, and when does it not?",
]
_DETAILS = [
    "Assume a 7B model.",
    "Assume one GPU with 80 GB.",
    "Keep it under 100 words.",
    "Use an example with four requests.",
    "Mention one failure you have seen.",
    "Assume prompts of about 2,000 tokens.",
    "Assume very short prompts and long outputs.",
]


def builtin_prompts(num_prompts: int = 200, seed: int = 0) -> list[str]:
    """Deterministic prompts of varied lengths; every other one starts with SYSTEM_PROMPT."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        subject = rng.choice(_SUBJECTS)
        parts = [rng.choice(_ASKS).format(s=subject)]
        parts += rng.sample(_DETAILS, k=rng.randint(0, 4))
        body = " ".join(parts)
        prompts.append(SYSTEM_PROMPT + body if i % 2 == 0 else body)
    return prompts
