"""StructuredOutputsParams: exactly one constraint, each field checked, equal constraints share a key.

These need no grammar library: the checks run when the params are built.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from paged_jax.structured_outputs import (
    StructuredOutputsParams,
    allocate_bitmask,
    apply_bitmask_reference,
    bitmask_width,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_each_constraint_alone_is_accepted_and_named_by_kind():
    cases = {
        "json": StructuredOutputsParams(json=SCHEMA),
        "json_object": StructuredOutputsParams(json_object=True),
        "regex": StructuredOutputsParams(regex="ab+c"),
        "choice": StructuredOutputsParams(choice=["yes", "no"]),
        "grammar": StructuredOutputsParams(grammar='start: "x"'),
    }
    for kind, params in cases.items():
        assert params.kind == kind


def test_no_constraint_is_refused_naming_every_field():
    with pytest.raises(ValueError, match=r"exactly one of json, json_object, regex, choice"):
        StructuredOutputsParams()
    # json_object=False sets nothing either.
    with pytest.raises(ValueError, match=r"exactly one of"):
        StructuredOutputsParams(json_object=False)


def test_two_constraints_are_refused_naming_both():
    with pytest.raises(ValueError, match=r"regex='a'.*choice=\['b'\].*exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"json": 3}, r"StructuredOutputsParams\.json=3 must be a JSON schema"),
        ({"json": 0}, r"StructuredOutputsParams\.json=0 must be a JSON schema"),
        ({"regex": 0}, r"StructuredOutputsParams\.regex=0 must be a non-empty str"),
        ({"json": "{not json"}, r"StructuredOutputsParams\.json='\{not json' must be .*JSON"),
        ({"json": "[1, 2]"}, r"StructuredOutputsParams\.json='\[1, 2\]' must be .*object"),
        ({"json": {"a": {1, 2}}}, r"StructuredOutputsParams\.json=.* must be .*serializable"),
        ({"regex": 5}, r"StructuredOutputsParams\.regex=5 must be a non-empty str"),
        ({"regex": ""}, r"StructuredOutputsParams\.regex='' must be a non-empty str"),
        ({"choice": []}, r"StructuredOutputsParams\.choice=\[\] must be a non-empty list"),
        ({"choice": "abc"}, r"StructuredOutputsParams\.choice='abc' must be a non-empty list"),
        ({"choice": ["a", 3]}, r"StructuredOutputsParams\.choice=\['a', 3\] must be .*strings"),
        ({"choice": ["a", ""]}, r"StructuredOutputsParams\.choice=\['a', ''\] must be .*non-empty"),
        ({"grammar": ""}, r"StructuredOutputsParams\.grammar='' must be a non-empty str"),
        ({"json_object": "yes"}, r"StructuredOutputsParams\.json_object='yes' must be .*bool"),
        (
            {"json": SCHEMA, "disable_any_whitespace": 1},
            r"StructuredOutputsParams\.disable_any_whitespace=1 must be a bool",
        ),
        (
            {"json": SCHEMA, "whitespace_pattern": ""},
            r"StructuredOutputsParams\.whitespace_pattern='' must be None or a non-empty str",
        ),
    ],
)
def test_a_bad_field_names_the_field_the_value_and_what_was_expected(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        StructuredOutputsParams(**kwargs)


def test_a_long_value_is_shortened_in_the_message():
    schema = "[" + ",".join(["1"] * 2000) + "]"
    with pytest.raises(ValueError) as info:
        StructuredOutputsParams(json=schema)
    assert len(str(info.value)) < 500


def test_equal_constraints_share_a_key_and_a_hash():
    as_dict = StructuredOutputsParams(json=SCHEMA)
    as_text = StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2))
    assert as_dict.key == as_text.key
    assert hash(as_dict) == hash(as_text)
    assert StructuredOutputsParams(choice=["a", "b"]) == StructuredOutputsParams(choice=("a", "b"))
    assert (
        StructuredOutputsParams(choice=["a", "b"]).key
        != StructuredOutputsParams(choice=["b", "a"]).key
    )
    # Whitespace options change the grammar, so they change the key.
    compact = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    assert compact.key != as_dict.key
    assert isinstance(StructuredOutputsParams(choice=["a"]).choice, tuple)


def test_the_schema_is_frozen_at_construction():
    schema = {"type": "object", "properties": {}}
    params = StructuredOutputsParams(json=schema)
    key = params.key
    schema["properties"]["x"] = {"type": "integer"}  # the caller's later edit
    assert params.key == key
    assert params.json == {"type": "object", "properties": {}}


def test_bitmask_width_and_allocation():
    assert bitmask_width(32) == 1
    assert bitmask_width(33) == 2
    words = allocate_bitmask(3, 65)
    assert words.shape == (3, 3) and words.dtype == np.int32
    assert (words == -1).all()  # all ones: every token allowed


def test_apply_bitmask_reference_bit_order_and_extra_columns():
    vocab = 70
    logits = np.arange(2 * vocab, dtype=np.float32).reshape(2, vocab)
    words = np.zeros((2, bitmask_width(vocab)), np.int32)
    # Row 0 allows tokens 0, 31 (the sign bit of word 0), 32 and 69.
    words[0, 0] = np.int32(1) | np.int32(-(2**31))
    words[0, 1] = 1
    words[0, 2] = 1 << (69 - 64)
    words[1] = -1  # an unconstrained row: everything allowed
    out = apply_bitmask_reference(logits, words)
    assert np.flatnonzero(np.isfinite(out[0])).tolist() == [0, 31, 32, 69]
    np.testing.assert_array_equal(out[0, [0, 31, 32, 69]], logits[0, [0, 31, 32, 69]])
    np.testing.assert_array_equal(out[1], logits[1])
    assert np.isneginf(out[0, 1])
    np.testing.assert_array_equal(logits[0], np.arange(vocab))  # input unchanged
    # Logits wider than the mask: ids past 32 * W are never allowed.
    wide = np.zeros((1, 100), np.float32)
    out = apply_bitmask_reference(wide, np.full((1, 2), -1, np.int32))
    assert np.isfinite(out[0, :64]).all() and np.isneginf(out[0, 64:]).all()


def test_apply_bitmask_reference_checks_shapes():
    with pytest.raises(ValueError, match=r"words.*shape"):
        apply_bitmask_reference(np.zeros((2, 64), np.float32), np.zeros((3, 2), np.int32))
    with pytest.raises(ValueError, match=r"words.*int32"):
        apply_bitmask_reference(np.zeros((1, 64), np.float32), np.zeros((1, 2), np.int64))


def test_module_imports_neither_jax_nor_the_grammar_library():
    code = (
        "import sys, paged_jax.structured_outputs\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('jax', 'jaxlib', "
        "'llguidance', 'torch'))\n"
        "print(bad)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,  # hang guard
    )
    assert proc.stdout.strip() == "[]"
