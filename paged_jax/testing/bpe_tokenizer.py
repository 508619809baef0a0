"""Trained byte-level BPE tokenizers for tests and benchmarks (multi-character tokens).

A byte-per-token vocabulary never puts a token boundary inside a JSON key or a number, so
constraints are tested on tokenizers trained here: real merges over a small corpus, the
same ByteLevel pre-tokenizer and decoder as GPT-2-style checkpoints.
"""

from __future__ import annotations

import json
import pathlib
import sysconfig
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

BPE_SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
"""Ids 0, 1, 2: padding, BOS and EOS, as in the demo checkpoint."""
EOS_TOKEN_ID = 2

_WORDS = [
    "alice",
    "bob",
    "carol",
    "dave",
    "eve",
    "frank",
    "grace",
    "heidi",
    "ivan",
    "judy",
    "mallory",
    "niaj",
    "olivia",
    "peggy",
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "cat",
    "bird",
    "fish",
    "name",
    "age",
    "city",
    "score",
    "tags",
    "owner",
    "items",
    "kind",
    "value",
    "true",
    "false",
    "null",
    "id",
    "count",
    "price",
    "total",
    "list",
    "data",
]


def structured_corpus(num_lines: int = 400, seed: int = 0) -> list[str]:
    """Lines of JSON records, arithmetic and prose, so merges span keys, quotes and digits.

    Args:
        num_lines: how many lines of each kind.
        seed: numpy seed; the corpus (and so the trained vocabulary) depends only on it.
    """
    rng = np.random.default_rng(seed)

    def word() -> str:
        return str(rng.choice(_WORDS))

    lines = []
    for _ in range(num_lines):
        record = {
            "id": int(rng.integers(0, 1000)),
            "name": word().title(),
            "age": int(rng.integers(1, 99)),
            "score": round(float(rng.normal(50, 20)), 2),
            "tags": [word() for _ in range(int(rng.integers(0, 4)))],
            "owner": {"name": word(), "city": word()},
            "ok": bool(rng.integers(0, 2)),
        }
        lines.append(json.dumps(record))
        ops = rng.choice(["+", "-", "*", "/"], size=3)
        nums = rng.integers(0, 100, size=4)
        lines.append(f"{nums[0]} {ops[0]} ({nums[1]} {ops[1]} {nums[2]}) {ops[2]} {nums[3]}")
        lines.append(" ".join(word() for _ in range(8)))
    return lines


def stdlib_corpus(max_chars: int = 8_000_000) -> Iterator[str]:
    """Python standard-library sources (on every machine): enough text for a 32k vocabulary.

    Args:
        max_chars: stop after this many characters.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        total += len(text)
        yield text
        if total >= max_chars:
            return


def train_byte_level_bpe(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: Sequence[str] = BPE_SPECIAL_TOKENS,
):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``.

    Every byte has a token (the ByteLevel alphabet is seeded), so any text encodes; the
    special tokens take the first ids.

    Args:
        texts: the training corpus.
        vocab_size: target size (a small corpus may give fewer merges).
        special_tokens: added first, as special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok
