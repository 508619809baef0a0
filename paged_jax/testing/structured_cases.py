"""Nested JSON schemas (objects, arrays, enums, numbers, required fields) and a valid
document of each, shared by the structured-output benchmarks."""

from __future__ import annotations

from typing import Any


def nested_schema(i: int = 0) -> dict[str, Any]:
    """The i-th distinct nested schema: its property name and enum values depend on i."""
    kinds = [f"kind{i}_{j}" for j in range(3)]
    return {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            f"name_{i}": {"type": "string", "maxLength": 24},
            "kind": {"enum": kinds},
            "score": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
            "owner": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 150},
                    "pets": {
                        "type": "array",
                        "maxItems": 3,
                        "items": {
                            "type": "object",
                            "properties": {"kind": {"enum": kinds[:2]}, "age": {"type": "integer"}},
                            "required": ["kind"],
                        },
                    },
                },
                "required": ["name", "age"],
            },
        },
        "required": ["id", "kind", "owner"],
    }


def nested_document(i: int = 0) -> dict[str, Any]:
    """A document that validates against ``nested_schema(i)`` and uses every property."""
    return {
        "id": 17 + i,
        f"name_{i}": "Rex the dog",
        "kind": f"kind{i}_1",
        "score": 3.25,
        "tags": ["good", "old"],
        "owner": {
            "name": "Alice",
            "age": 31,
            "pets": [{"kind": f"kind{i}_0", "age": 2}, {"kind": f"kind{i}_1"}],
        },
    }
