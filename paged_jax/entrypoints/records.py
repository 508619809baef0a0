"""The generate job's output record: one JSON object per prompts-file line.

Both the single-process CLI and the data-parallel replicas build their records here, so
a record means the same whichever path served it. Host module: no jax.
"""

from __future__ import annotations

from typing import Any

from paged_jax.entrypoints.prompts_file import PromptLine

# The error of a request the run never served because it stopped first (its output file
# could not be written).
NOT_SERVED = "not served: the run stopped"
# The longest error a summary line shows (the record and --summary-json keep it whole).
MAX_SHOWN_ERROR_CHARS = 300


def logprob_numbers(entries: list) -> list[dict[int, float] | None]:
    """Logprob objects as plain numbers for the JSON records: {token id: logprob}."""
    return [
        None if entry is None else {tid: lp.logprob for tid, lp in entry.items()}
        for entry in entries
    ]


def request_record(line: PromptLine, out: Any = None, error: str | None = None) -> dict[str, Any]:
    """The record of one line: its RequestOutput `out`, or `error` when it was not served.

    Args:
        line: the prompts-file line (its index, id and line number lead the record).
        out: the line's RequestOutput (ignored when `error` is given).
        error: why the line has no output; the record then holds only the line's
            keys and "error".
    """
    record: dict[str, Any] = {"index": line.index, "id": line.id, "line": line.line}
    if error is not None:
        record["error"] = error
        return record
    record.update(
        request_id=out.request_id,
        prompt=out.prompt,
        prompt_token_ids=out.prompt_token_ids,
        outputs=[
            {
                "index": c.index,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **({"logprobs": logprob_numbers(c.logprobs)} if c.logprobs is not None else {}),
            }
            for c in out.outputs
        ],
        **(
            {"prompt_logprobs": logprob_numbers(out.prompt_logprobs)}
            if out.prompt_logprobs is not None
            else {}
        ),
        time_to_first_token=out.metrics.time_to_first_token,
        num_cached_tokens=out.metrics.num_cached_tokens,
        error=None,
    )
    return record


def rejected_error(line: PromptLine, position: int, error: str) -> str:
    """The record error of a prompt LLM.generate_iter rejected (its RequestOutput.error).

    The engine names the prompt by its position in the call (``prompts[3]: ...``); the
    record names the prompts-file line instead.
    """
    error = error.removeprefix(f"prompts[{position}]: ")
    return f"line {line.line}: {error}"


def one_line(error: str, limit: int = MAX_SHOWN_ERROR_CHARS) -> str:
    """`error` as one line of at most `limit` characters, for a listing on the terminal.

    A grammar library's multi-line message (a caret diagram, a parser dump) is joined
    with spaces and cut with "..."; the record keeps the whole text.
    """
    text = " ".join(error.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
