"""Documents of the local lm-eval tasks (tests/lm_eval/tasks/*.yaml): seeded, word-like text.

The tests ship small files made here; scripts/bench_lm_eval.py writes larger ones.
evaluate_local_tasks runs lm-eval on them (the tests' and the scripts' one call). Pure
Python: lm-eval and transformers are imported only by the functions that need them.

    python -c "from paged_jax.testing.lm_eval_tasks import write_task_data as w; \
w('tests/lm_eval/tasks', num_mc=6, num_rolling=3, num_gen=6)"
"""

from __future__ import annotations

import json
import pathlib
import random
from typing import Any

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
TASK_NAMES = ("pj_mc", "pj_rolling", "pj_gen")


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


def evaluate_local_tasks(
    model: Any,
    tasks_dir: str | pathlib.Path,
    *,
    model_args: dict[str, Any] | None = None,
    batch_size: int | str = 8,
    data_dir: str | pathlib.Path | None = None,
    log_samples: bool = True,
) -> dict[str, Any]:
    """lm-eval's simple_evaluate of the three local tasks (TASK_NAMES) on CPU.

    Args:
        model: an lm-eval model name ("hf", "paged-jax") or an ``LM`` instance.
        tasks_dir: the folder of the tasks' yaml files (tests/lm_eval/tasks); only it is
            loaded (``include_defaults=False``: nothing is downloaded).
        model_args: the model's arguments when ``model`` is a name.
        batch_size: lm-eval's batch size.
        data_dir: read the tasks' jsonl files from this folder instead of tasks_dir.
        log_samples: keep the per-document samples (per_document reads them).

    Returns:
        simple_evaluate's results (no bootstrap: stderrs are not computed).
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    metadata = None if data_dir is None else {"data_dir": str(data_dir)}
    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False, metadata=metadata)
    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(TASK_NAMES),
        task_manager=manager,
        batch_size=batch_size,
        device="cpu",
        log_samples=log_samples,
        bootstrap_iters=0,
    )


def per_document(results: dict[str, Any], task: str) -> list[list[Any]]:
    """One task's filtered responses in document order: pj_mc [[loglikelihood, is_greedy]
    per choice], pj_rolling [loglikelihood], pj_gen [text]."""
    rows = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [s["filtered_resps"] for s in rows]
