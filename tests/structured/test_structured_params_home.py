"""The constraint's home module stays light (the standard library only: no grammar library,
numpy or jax), and the grammar module re-exports the very same objects."""

from __future__ import annotations

import ast
import pathlib
import sys

import paged_jax
import paged_jax.structured_outputs as structured_outputs
import paged_jax.structured_params as structured_params


def test_structured_params_imports_only_the_standard_library():
    tree = ast.parse(pathlib.Path(structured_params.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert imported, "the module's imports were not found (parse bug)"
    third_party = sorted(m for m in imported if m not in sys.stdlib_module_names)
    assert third_party == [], f"structured_params imports {third_party}"


def test_grammar_module_and_top_level_reexport_the_same_constraint_objects():
    for name in (
        "StructuredOutputsParams",
        "ConstraintKind",
        "MAX_SCHEMA_DEPTH",
        "MAX_GRAMMAR_RULES",
    ):
        assert name in structured_outputs.__all__, name
        assert getattr(structured_outputs, name) is getattr(structured_params, name), name
    assert paged_jax.StructuredOutputsParams is structured_params.StructuredOutputsParams
