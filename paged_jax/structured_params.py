"""The user-facing output constraint, ``StructuredOutputsParams``: one request's JSON schema,
regex, choice or grammar, checked at construction. Imports neither jax nor the grammar
backend; ``paged_jax.structured_outputs`` compiles it and matches tokens against it.
"""

from __future__ import annotations

import dataclasses
import json as jsonlib
import re
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

__all__ = [
    "ConstraintKind",
    "MAX_GRAMMAR_RULES",
    "MAX_SCHEMA_DEPTH",
    "StructuredOutputsParams",
    "field_error",
    "short_repr",
]

# Most nested objects and arrays in a JSON schema's text. The backend reads its grammar with
# serde_json, which refuses more than 128 levels, and wraps the schema in 3 of them
# (``{"grammars": [{"json_schema": ...}]}``); one more is left spare. Checked at
# construction, before json.dumps or the backend recurse into the schema.
MAX_SCHEMA_DEPTH = 124
# Most rule and terminal definitions in a Lark or GBNF grammar. The backend follows a chain
# of rules recursively (about 3 KiB of stack per rule): 2,500 chained rules overflow an
# 8 MiB stack and kill the process. With this cap and the compile thread's stack
# (paged_jax.structured_outputs), a chain uses at most ~30 MiB.
MAX_GRAMMAR_RULES = 10_000

# A Lark rule or terminal ("name:", "?name:", "NAME.2:") or a GBNF rule ("name ::=") at the
# start of a line.
_RULE_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?::|::=)", re.M)
# Levels a schema's depth is counted to before it is called "more than" this (a dict that
# contains itself would otherwise be walked forever).
_DEPTH_COUNT_CAP = 100_000
# Values longer than this (a large schema) are shortened in error messages.
_MAX_VALUE_CHARS = 200

ConstraintKind = Literal["json", "json_object", "regex", "choice", "grammar"]
_FIELDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")


def _bounded_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxlevel = 6
    r.maxdict = r.maxlist = r.maxtuple = r.maxset = r.maxfrozenset = 32
    r.maxstring = r.maxother = r.maxlong = _MAX_VALUE_CHARS
    return r


# Bounded in depth and width, so a huge or deeply nested value costs little to show.
_REPR = _bounded_repr()


def short_repr(value: object) -> str:
    """``repr(value)`` bounded in depth and width and cut to ~200 characters, for error
    messages about values that may be huge (a schema) or nested deeply."""
    try:
        text = _REPR.repr(value)
    except RecursionError:  # a container type reprlib does not know, nested too deeply
        text = f"<{type(value).__name__} nested too deeply to show>"
    return text if len(text) <= _MAX_VALUE_CHARS else text[:_MAX_VALUE_CHARS] + "..."


def field_error(owner: str, name: str, value: object, expected: str) -> ValueError:
    """The ValueError ``{owner}.{name}={value} must be {expected}`` (value shortened)."""
    return ValueError(f"{owner}.{name}={short_repr(value)} must be {expected}")


def _too_deep(owner: str, depth: int) -> ValueError:
    levels = f"more than {_DEPTH_COUNT_CAP}" if depth > _DEPTH_COUNT_CAP else str(depth)
    return ValueError(
        f"{owner}.json: the schema nests {levels} levels of objects and arrays; at most "
        f"{MAX_SCHEMA_DEPTH} are supported (the grammar backend's limit)"
    )


def _nesting_depth(value: object) -> int:
    """Most nested dicts and lists in ``value`` (a scalar: 0), counted level by level
    (no recursion); past ``_DEPTH_COUNT_CAP`` levels the count stops there + 1."""
    depth = 0
    level = [value] if isinstance(value, Mapping | list | tuple) else []
    while level and depth <= _DEPTH_COUNT_CAP:
        depth += 1
        below: dict[int, object] = {}  # by id: a value shared within one level counts once
        for v in level:
            for c in v.values() if isinstance(v, Mapping) else v:
                if type(c) not in _SCALAR_TYPES and isinstance(c, Mapping | list | tuple):
                    below[id(c)] = c
        level = list(below.values())
    return depth


_SCALAR_TYPES = frozenset({str, int, float, bool, type(None)})
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _text_depth(text: str) -> int:
    """Most nested objects and arrays in JSON text (brackets inside strings do not count)."""
    depth = deepest = 0
    for m in _JSON_TOKEN.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One request's output constraint (vLLM's fields), checked at construction.

    Set exactly one of json, json_object, regex, choice, grammar. Whether a schema,
    regex or grammar is one the backend can compile is checked at submission
    (``GrammarCompiler.compile``), with the same kind of error.

    Args:
        json: a JSON schema, as a dict or its JSON text; the output is JSON that
            validates against it.
        json_object: True: the output is any JSON object.
        regex: the output fullmatches this regular expression (Rust regex syntax).
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar, Lark (``start: ...``) or GBNF (``root ::= ...``).
        disable_any_whitespace: JSON only: no free whitespace between tokens (compact
            JSON), instead of any amount.
        whitespace_pattern: JSON only: a regex the free whitespace must match.

    Attributes:
        key: the canonical constraint (kind, text, JSON options): equal keys compile
            to the same grammar, so compilers cache by it.
    """

    json: Mapping[str, Any] | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    key: tuple[str, str, bool, str | None] = dataclasses.field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if isinstance(self.choice, list | tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise field_error(owner, "json_object", self.json_object, "None or a bool")
        # Identity, not equality: json=0 is a bad schema, not an unset field.
        given = [
            n for n in _FIELDS if getattr(self, n) is not None and getattr(self, n) is not False
        ]
        if len(given) != 1:
            values = {n: getattr(self, n) for n in given}
            shown = ", ".join(
                f"{n}={short_repr(list(v) if isinstance(v, tuple) else v)}"
                for n, v in values.items()
            )
            raise ValueError(
                f"{owner}: got {shown or 'no constraint'}; exactly one of "
                f"{', '.join(_FIELDS)} must be set"
            )
        kind: ConstraintKind = given[0]  # type: ignore[assignment]
        text = self._canonical_text(owner, kind)
        if not isinstance(self.disable_any_whitespace, bool):
            raise field_error(
                owner, "disable_any_whitespace", self.disable_any_whitespace, "a bool"
            )
        pattern = self.whitespace_pattern
        if pattern is not None and (not isinstance(pattern, str) or not pattern):
            raise field_error(
                owner, "whitespace_pattern", pattern, "None or a non-empty str (a regex)"
            )
        is_json = kind in ("json", "json_object")
        key = (
            kind,
            text,
            self.disable_any_whitespace if is_json else False,
            pattern if is_json else None,
        )
        object.__setattr__(self, "key", key)

    def _canonical_text(self, owner: str, kind: ConstraintKind) -> str:
        """The constraint as one string (compact JSON for schemas and choices); checks types."""
        if kind == "json":
            value = self.json
            if isinstance(value, str):
                try:
                    schema = jsonlib.loads(value)
                except jsonlib.JSONDecodeError as e:
                    raise field_error(
                        owner, "json", value, f"a JSON schema (a dict or valid JSON text): {e}"
                    ) from None
                except RecursionError:
                    raise _too_deep(owner, _text_depth(value)) from None
            elif isinstance(value, Mapping):
                schema = value
            else:
                raise field_error(owner, "json", value, "a JSON schema: a dict or its JSON text")
            if not isinstance(schema, Mapping):
                raise field_error(owner, "json", value, "a JSON schema holding an object")
            depth = _nesting_depth(schema)
            if depth > MAX_SCHEMA_DEPTH:
                raise _too_deep(owner, depth)
            try:
                text = jsonlib.dumps(schema, separators=(",", ":"), ensure_ascii=False)
            except (TypeError, ValueError, RecursionError) as e:
                raise field_error(
                    owner, "json", value, f"a JSON schema of JSON-serializable values: {e}"
                ) from None
            if not isinstance(value, str):
                # Keep our own copy: a later edit of the caller's dict must not change
                # a constraint whose key (and compiled grammar) is already taken.
                object.__setattr__(self, "json", jsonlib.loads(text))
            return text
        if kind == "json_object":
            return '{"type":"object"}'
        if kind == "choice":
            value = self.choice
            if not isinstance(value, tuple) or not value:
                shown = list(value) if isinstance(value, tuple) else value
                raise field_error(owner, "choice", shown, "a non-empty list of strings")
            if not all(isinstance(c, str) for c in value):
                raise field_error(owner, "choice", list(value), "a list of strings")
            if not all(value):
                raise field_error(owner, "choice", list(value), "a list of non-empty strings")
            return jsonlib.dumps(list(value), ensure_ascii=False)
        value = getattr(self, kind)
        if not isinstance(value, str) or not value:
            raise field_error(owner, kind, value, "a non-empty str")
        if kind == "grammar":
            rules = sum(1 for _ in _RULE_DEFINITION.finditer(value))
            if rules > MAX_GRAMMAR_RULES:
                raise ValueError(
                    f"{owner}.grammar: the grammar defines {rules} rules; at most "
                    f"{MAX_GRAMMAR_RULES} are supported (the grammar backend recurses "
                    "along chains of rules)"
                )
        return value

    def __hash__(self) -> int:
        return hash(self.key)

    @property
    def kind(self) -> ConstraintKind:
        """Which constraint is set: "json", "json_object", "regex", "choice" or "grammar"."""
        return self.key[0]  # type: ignore[return-value]
