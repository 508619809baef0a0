"""Hostile constraints (issue 38): each is that request's one-line ValueError naming the field.

Host-only: a trained byte-level BPE of ~400 tokens and the grammar compiler, no model. Covers
schemas nested too deeply (refused before json.dumps or the backend sees them), more
alternatives than the backend's parser row holds (refused at submission with its reason),
the grammar cache's byte bound, readable backend errors, and the probe's hostile inputs
that already held (catastrophic regexes, huge enums, $ref cycles, remote $refs, grammars
that allow no output).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import pytest

from paged_jax.entrypoints.prompts_file import PromptLine, params_for
from paged_jax.sampling_params import SamplingParams
from paged_jax.structured_outputs import (
    CACHE_BYTES_ENV,
    MAX_GRAMMAR_RULES,
    MAX_SCHEMA_DEPTH,
    GrammarCompiler,
    StructuredOutputsParams,
)
from paged_jax.testing.bpe_tokenizer import EOS_TOKEN_ID, structured_corpus, train_byte_level_bpe

EOS = EOS_TOKEN_ID
# llguidance's parser holds at most this many items in one Earley row (max_items_in_row).
ROW_LIMIT = 2000
# The backend's message for a row over its limit (we keep the limit; we refuse the request).
ROW_REFUSAL = r"Current row has \d+ items; max is 2000"
# What each readable message must not carry: the caret diagrams, parser-state dumps and Rust
# backtraces the backend prints.
NOISE = ("\n", "<state>", "lexer_cost", "<backtrace>", "<grammar>", "<non-verbose/>")


def _assert_one_line(message: str, field: str) -> None:
    assert message.startswith(f"StructuredOutputsParams.{field}"), message
    assert not [n for n in NOISE if n in message], message
    assert len(message) < 700, len(message)


@pytest.fixture(scope="module")
def tokenizer():
    return train_byte_level_bpe(structured_corpus(), vocab_size=400)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    pytest.importorskip(
        "llguidance", reason="needs the grammar library (pip install '.[structured]')"
    )
    return GrammarCompiler(tokenizer, eos_token_ids=(EOS,))


def _nested_objects(levels: int) -> dict:
    """A schema of ``levels`` objects, each the one property of the one above (2 JSON levels each)."""
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _nested_objects_text(levels: int) -> str:
    """``_nested_objects(levels)`` as JSON text, built without recursion."""
    head = '{"type": "object", "properties": {"a": '
    tail = '}, "required": ["a"]}'
    return head * levels + '{"type": "integer"}' + tail * levels


def _nested_arrays(depth: int) -> dict:
    """A schema whose JSON text nests exactly ``depth`` objects and arrays; its one
    output is ``depth - 1`` nested one-item arrays around a digit."""
    schema: dict = {"type": "integer", "minimum": 0, "maximum": 9}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
    return schema


def _decode_to_end(matcher, vocab_size: int, rng: np.random.Generator, max_steps: int = 200):
    words = np.empty(matcher.grammar.num_words, np.int32)
    tokens = []
    for _ in range(max_steps):
        matcher.fill_bitmask(words)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size]
        allowed = np.flatnonzero(bits)
        assert allowed.size, "a live matcher allows at least EOS"
        token = EOS if EOS in allowed else int(rng.choice(allowed))
        assert matcher.accept(token)
        if token == EOS:
            return tokens
        tokens.append(token)
    raise AssertionError(f"no EOS within {max_steps} steps")


# --- item 1: schemas nested too deeply -------------------------------------------------------

DEEP = r"StructuredOutputsParams\.json: the schema nests (\d+) levels of objects and arrays; at most 124"


@pytest.mark.parametrize("levels", [63, 491, 493, 496, 600, 5000])
@pytest.mark.parametrize("as_text", [False, True], ids=["dict", "text"])
def test_a_schema_nested_too_deeply_is_one_short_value_error(levels, as_text):
    # Before: 63 levels passed here and failed in the backend with a repr of the schema;
    # from ~493 json.dumps (dict) or json.loads (text) raised RecursionError.
    value = _nested_objects_text(levels) if as_text else _nested_objects(levels)
    with pytest.raises(ValueError, match=DEEP) as info:
        StructuredOutputsParams(json=value)
    message = str(info.value)
    assert int(message.split(" nests ")[1].split()[0]) == 2 * levels + 1
    assert len(message) < 200 and "'type'" not in message


def test_the_deepest_schema_the_backend_takes_compiles(compiler, tokenizer):
    assert MAX_SCHEMA_DEPTH == 124
    params = StructuredOutputsParams(
        json=_nested_arrays(MAX_SCHEMA_DEPTH), disable_any_whitespace=True
    )
    matcher = compiler.matcher(params)
    out = _decode_to_end(matcher, compiler.vocab_size, np.random.default_rng(0), max_steps=600)
    text = tokenizer.decode(out)
    assert text.startswith("[" * (MAX_SCHEMA_DEPTH - 1)) and text.endswith("]")
    with pytest.raises(ValueError, match=DEEP):
        StructuredOutputsParams(json=_nested_arrays(MAX_SCHEMA_DEPTH + 1))


def test_a_self_referencing_dict_is_refused_not_walked_forever():
    schema: dict = {"type": "object", "properties": {}}
    schema["properties"]["me"] = schema
    with pytest.raises(ValueError, match=r"StructuredOutputsParams\.json: the schema nests more"):
        StructuredOutputsParams(json=schema)


def test_a_deep_schema_on_a_prompts_file_line_is_that_lines_error():
    # Before: RecursionError out of params_for (a traceback, no output file).
    line = PromptLine(0, 3)
    line.overrides = {"structured_outputs": {"json": _nested_objects(600)}}
    with pytest.raises(ValueError, match=r"^line 3: " + DEEP):
        params_for(SamplingParams(), line)


def test_a_deep_json_schema_file_is_the_runs_constraint_error(tmp_path):
    # Before: --json-schema with a depth-600 file was a RecursionError traceback, exit 1.
    from paged_jax.entrypoints.generate_cli import constraint_from_args

    path = tmp_path / "deep.json"
    path.write_text(_nested_objects_text(600))
    flag = argparse.Namespace(field="json", value=str(path))
    try:  # the run's error: raised (checked before loading), or returned as (None, why)
        constraint, message = constraint_from_args(argparse.Namespace(structured_outputs=flag))
        assert constraint is None
    except ValueError as err:
        message = str(err)
    assert message.startswith("--json-schema=") and "nests 1201 levels" in message
    assert "\n" not in message and len(message) < 400


def _rule_chain(rules: int) -> str:
    """A Lark grammar of ``rules`` rules, each the only symbol of the one before."""
    chain = "\n".join(f"r{i}: r{i + 1}" for i in range(rules - 1))
    return f'start: r0\n{chain}\nr{rules - 1}: "a"'


def test_a_grammar_of_too_many_rules_is_refused_at_construction():
    StructuredOutputsParams(grammar=_rule_chain(MAX_GRAMMAR_RULES - 1))  # + start: at the cap
    with pytest.raises(ValueError, match=r"grammar defines 10001 rules; at most 10000") as info:
        StructuredOutputsParams(grammar=_rule_chain(MAX_GRAMMAR_RULES))
    assert len(str(info.value)) < 200


# Compiles long chains of rules and of $refs; prints how each ended.
_CHAINS_SCRIPT = """
import json
from paged_jax.structured_outputs import GrammarCompiler, StructuredOutputsParams
from paged_jax.testing.bpe_tokenizer import EOS_TOKEN_ID, structured_corpus, train_byte_level_bpe
compiler = GrammarCompiler(
    train_byte_level_bpe(structured_corpus(), vocab_size=400), eos_token_ids=(EOS_TOKEN_ID,)
)
rules = "\\n".join(f"r{i}: r{i + 1}" for i in range(4999))
defs = {
    f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
    for i in range(3000)
}
defs["d3000"] = {"type": "integer"}
cases = {
    "rules": {"grammar": f'start: r0\\n{rules}\\nr4999: "a"'},
    "refs": {"json": {"$defs": defs, "$ref": "#/$defs/d0"}},
}
for name, kwargs in cases.items():
    try:
        compiler.compile(StructuredOutputsParams(**kwargs))
        print(json.dumps([name, "compiled"]), flush=True)
    except ValueError as err:
        print(json.dumps([name, str(err)]), flush=True)
"""


def test_long_chains_of_rules_or_refs_compile_and_never_crash_the_process():
    # Before: the backend's recursion overflowed the 8 MiB main stack: SIGSEGV, the whole
    # process gone (5,000 chained Lark rules; 1,000 chained $ref objects). Run in a child
    # so a regression fails this test, not the test session.
    import subprocess

    pytest.importorskip("llguidance")
    done = subprocess.run(
        [sys.executable, "-c", _CHAINS_SCRIPT],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only, far above the few seconds it takes
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    ended = dict(json.loads(line) for line in done.stdout.splitlines())
    assert ended == {"rules": "compiled", "refs": "compiled"}


# --- item 2: more alternatives than the parser's row holds ---------------------------------

MANY = ROW_LIMIT + 1
TOO_MANY_ALTERNATIVES = {
    "choice": StructuredOutputsParams(choice=[f"w{i}" for i in range(MANY)]),
    "lark": StructuredOutputsParams(grammar="start: " + " | ".join(f'"w{i}"' for i in range(MANY))),
    "anyOf": StructuredOutputsParams(
        json={
            "anyOf": [
                {
                    "type": "object",
                    "properties": {f"k{i}": {"type": "integer"}},
                    "required": [f"k{i}"],
                }
                for i in range(MANY)
            ]
        }
    ),
}


@pytest.mark.parametrize("name", list(TOO_MANY_ALTERNATIVES))
def test_more_alternatives_than_a_parser_row_holds_are_refused_at_submission(compiler, name):
    # Before: compiled, then every request failed at its first token ("the sampled token
    # ... is not allowed") without the reason.
    params = TOO_MANY_ALTERNATIVES[name]
    with pytest.raises(ValueError, match=ROW_REFUSAL) as info:
        compiler.matcher(params)
    _assert_one_line(str(info.value), params.kind)
    if name == "choice":  # the way out: an enum of the same strings
        assert 'json={"enum": [...]}' in str(info.value)


def test_the_same_strings_as_a_json_enum_still_compile_and_generate(compiler, tokenizer):
    words = [f"w{i}" for i in range(MANY)]
    matcher = compiler.matcher(StructuredOutputsParams(json={"enum": words}))
    for seed in range(3):
        out = _decode_to_end(matcher.copy(), compiler.vocab_size, np.random.default_rng(seed))
        assert json.loads(tokenizer.decode(out)) in words


def test_a_token_the_backend_refuses_later_carries_its_reason(compiler, tokenizer):
    # The row limit bites only after a free-form name here, past the compile's
    # first-token probe; the refusal keeps the backend's reason (before: the matcher was
    # rebuilt and the reason dropped).
    alternatives = " | ".join(f'"w{i}"' for i in range(MANY))
    grammar = f'start: NAME ";" alt\nNAME: /[a-z]+/\nalt: {alternatives}'
    matcher = compiler.matcher(StructuredOutputsParams(grammar=grammar))
    tokens = [t for c in "xyz;w" for t in tokenizer.encode(c).ids]
    refused = next(i for i, t in enumerate(tokens) if not matcher.accept(t))
    assert refused >= 1 and matcher.num_accepted == refused  # nothing changed
    assert matcher.error is not None and "max is 2000" in matcher.error
    assert "\n" not in matcher.error and "lexer_cost" not in matcher.error


# --- item 6: the grammar cache is bounded by bytes as well as by count ----------------------


def _big_schema(i: int, chars: int) -> dict:
    return {
        "type": "object",
        "description": f"{i}-" + "x" * chars,
        "properties": {"a": {"type": "integer"}},
    }


def test_the_grammar_cache_holds_at_most_its_byte_budget(tokenizer, monkeypatch):
    pytest.importorskip("llguidance")
    # Before: 256 entries whatever their size (each distinct 10 MB schema kept ~40 MB).
    monkeypatch.setenv(CACHE_BYTES_ENV, str(5 * 2**20))
    compiler = GrammarCompiler(tokenizer, eos_token_ids=(EOS,))
    schemas = [StructuredOutputsParams(json=_big_schema(i, 2**20)) for i in range(5)]
    compiled = [compiler.compile(p) for p in schemas]
    # An entry holds its key's text and the grammar's (each ~1 MiB) at least.
    assert all(c.num_bytes >= 2 * 2**20 for c in compiled)
    info = compiler.cache_info()
    assert info.max_bytes == 5 * 2**20
    assert 1 <= info.size <= 2 and info.bytes <= info.max_bytes
    assert info.bytes == sum(c.num_bytes for c in compiled[-info.size :])
    # The most recently used stay: the last schema is a hit, the first a miss.
    assert compiler.compile(schemas[-1]) is compiled[-1]
    assert compiler.compile(schemas[0]) is not compiled[0]


def test_an_entry_larger_than_the_budget_is_compiled_but_not_kept(tokenizer):
    pytest.importorskip("llguidance")
    compiler = GrammarCompiler(tokenizer, eos_token_ids=(EOS,), cache_bytes=2**20)
    params = StructuredOutputsParams(json=_big_schema(0, 2**20))
    assert compiler.matcher(params) is not None
    assert compiler.cache_info().size == 0 and compiler.cache_info().bytes == 0
    small = StructuredOutputsParams(regex="a+")
    assert compiler.compile(small) is compiler.compile(small)


def test_an_entry_counts_what_the_backend_built_not_only_the_text(compiler):
    enum = StructuredOutputsParams(json={"enum": [f"value number {i} " * 3 for i in range(20_000)]})
    compiled = compiler.compile(enum)
    text = sys.getsizeof(enum.key[1]) + sys.getsizeof(compiled.grammar)
    assert compiled.num_bytes >= text
    if sys.platform.startswith("linux"):  # measured with glibc's allocator statistics
        # The backend's lexer for 20k strings is several times the schema's text.
        assert compiled.num_bytes > 3 * text


@pytest.mark.parametrize("value", ["", "lots", "0", "-5", "1.5"])
def test_a_bad_cache_bytes_setting_names_the_variable(tokenizer, monkeypatch, value):
    pytest.importorskip("llguidance")
    monkeypatch.setenv(CACHE_BYTES_ENV, value)
    if value == "":  # unset in effect: the default
        assert GrammarCompiler(tokenizer, eos_token_ids=(EOS,)).cache_info().max_bytes == 2**30
        return
    with pytest.raises(ValueError, match=rf"\${CACHE_BYTES_ENV}={value!r} must be an int >= 1"):
        GrammarCompiler(tokenizer, eos_token_ids=(EOS,))
    with pytest.raises(
        ValueError, match=r"GrammarCompiler\.cache_bytes=0 must be None or an int >= 1"
    ):
        GrammarCompiler(tokenizer, eos_token_ids=(EOS,), cache_bytes=0)


# --- item 12: readable backend errors ---------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"regex": "a(b"}, "unclosed group"),  # was a caret diagram over 6 lines
        ({"json": {"type": "string", "pattern": "a(b"}}, "unclosed group"),
        ({"grammar": "start: foo"}, 'unknown name: "foo"'),
        ({"regex": "[^\\s\\S]"}, "allows no output"),  # was a parser-state dump
        ({"grammar": "start: a\na: a"}, "allows no output"),
        ({"choice": [f"w{i}" for i in range(100_000)]}, "assertion failed"),  # a Rust backtrace
    ],
)
def test_backend_errors_are_one_line_naming_the_field(compiler, kwargs, reason):
    params = StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError) as info:
        compiler.compile(params)
    message = str(info.value)
    _assert_one_line(message, next(iter(kwargs)))
    assert reason in message


# --- the probe's hostile inputs that held: keep them holding --------------------------------


@pytest.mark.parametrize(
    "pattern",
    ["(a+)+$", "(a|aa)*b", "(x+x+)+y", "(.*a){20}", r"(\w+\s?)*$", "((a{1,50}){1,50}){1,50}"],
)
def test_catastrophic_regexes_compile_and_match(compiler, tokenizer, pattern):
    import re

    matcher = compiler.matcher(StructuredOutputsParams(regex=pattern))
    out = _decode_to_end(matcher, compiler.vocab_size, np.random.default_rng(1), max_steps=400)
    assert re.fullmatch(pattern, tokenizer.decode(out)) is not None


def test_a_100k_enum_is_refused_with_one_line(compiler):
    params = StructuredOutputsParams(json={"enum": [f"v{i}" for i in range(100_000)]})
    with pytest.raises(ValueError, match="too big") as info:
        compiler.compile(params)
    _assert_one_line(str(info.value), "json")


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    ],
    ids=["self", "pair"],
)
def test_a_ref_cycle_with_no_base_case_is_refused_with_one_line(compiler, schema):
    with pytest.raises(ValueError, match="allows no output") as info:
        compiler.compile(StructuredOutputsParams(json=schema))
    _assert_one_line(str(info.value), "json")


def test_a_recursive_ref_with_a_base_case_compiles(compiler, tokenizer):
    schema = {"type": "object", "properties": {"n": {"$ref": "#"}}, "additionalProperties": False}
    matcher = compiler.matcher(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    out = _decode_to_end(matcher, compiler.vocab_size, np.random.default_rng(2), max_steps=400)
    value = json.loads(tokenizer.decode(out))
    while value:
        assert set(value) == {"n"}
        value = value["n"]


@pytest.mark.parametrize("ref", ["http://127.0.0.1:9/schema.json", "https://example.com/s.json#/x"])
def test_a_remote_ref_is_never_fetched(compiler, ref):
    with pytest.raises(ValueError, match="does not fetch") as info:
        compiler.compile(StructuredOutputsParams(json={"$ref": ref}))
    _assert_one_line(str(info.value), "json")


def test_the_engine_component_reports_why_a_token_was_refused(tokenizer):
    from types import SimpleNamespace

    from paged_jax.structured_outputs import StructuredOutputs

    pytest.importorskip("llguidance")
    alternatives = " | ".join(f'"w{i}"' for i in range(MANY))
    grammar = f'start: NAME ";" alt\nNAME: /[a-z]+/\nalt: {alternatives}'
    params = SimpleNamespace(
        structured_outputs=StructuredOutputsParams(grammar=grammar), ignore_eos=False
    )
    component = StructuredOutputs(tokenizer, tokenizer.get_vocab_size())
    component.add_request("r", params, (EOS,))
    requests = {"r": SimpleNamespace(request_id="r", sampling_params=params)}
    refused = []
    for token in [t for c in "xyz;w" for t in tokenizer.encode(c).ids]:
        refused, _ = component.accept({"r": token}, requests, (EOS,))
        if refused:
            break
    assert [(req.request_id, tok) for req, tok in refused] == [("r", token)]
    assert "max is 2000" in component.refusal_reason("r")
    assert component.refusal_reason("unconstrained") is None
