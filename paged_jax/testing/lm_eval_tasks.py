"""Documents of the local lm-eval tasks (tests/lm_eval/tasks/*.yaml): seeded, word-like text.

The tests ship small files made here; scripts/bench_lm_eval.py writes larger ones. Pure
Python (no jax, no lm-eval).

    python -c "from paged_jax.testing.lm_eval_tasks import write_task_data as w; \
w('tests/lm_eval/tasks', num_mc=6, num_rolling=3, num_gen=6)"
"""

from __future__ import annotations

import json
import pathlib
import random

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "over",
    "under",
    "river",
    "stone",
    "tree",
    "bird",
    "sang",
    "quickly",
    "slowly",
    "red",
    "blue",
    "green",
    "house",
    "road",
    "light",
    "dark",
    "morning",
    "evening",
    "small",
    "large",
    "old",
    "new",
    "cold",
    "warm",
    "water",
    "fire",
    "wind",
    "field",
    "hill",
    "town",
    "boat",
    "ship",
    "sky",
    "moon",
    "sun",
    "star",
    "king",
    "queen",
    "child",
]
NUM_CHOICES = 4


def _sentence(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def task_rows(num_mc: int, num_rolling: int, num_gen: int, seed: int = 0) -> dict[str, list[dict]]:
    """{file name: rows} of the three tasks: multiple-choice questions of 3-5 words with
    four 1-2 word choices (prompt + choice within the tests' 64-token window); rolling documents of 30-45 words (150+ characters: longer
    than the tests' 64-token window); generation prompts of 4-8 words."""
    rng = random.Random(seed)
    mc = [
        {
            "question": _sentence(rng, rng.randint(3, 5)),
            "choices": [_sentence(rng, rng.randint(1, 2)) for _ in range(NUM_CHOICES)],
            "answer": rng.randrange(NUM_CHOICES),
        }
        for _ in range(num_mc)
    ]
    rolling = [{"text": _sentence(rng, rng.randint(30, 45)) + "."} for _ in range(num_rolling)]
    gen = [
        {"prompt": _sentence(rng, rng.randint(4, 8)), "answer": rng.choice(WORDS)}
        for _ in range(num_gen)
    ]
    return {"pj_mc.jsonl": mc, "pj_rolling.jsonl": rolling, "pj_gen.jsonl": gen}


def write_task_data(
    folder: str | pathlib.Path, num_mc: int, num_rolling: int, num_gen: int, seed: int = 0
) -> pathlib.Path:
    """Writes the three tasks' jsonl files into folder; returns it."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in task_rows(num_mc, num_rolling, num_gen, seed).items():
        with open(folder / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return folder


def save_byte_tokenizer(directory: str | pathlib.Path) -> None:
    """Saves the demo byte tokenizer (paged_jax.entrypoints.demo), adding BOS ``<s>`` (id 1)
    to every encoding, as transformers saves one: tokenizer.json + tokenizer_config.json,
    so lm-eval's hf backend (AutoTokenizer) and paged-jax read the same tokenizer.
    Needs transformers."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    from paged_jax.entrypoints.demo import build_byte_tokenizer

    tok = build_byte_tokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(directory)
