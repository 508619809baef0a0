"""--help says what the code does: each default once, switches that read the right way
round, the cache directories' environment variables, the fp8 ratio for the real dtype."""

from __future__ import annotations

import pathlib
import re

from paged_jax.compile_cache import resolve_compile_cache_dir
from paged_jax.entrypoints.demo import default_cache_dir
from paged_jax.entrypoints.generate_cli import build_parser


def _entries() -> dict[str, str]:
    """Each option's help entry, its line wrapping undone."""
    text = build_parser().format_help()
    body = text[text.index("\noptions:") : text.index("\nprompts file:")]  # before the epilog
    entries: dict[str, str] = {}
    for chunk in re.split(r"\n  (?=-)", body)[1:]:
        chunk = chunk.split("\n\n")[0]  # not the next group's title
        entries[chunk.split()[0].rstrip(",")] = " ".join(chunk.split())
    return entries


def test_every_default_is_printed_once():
    entries = _entries()
    assert len(entries) > 40
    for entry in entries.values():
        assert entry.count("(default") <= 1, entry
        assert "None =" not in entry, entry  # the default is said as "(default: ...)"


def test_switches_show_that_they_are_off_unless_given():
    entries = _entries()
    for flag in ("--no-skip-special-tokens", "--no-prefix-caching", "--no-async-scheduling"):
        assert entries[flag].endswith("(default: False)"), entries[flag]
    assert "keep special tokens" in entries["--no-skip-special-tokens"]


def test_the_cache_directories_name_the_environment_they_honour(tmp_path, monkeypatch):
    entries = _entries()
    assert "$PAGED_JAX_CACHE" in entries["--cache-dir"]
    assert "$PAGED_JAX_CACHE" in entries["--compile-cache-dir"]
    assert "$PAGED_JAX_COMPILE_CACHE" in entries["--compile-cache-dir"]
    # ... and the code does honour them.
    monkeypatch.delenv("PAGED_JAX_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("PAGED_JAX_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    assert resolve_compile_cache_dir(True) == tmp_path / "jax_compile_cache"
    monkeypatch.setenv("PAGED_JAX_COMPILE_CACHE", str(tmp_path / "cc"))
    assert resolve_compile_cache_dir(True) == pathlib.Path(tmp_path / "cc")


def test_the_fp8_ratio_names_both_model_dtypes():
    entry = _entries()["--kv-cache-dtype"]
    assert "2x" in entry and "4x" in entry and "f32" in entry, entry


def test_the_engine_sizes_and_chat_template_say_what_happens_without_them():
    entries = _entries()
    assert "sized to the job" in entries["--max-num-seqs"]
    assert "sized to the job" in entries["--max-num-batched-tokens"]
    assert "Jinja" in entries["--chat-template"]
