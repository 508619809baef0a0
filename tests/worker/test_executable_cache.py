"""The executable cache: a valid entry loads and runs; a bad one is rebuilt with a warning.

A model class without a source file (python -c, a REPL, exec) is served, its programs
kept in memory only, so two such classes of the same name never share one.

A toy jitted function stands in for the step, so each case costs milliseconds. Every
bad entry (truncated, garbage, a checksum that fails, another program's file, built from
older sources) must be ignored with a warning, compiled afresh and rewritten, and the
program run must be the one asked for.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.testing.fake_model import SumModel
from paged_jax.worker.executable_cache import (
    MAGIC,
    SUFFIX,
    CacheEntryError,
    ExecutableCache,
    arg_signature,
    model_identity,
    read_entry,
    source_hash,
    write_entry,
)

LOGGER = "paged_jax.worker.executable_cache"


def _context(sources: str = "sources-1") -> dict:
    return {"format": 1, "model": {"class": "toy", "cacheable": True}, "sources": sources}


def double(x, y):  # x f32[8] (donated), y f32[8]
    return x * 2 + y


def triple(x, y):
    return x * 3 + y


JITTED = {"double": jax.jit(double, donate_argnums=(0,)), "triple": jax.jit(triple)}
WANT = {"double": np.arange(8) * 2 + 1, "triple": np.arange(8) * 3 + 1}


def _args():
    return jnp.arange(8, dtype=jnp.float32), np.ones(8, np.float32)


def _build(tmp_path, name="double", context=None):
    cache = ExecutableCache(tmp_path, context or _context())
    program, record = cache.build(name, JITTED[name], _args())
    np.testing.assert_array_equal(np.asarray(program(*_args())), WANT[name])
    return cache, record


def _entry(tmp_path, name="double", context=None):
    cache = ExecutableCache(tmp_path, context or _context())
    key, _ = cache.key(name, _args())
    return cache.path(key)


def test_a_second_cache_loads_what_the_first_compiled(tmp_path):
    _, first = _build(tmp_path)
    assert (first.how, first.cached) == ("compiled", True)
    assert first.compile_s > 0 and first.trace_s > 0 and first.lower_s > 0
    cache, second = _build(tmp_path)
    assert (second.how, second.cached) == ("loaded", True)
    assert second.compile_s == second.trace_s == second.lower_s == 0 and second.load_s > 0
    assert cache.problems == []


def test_a_loaded_program_keeps_its_donation(tmp_path):
    _build(tmp_path)
    cache = ExecutableCache(tmp_path, _context())
    program, record = cache.build("double", JITTED["double"], _args())
    assert record.how == "loaded"
    x, y = _args()
    program(x, y)
    assert x.is_deleted()  # donated, as through jit


def _rebuilt(tmp_path, caplog, name="double", context=None) -> str:
    """Builds again; asserts it compiled with one warning and rewrote a valid entry."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cache, record = _build(tmp_path, name, context)
    assert record.how == "compiled"
    assert len(cache.problems) == 1 and "rebuilding it" in cache.problems[0]
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == cache.problems
    _, again = _build(tmp_path, name, context)  # the rewritten entry is good
    assert again.how == "loaded"
    return cache.problems[0]


def test_a_truncated_entry_is_rebuilt(tmp_path, caplog):
    _build(tmp_path)
    path = _entry(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    assert "truncated" in _rebuilt(tmp_path, caplog)


def test_a_garbage_entry_is_rebuilt(tmp_path, caplog):
    _build(tmp_path)
    _entry(tmp_path).write_bytes(b"\x00garbage" * 1000)
    assert "not an executable-cache file" in _rebuilt(tmp_path, caplog)


def test_an_entry_with_a_garbage_header_is_rebuilt(tmp_path, caplog):
    _build(tmp_path)
    _entry(tmp_path).write_bytes(MAGIC + b"\x10\x00\x00\x00" + b"{not json at all" + b"x" * 50)
    assert "unreadable header" in _rebuilt(tmp_path, caplog)


def test_a_flipped_byte_fails_the_checksum_and_is_rebuilt(tmp_path, caplog):
    _build(tmp_path)
    path = _entry(tmp_path)
    data = bytearray(path.read_bytes())
    data[-200] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "checksum" in _rebuilt(tmp_path, caplog)


def test_an_entry_of_another_program_is_never_run(tmp_path, caplog):
    # "triple"'s file put where "double"'s belongs: same argument types, other program.
    _build(tmp_path, "triple")
    _entry(tmp_path, "double").write_bytes(_entry(tmp_path, "triple").read_bytes())
    problem = _rebuilt(tmp_path, caplog, "double")  # _build checks double's output
    assert "mismatched key: program differ" in problem


def test_an_entry_built_from_older_sources_is_stale_and_rebuilt(tmp_path, caplog):
    _build(tmp_path, context=_context("sources-1"))
    assert _entry(tmp_path, context=_context("sources-2")) == _entry(tmp_path)  # same slot
    problem = _rebuilt(tmp_path, caplog, context=_context("sources-2"))
    assert "stale: the package sources changed" in problem


def test_read_entry_checks_the_whole_key(tmp_path):
    path = tmp_path / ("x" + SUFFIX)
    write_entry(path, {"a": 1, "b": 2}, b"exe", b"tree")
    assert read_entry(path, {"a": 1, "b": 2}) == (b"exe", b"tree")
    with pytest.raises(CacheEntryError, match="mismatched key: b differ"):
        read_entry(path, {"a": 1, "b": 3})


def test_without_a_directory_or_model_identity_nothing_is_written(tmp_path):
    for cache in (
        ExecutableCache(None, _context()),
        ExecutableCache(tmp_path, None),
        ExecutableCache(tmp_path, {**_context(), "model": {"cacheable": False}}),
    ):
        _, record = cache.build("double", JITTED["double"], _args())
        assert (record.how, record.cached) == ("compiled", False)
    assert list(tmp_path.iterdir()) == []


def test_arg_signature_tells_shapes_dtypes_and_placement_apart():
    base = arg_signature((np.zeros(4, np.int32), jnp.zeros(4)))[1]
    assert base != arg_signature((np.zeros(5, np.int32), jnp.zeros(4)))[1]
    assert base != arg_signature((np.zeros(4, np.int64), jnp.zeros(4)))[1]
    assert base != arg_signature((jnp.zeros(4, np.int32), jnp.zeros(4)))[1]  # host vs device


def test_source_hash_covers_the_kernels():
    assert len(source_hash()) == 64 and source_hash() == source_hash()


# -- model classes without a source file ------------------------------------------------


class FileModel(SumModel):
    def kv_bytes_per_block(self, block_size, dtype=None):
        return super().kv_bytes_per_block(block_size, dtype)


# The same class name and method, run by exec: its code is in no file.
_EXEC_SOURCE = """
from paged_jax.testing.fake_model import SumModel

class FileModel(SumModel):
    def kv_bytes_per_block(self, block_size, dtype=None):
        return super().kv_bytes_per_block(block_size, dtype)
"""


def _exec_model_class(module_name: str) -> type:
    namespace = {"__name__": module_name}
    exec(_EXEC_SOURCE, namespace)
    return namespace["FileModel"]


@pytest.mark.parametrize("module_name", ["not_a_module", "json", __name__])
def test_an_exec_defined_model_is_kept_out_of_the_disk_cache_and_said_once(module_name, caplog):
    # Exec'd as if into: a module in no sys.modules (inspect: TypeError), a module whose
    # file lacks the class (inspect.getsource: OSError), and this file, which defines a
    # class of that name (its method was compiled from "<string>", not from here).
    cls = _exec_model_class(module_name)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first, second = model_identity(cls()), model_identity(cls())
    assert first == second and first["cacheable"] is False and first["class_sources"] is None
    said = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(said) == 1 and "has no source file" in said[0] and "in memory" in said[0]


def test_a_model_class_from_a_file_keys_its_source_and_is_cacheable():
    identity = model_identity(FileModel())
    assert identity["cacheable"] is True
    assert list(identity["class_sources"]) == [f"{__name__}.FileModel"]


# Run as `python -c`: two classes of one name (__main__.ShiftedSum), one config and graph,
# differing only in their code (the shift), each served with a compile cache in one folder.
# Keyed by name, config and graph alone, the second would load the first's programs.
_REPL_SCRIPT = """
import json, pathlib, sys
import jax.numpy as jnp
import paged_jax
from paged_jax.testing.fake_model import SumModel, SumModelConfig

cache, outputs = sys.argv[1], []

class ShiftedSum(SumModel):
    def forward_paged(self, token_ids, positions, kv_caches, meta, *, attention_backend=None):
        logits, caches = super().forward_paged(token_ids, positions, kv_caches, meta)
        return jnp.roll(logits, 1, axis=-1), caches

def serve(model):
    llm = paged_jax.LLM(model, attention_backend="reference", compile_cache=cache,
                        block_size=4, num_kv_blocks=32, max_num_seqs=4,
                        max_num_batched_tokens=16)
    out = llm.generate([[3, 1, 4, 1, 5]], paged_jax.SamplingParams(temperature=0, max_tokens=4))
    outputs.append(list(out[0].outputs[0].token_ids))

serve(ShiftedSum(SumModelConfig(max_position_embeddings=64)))

class ShiftedSum(SumModel):
    def forward_paged(self, token_ids, positions, kv_caches, meta, *, attention_backend=None):
        logits, caches = super().forward_paged(token_ids, positions, kv_caches, meta)
        return jnp.roll(logits, 2, axis=-1), caches

serve(ShiftedSum(SumModelConfig(max_position_embeddings=64)))
written = sorted(p.name for p in pathlib.Path(cache).rglob("*.exe"))
print(json.dumps({"outputs": outputs, "written": written}))
"""


def _shifted_sum_continuation(prompt: list[int], num_tokens: int, shift: int) -> list[int]:
    # SumModel's next token (sum of the ids + last position) moved by the logits' roll.
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append((sum(tokens) + len(tokens) - 1 + shift) % 97)
    return tokens[len(prompt) :]


def test_a_model_class_written_under_python_c_is_served(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _REPL_SCRIPT, str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=1800,  # a hang guard only: it takes about a minute on a loaded 2-core machine
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    want = [_shifted_sum_continuation([3, 1, 4, 1, 5], 4, shift) for shift in (1, 2)]
    assert result["outputs"] == want
    assert result["written"] == []
    assert proc.stderr.count("has no source file") == 1  # said once for the class name
