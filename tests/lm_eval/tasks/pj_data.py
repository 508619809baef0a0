"""Loads the local tasks' documents from the jsonl files beside this file (nothing is
downloaded). lm-eval calls ``load(**metadata, **dataset_kwargs)`` (a task's
``custom_dataset``); ``data_dir`` (passed as simple_evaluate's metadata) reads the same
file names from another folder, as scripts/bench_lm_eval.py does with larger files."""

from __future__ import annotations

import json
import pathlib
from typing import Any


def load(data_file: str, data_dir: str | None = None, **_: Any):
    import datasets

    folder = pathlib.Path(data_dir) if data_dir else pathlib.Path(__file__).parent
    with open(folder / data_file, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
