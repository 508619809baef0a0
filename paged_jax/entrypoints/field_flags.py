"""Command-line flags derived from a config dataclass's fields (EngineConfig, SamplingParams).

A flag's type, choices and default come from its field (``Literal`` types become
choices, bools become switches); a table of `Flag` entries gives each flag its help
text and, where the command line differs from the API, its own name or default. Every
field is either in the table or listed as deliberately absent, so a new field cannot
be forgotten. Host module: no jax.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Protocol


class _FieldDefault:
    """Flag.default when the command line takes the field's default."""

    def __repr__(self) -> str:
        return "<the field's default>"


_FIELD_DEFAULT: Any = _FieldDefault()


class ArgumentContainer(Protocol):
    """An argparse parser or argument group: what the flags are added to."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action: ...


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one dataclass field appears on the command line.

    Args:
        help: the flag's help text.
        name: the flag without its dashes. None: the field name with dashes, prefixed
            with "no-" for a bool field whose default is True (the switch turns it off).
        default: the command line's own default; unset: the field's default.
        extra: more ``add_argument`` keywords, e.g. ``{"action": "append"}``.
    """

    help: str
    name: str | None = None
    default: Any = _FIELD_DEFAULT
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _field_type(hint: Any) -> Any:
    """The type one value of the field is parsed as: `int | None` -> int, tuple[int, ...] -> int."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        # int | float takes a float: 0.9 and 1e9 both parse.
        return float if float in args else args[0]
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0]
    return hint


def _check_table(cls: type, flags: Mapping[str, Flag], absent: Mapping[str, str]) -> None:
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = (set(flags) | set(absent)) - fields
    assert not unknown, f"bug: {sorted(unknown)} are not {cls.__name__} fields"
    missing = fields - set(flags) - set(absent)
    assert not missing, (
        f"bug: {cls.__name__} fields {sorted(missing)} have neither a CLI flag nor a reason "
        "to have none: add them to the flag table or to its list of absent fields"
    )


def _dest(field: dataclasses.Field, flag: Flag, hint: Any) -> str:
    """A switch stores into its field; any other flag into argparse's own dest (its name)."""
    if hint is bool:
        return field.name
    return _flag_name(field, flag, hint).replace("-", "_")


def _flag_name(field: dataclasses.Field, flag: Flag, hint: Any) -> str:
    if flag.name is not None:
        return flag.name
    name = field.name.replace("_", "-")
    return f"no-{name}" if hint is bool and field.default is True else name


def _fields(cls: type, flags: Mapping[str, Flag]) -> Iterator[tuple[dataclasses.Field, Flag, Any]]:
    """(field, flag, type hint) in the table's order, which is the order of --help."""
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    for name, flag in flags.items():
        yield by_name[name], flag, hints[name]


def add_field_flags(
    group: ArgumentContainer,
    cls: type,
    flags: Mapping[str, Flag],
    absent: Mapping[str, str],
) -> None:
    """Adds one flag per entry of `flags` to `group`, typed and defaulted from `cls`'s fields.

    Args:
        group: a parser or an argument group.
        cls: the dataclass whose fields the flags set.
        flags: field name -> its Flag, in the order the flags are listed.
        absent: field name -> why it has no flag (checked: every field is in one of them).
    """
    _check_table(cls, flags, absent)
    for field, flag, hint in _fields(cls, flags):
        default = field.default if flag.default is _FIELD_DEFAULT else flag.default
        name = "--" + _flag_name(field, flag, hint)
        if hint is bool:
            # Given: the opposite of the field's default.
            action = "store_false" if default else "store_true"
            group.add_argument(name, dest=field.name, action=action, help=flag.help, **flag.extra)
            continue
        kwargs: dict[str, Any] = dict(default=default, help=flag.help)
        kind = _field_type(hint)
        if typing.get_origin(kind) is typing.Literal:
            kwargs["choices"] = typing.get_args(kind)
        elif kind is not str:
            kwargs["type"] = kind
        group.add_argument(name, **{**kwargs, **flag.extra})  # the table may set type


def field_values(args: argparse.Namespace, cls: type, flags: Mapping[str, Flag]) -> dict[str, Any]:
    """The keyword arguments of `cls` that the flags of `flags` parsed into `args`."""
    return {
        field.name: getattr(args, _dest(field, flag, hint))
        for field, flag, hint in _fields(cls, flags)
    }
