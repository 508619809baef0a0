"""The one seam that picks an implementation of the paged ops: ``get_attention_ops(name)``.

A Mosaic GPU (Hopper) kernel set would be added here as one more name; callers
(models, engine) only ever hold an ``AttentionOps``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax

from pallas_kernels import reference

BACKEND_NAMES = ("auto", "pallas", "pallas_interpret", "reference")


class AttentionOps(NamedTuple):
    """The paged ops, each with the public signature of its reference in reference.py."""

    write_kv: Callable
    ragged_paged_attention: Callable
    paged_attention: Callable
    copy_blocks: Callable


def _pallas_ops(interpret: bool) -> AttentionOps:
    from pallas_kernels import block_copy, decode_attention, kv_write, ragged_attention

    def bind(fn):
        return functools.partial(fn, interpret=True) if interpret else fn

    return AttentionOps(
        write_kv=bind(kv_write.write_kv),
        ragged_paged_attention=bind(ragged_attention.ragged_paged_attention),
        paged_attention=bind(decode_attention.paged_attention),
        copy_blocks=bind(block_copy.copy_blocks),
    )


def _reference_ops() -> AttentionOps:
    return AttentionOps(
        write_kv=reference.write_kv,
        ragged_paged_attention=reference.ragged_paged_attention,
        paged_attention=reference.paged_attention,
        copy_blocks=reference.copy_blocks,
    )


def get_attention_ops(name: str = "auto") -> AttentionOps:
    """Returns the paged ops of one backend.

    Args:
        name: "auto" (Pallas kernels when ``jax.default_backend() == "gpu"``, else the
            pure-JAX reference), "pallas" (Pallas/Triton kernels, GPU), "pallas_interpret"
            (the same kernels run by the Pallas interpreter, for CPU tests) or "reference".

    Raises:
        ValueError: ``name`` is not one of the names above.
    """
    if name == "auto":
        name = "pallas" if jax.default_backend() == "gpu" else "reference"
    if name == "pallas":
        return _pallas_ops(interpret=False)
    if name == "pallas_interpret":
        return _pallas_ops(interpret=True)
    if name == "reference":
        return _reference_ops()
    raise ValueError(f"name={name!r} must be one of {', '.join(map(repr, BACKEND_NAMES))}")
