"""CLI flags derived from the config dataclasses: types, choices, switches and defaults."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Literal

import pytest

from paged_jax.config import EngineConfig
from paged_jax.constants import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
)
from paged_jax.entrypoints.field_flags import Flag, add_field_flags, field_values
from paged_jax.entrypoints.generate_cli import (
    ENGINE_ABSENT,
    ENGINE_FLAGS,
    SAMPLING_ABSENT,
    SAMPLING_FLAGS,
    build_parser,
    engine_args_from_args,
    sampling_params_from_args,
)
from paged_jax.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Toy:
    size: int = 4
    limit: int | None = None
    budget: int | float | None = None
    mode: Literal["a", "b"] = "a"
    cache: bool = True
    verbose: bool = False
    names: tuple[str, ...] = ()


TOY_FLAGS = {
    "size": Flag("size"),
    "limit": Flag("limit"),
    "budget": Flag("budget"),
    "mode": Flag("mode"),
    "cache": Flag("turn the cache off"),
    "verbose": Flag("talk"),
    "names": Flag("a name (repeat)", default=None, extra={"action": "append"}),
}


def _toy_parser(flags=TOY_FLAGS, absent=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_field_flags(p, Toy, flags, absent or {})
    return p


def _values(argv: list[str]) -> dict:
    return field_values(_toy_parser().parse_args(argv), Toy, TOY_FLAGS)


def test_types_choices_and_switches_come_from_the_fields():
    assert _values([]) == {**dataclasses.asdict(Toy()), "names": None}
    got = _values(["--size", "3", "--limit", "5", "--budget", "1e9", "--mode", "b"])
    assert (got["size"], got["limit"], got["mode"]) == (3, 5, "b")
    assert got["budget"] == 1e9 and isinstance(got["budget"], float)  # int | float: a float
    # A bool that defaults to True gets a --no- switch that stores into the field.
    got = _values(["--no-cache", "--verbose", "--names", "x", "--names", "y"])
    assert Toy(**{**got, "names": tuple(got["names"])}) == Toy(
        cache=False, verbose=True, names=("x", "y")
    )
    for bad in (["--mode", "c"], ["--size", "1.5"], ["--cache"]):
        with pytest.raises(SystemExit):
            _values(bad)
    text = " ".join(_toy_parser().format_help().split())
    assert "--mode {a,b}" in text and "--no-cache" in text


def test_a_field_without_a_flag_or_a_reason_is_a_bug():
    flags = {k: v for k, v in TOY_FLAGS.items() if k != "mode"}
    with pytest.raises(AssertionError, match=r"fields \['mode'\] have neither a CLI flag"):
        _toy_parser(flags)
    _toy_parser(flags, {"mode": "not on this command line"})
    with pytest.raises(AssertionError, match=r"\['nope'\] are not Toy fields"):
        _toy_parser({**TOY_FLAGS, "nope": Flag("x")})


def test_every_config_field_is_a_flag_or_deliberately_absent():
    for cls, flags, absent in (
        (EngineConfig, ENGINE_FLAGS, ENGINE_ABSENT),
        (SamplingParams, SAMPLING_FLAGS, SAMPLING_ABSENT),
    ):
        fields = {f.name for f in dataclasses.fields(cls)}
        assert set(flags) | set(absent) == fields
        assert not set(flags) & set(absent)


def test_engine_choices_are_the_literal_types():
    text = build_parser().format_help()
    for flag, choices in (
        ("--preemption-mode", PREEMPTION_MODES),
        ("--attention-backend", ATTENTION_BACKENDS),
        ("--dtype", DTYPES),
        ("--kv-cache-dtype", KV_CACHE_DTYPES),
    ):
        assert f"{flag} {{{','.join(choices)}}}" in text, flag


def test_no_flags_give_the_field_defaults_but_the_cli_samples_greedily():
    args = build_parser().parse_args([])
    assert EngineConfig(**engine_args_from_args(args)) == EngineConfig()
    assert sampling_params_from_args(args) == SamplingParams(temperature=0.0, max_tokens=32)


def test_engine_switches_and_renamed_flags_reach_their_fields():
    argv = ["--no-prefix-caching", "--no-async-scheduling", "--engine-seed", "7", "--seed", "3"]
    argv += ["--kv-cache-memory", "1e9"]
    args = build_parser().parse_args(argv)
    engine = engine_args_from_args(args)
    assert (engine["enable_prefix_caching"], engine["async_scheduling"]) == (False, False)
    assert engine["seed"] == 7 and sampling_params_from_args(args).seed == 3
    assert engine["kv_cache_memory"] == 10**9 and isinstance(engine["kv_cache_memory"], int)
    assert engine_args_from_args(build_parser().parse_args(["--kv-cache-memory", "0.5"]))[
        "kv_cache_memory"
    ] == pytest.approx(0.5)


def test_every_switch_shows_that_it_is_off_unless_given():
    text = build_parser().format_help()
    for flag in ("--no-prefix-caching", "--no-skip-special-tokens", "--ignore-eos"):
        entry = text[text.index(f"\n  {flag}") + 1 :]  # its help entry, not the usage line
        entry = " ".join(entry[: entry.index("\n  --")].split())  # undo the line wrapping
        assert "(default: False)" in entry, flag
