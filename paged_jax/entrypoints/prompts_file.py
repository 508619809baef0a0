"""The generate CLI's prompts file: JSONL records or plain text lines, told apart by content.

JSONL (the first non-blank line is a JSON object): one request per line, exactly one of
    {"prompt": "text"} | {"prompt_token_ids": [1, 2, 3]} | {"messages": [{"role": ..., ...}]}
plus an optional "id" (echoed in the output) and per-line SamplingParams overrides
({"max_tokens": 8, "temperature": 0.7, "stop": ["\\n"], "n": 2, ...}).
Plain text: every non-blank line is one prompt. "-" reads standard input.

A bad line does not sink the file: it becomes a PromptLine with `error` set (naming the
line number), and the CLI writes an error record for it. Host module: no jax.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from paged_jax.constants import is_int
from paged_jax.sampling_params import SamplingParams

PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")
OVERRIDE_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams))
ALLOWED_KEYS = ("id", *PROMPT_KEYS, *OVERRIDE_KEYS)


@dataclasses.dataclass
class PromptLine:
    """One request of the prompts file.

    Attributes:
        index: position among the requests (0-based, blank lines skipped).
        line: 1-based line number in the file.
        id: the record's "id" (any JSON value), or None.
        kind: "prompt", "prompt_token_ids" or "messages"; None when the line is bad.
        value: the prompt text, token id list or message list.
        overrides: SamplingParams fields given on the line.
        error: why the line cannot be served (then kind/value may be None).
    """

    index: int
    line: int
    id: Any = None
    kind: str | None = None
    value: Any = None
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None


def read_prompt_lines(path: str) -> tuple[str, list[PromptLine]]:
    """(format, lines) of a prompts file; format is "jsonl" or "text".

    Raises:
        ValueError: the file cannot be read or holds no prompt at all.
    """
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--prompts={path!r} cannot be read: {err}") from err
    numbered = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not numbered:
        raise ValueError(f"--prompts={path!r} holds no prompts")
    fmt = "jsonl" if _is_json_object(numbered[0][1]) else "text"
    if fmt == "text":
        return fmt, [
            PromptLine(i, n, kind="prompt", value=line) for i, (n, line) in enumerate(numbered)
        ]
    return fmt, [parse_jsonl_line(i, n, line) for i, (n, line) in enumerate(numbered)]


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def parse_jsonl_line(index: int, line_no: int, line: str) -> PromptLine:
    """One JSONL record -> PromptLine; problems go into `.error`, never raise."""
    out = PromptLine(index, line_no)

    def bad(message: str) -> PromptLine:
        out.error = f"line {line_no}: {message}"
        return out

    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        return bad(f"not valid JSON ({err})")
    if not isinstance(record, dict):
        return bad(f"must be a JSON object, not {type(record).__name__}")
    out.id = record.get("id")
    unknown = [k for k in record if k not in ALLOWED_KEYS]
    if unknown:
        return bad(
            f"unknown key {unknown[0]!r}; expected 'id', one of {list(PROMPT_KEYS)} "
            f"and SamplingParams fields {list(OVERRIDE_KEYS)}"
        )
    kinds = [k for k in PROMPT_KEYS if k in record]
    if len(kinds) != 1:
        return bad(f"needs exactly one of {list(PROMPT_KEYS)}, found {kinds}")
    kind = out.kind = kinds[0]
    value = out.value = record[kind]
    if kind == "prompt" and not isinstance(value, str):
        return bad(f"prompt={value!r} must be a string")
    if kind == "prompt_token_ids" and (
        not isinstance(value, list) or not all(is_int(t) for t in value)
    ):
        return bad(f"prompt_token_ids={value!r} must be a list of ints")
    if kind == "messages" and not isinstance(value, list):
        return bad(f"messages={value!r} must be a list of {{'role', 'content'}} objects")
    out.overrides = {k: record[k] for k in OVERRIDE_KEYS if k in record}
    return out


def params_for(base: SamplingParams, line: PromptLine) -> SamplingParams:
    """The CLI's SamplingParams with the line's overrides applied.

    Raises:
        ValueError: naming the line and the bad field (from SamplingParams).
    """
    if not line.overrides:
        return base
    try:
        return dataclasses.replace(base, **line.overrides)
    except (ValueError, TypeError) as err:
        raise ValueError(f"line {line.line}: {err}") from err
