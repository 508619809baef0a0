"""The generate CLI's prompts file: JSONL records or plain text lines, told apart by content.

JSONL (the first non-blank line is a JSON object): one request per line, exactly one of
    {"prompt": "text"} | {"prompt_token_ids": [1, 2, 3]} | {"messages": [{"role": ..., ...}]}
plus an optional "id" (echoed in the output) and per-line SamplingParams overrides
({"max_tokens": 8, "temperature": 0.7, "stop": ["\\n"], "n": 2, ...}), a constraint among them
({"structured_outputs": {"json": {...}}}, vLLM's keys; null: none).
Plain text: every non-blank line is one prompt. "-" reads standard input. Lines end at
"\\n" ("\\r\\n" too).

A bad line does not sink the file: it becomes a PromptLine with `error` set (naming the
line number), and the CLI writes an error record for it. The file is read in chunks, so
memory stays bounded whatever it holds: a line longer than line_byte_limit(max_model_len)
is skipped unread (an error line), and a file past MAX_PROMPTS_FILE_BYTES or
MAX_PROMPTS_FILE_LINES (endless input such as /dev/zero or `yes`) is refused.
Host module: no jax.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from typing import Any, BinaryIO

from paged_jax.constants import PROMPT_BYTES_PER_TOKEN, is_int
from paged_jax.sampling_params import SamplingParams
from paged_jax.structured_outputs import StructuredOutputsParams

# A whole prompts file is held in memory (as lines, then requests): these bound it.
MAX_PROMPTS_FILE_BYTES = 1 << 30
MAX_PROMPTS_FILE_LINES = 1_000_000
# Room on a line for the fields besides the prompt (id, stop strings, message roles).
LINE_SLACK_BYTES = 1 << 20
_CHUNK_BYTES = 1 << 20

PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")
OVERRIDE_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams))
ALLOWED_KEYS = ("id", "lora", *PROMPT_KEYS, *OVERRIDE_KEYS)
# The keys of a line's "structured_outputs" object (vLLM's names).
CONSTRAINT_KEYS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams) if f.init)


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
        lora: the "lora" key: the name of one of --lora-modules' adapters, or None.
    """

    index: int
    line: int
    id: Any = None
    kind: str | None = None
    value: Any = None
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None
    lora: str | None = None


def check_readable(path: str) -> None:
    """Fails fast (before the model is checked) when the prompts file cannot be opened.

    Checked without opening, so a FIFO's writer is not disturbed.

    Raises:
        ValueError: naming the flag and the reason.
    """
    if path == "-":
        return
    try:
        os.stat(path)
    except OSError as err:
        raise ValueError(f"--prompts={path!r} cannot be read: {err}") from err
    if os.path.isdir(path):
        raise ValueError(f"--prompts={path!r} cannot be read: it is a directory")
    if not os.access(path, os.R_OK):
        raise ValueError(f"--prompts={path!r} cannot be read: permission denied")


def line_byte_limit(max_model_len: int) -> int:
    """The longest prompts-file line kept for `max_model_len`: room for any prompt that fits.

    A prompt that fits has at most max_model_len tokens of at most PROMPT_BYTES_PER_TOKEN
    bytes each; JSON spells a byte in at most 6 ("\\u0001"), and a token id in fewer;
    LINE_SLACK_BYTES leave room for the other fields.
    """
    return 6 * PROMPT_BYTES_PER_TOKEN * max_model_len + LINE_SLACK_BYTES


def read_prompt_lines(
    path: str,
    max_model_len: int | None = None,
    *,
    max_total_bytes: int = MAX_PROMPTS_FILE_BYTES,
    max_lines: int = MAX_PROMPTS_FILE_LINES,
) -> tuple[str, list[PromptLine]]:
    """(format, lines) of a prompts file; format is "jsonl" or "text".

    Args:
        path: the file, or "-" for standard input.
        max_model_len: the run's context length; a line longer than
            line_byte_limit(max_model_len) becomes an error line without being kept.
            None: no per-line limit.
        max_total_bytes: the most bytes read (the whole file is held in memory).
        max_lines: the most lines, blank ones included.

    Raises:
        ValueError: the file cannot be read, is not UTF-8, holds no prompt at all, or is
            longer than max_total_bytes or max_lines.
    """
    line_limit = None if max_model_len is None else line_byte_limit(max_model_len)
    try:
        if path == "-":
            numbered = _decoded_lines(_stdin_bytes(), path, line_limit, max_total_bytes, max_lines)
        else:
            with open(path, "rb") as f:
                numbered = _decoded_lines(f, path, line_limit, max_total_bytes, max_lines)
    except OSError as err:
        raise ValueError(f"--prompts={path!r} cannot be read: {err}") from err
    if not numbered:
        raise ValueError(f"--prompts={path!r} holds no prompts")

    def too_long(index: int, line_no: int) -> PromptLine:
        error = (
            f"line {line_no}: longer than {line_limit} bytes, the line limit for "
            f"max_model_len={max_model_len} (no prompt that long fits)"
        )
        return PromptLine(index, line_no, error=error)

    first = next((line for _, line in numbered if line is not None), None)
    fmt = "jsonl" if first is not None and _is_json_object(first) else "text"
    lines = []
    for i, (n, line) in enumerate(numbered):
        if line is None:
            lines.append(too_long(i, n))
        elif fmt == "text":
            lines.append(PromptLine(i, n, kind="prompt", value=line))
        else:
            lines.append(parse_jsonl_line(i, n, line))
    return fmt, lines


def _decoded_lines(
    stream: BinaryIO, path: str, line_limit: int | None, max_total: int, max_lines: int
) -> list[tuple[int, str | None]]:
    """(line number, text) of the non-blank lines; text None for a line past line_limit."""
    numbered: list[tuple[int, str | None]] = []
    for n, raw in _raw_lines(stream, path, line_limit, max_total, max_lines):
        if raw is None:
            numbered.append((n, None))
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"--prompts={path!r} cannot be read: line {n}: {err}") from err
        text = text.removesuffix("\r")
        if text.strip():
            numbered.append((n, text))
    return numbered


def _raw_lines(
    stream: BinaryIO, path: str, line_limit: int | None, max_total: int, max_lines: int
) -> Iterator[tuple[int, bytes | None]]:
    """(1-based line number, bytes without the newline) of each line, read in chunks.

    A line past line_limit yields None; its bytes are dropped as they arrive, so memory
    holds at most one line's limit however long the line runs. Endless input ends at
    max_total or max_lines with a ValueError.
    """
    pending = bytearray()
    overlong = False
    total = line_no = 0

    def end_line() -> tuple[int, bytes | None]:
        nonlocal line_no
        line_no += 1
        if line_no > max_lines:
            raise ValueError(
                f"--prompts={path!r} holds more than {max_lines} lines; split it into several files"
            )
        return line_no, None if overlong else bytes(pending)

    while chunk := stream.read(_CHUNK_BYTES):
        total += len(chunk)
        if total > max_total:
            raise ValueError(
                f"--prompts={path!r} is longer than {max_total} bytes (endless input such "
                "as /dev/zero?); split it into files of at most that size"
            )
        start = 0
        while start < len(chunk):
            newline = chunk.find(b"\n", start)
            stop = len(chunk) if newline < 0 else newline
            if not overlong:
                pending += chunk[start:stop]
                if line_limit is not None and len(pending) > line_limit:
                    overlong = True
                    pending.clear()
            if newline < 0:
                break
            yield end_line()
            pending.clear()
            overlong = False
            start = newline + 1
    if pending or overlong:
        yield end_line()


def _stdin_bytes() -> BinaryIO:
    """Standard input as bytes (a replaced sys.stdin without .buffer is encoded)."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is not None:
        return buffer

    class Encoded:
        def read(self, size: int) -> bytes:
            return sys.stdin.read(size).encode("utf-8")

    return Encoded()  # type: ignore[return-value]


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except (json.JSONDecodeError, RecursionError):
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
    except RecursionError:
        return bad("not valid JSON (nested too deeply)")
    if not isinstance(record, dict):
        return bad(f"must be a JSON object, not {type(record).__name__}")
    out.id = record.get("id")
    unknown = [k for k in record if k not in ALLOWED_KEYS]
    if unknown:
        return bad(
            f"unknown key {unknown[0]!r}; expected 'id', 'lora', one of {list(PROMPT_KEYS)} "
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
    lora = out.lora = record.get("lora")
    if lora is not None and (not isinstance(lora, str) or not lora):
        return bad(f"lora={lora!r} must be the name of a --lora-modules adapter")
    out.overrides = {k: record[k] for k in OVERRIDE_KEYS if k in record}
    return out


def params_for(base: SamplingParams, line: PromptLine) -> SamplingParams:
    """The CLI's SamplingParams with the line's overrides applied.

    Raises:
        ValueError: naming the line and the bad field (from SamplingParams).
    """
    if not line.overrides:
        return base
    overrides = dict(line.overrides)
    try:
        if "structured_outputs" in overrides:
            overrides["structured_outputs"] = constraint_of(overrides["structured_outputs"])
        return dataclasses.replace(base, **overrides)
    except (ValueError, TypeError) as err:
        raise ValueError(f"line {line.line}: {err}") from err
    except RecursionError:  # a value nested deeper than Python can walk: the line's error
        raise ValueError(
            f"line {line.line}: a SamplingParams value is nested too deeply to read"
        ) from None


def constraint_of(value: Any) -> StructuredOutputsParams | None:
    """A line's "structured_outputs" value as StructuredOutputsParams; null: unconstrained.

    Raises:
        ValueError: not an object, an unknown key, or a bad field (naming it).
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(
            f"structured_outputs={value!r} must be an object with one of 'json', 'regex', "
            "'choice', 'grammar', 'json_object' (or null)"
        )
    unknown = [k for k in value if k not in CONSTRAINT_KEYS]
    if unknown:
        raise ValueError(
            f"structured_outputs: unknown key {unknown[0]!r}; expected {list(CONSTRAINT_KEYS)}"
        )
    return StructuredOutputsParams(**value)
