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


def valid_backends(platform: str | None = None) -> tuple[str, ...]:
    """Backend names that run on `platform` (default: jax's default backend).

    "pallas" compiles the kernels with Triton, so it needs a GPU; elsewhere the
    kernels only run in the Pallas interpreter ("pallas_interpret").
    """
    platform = platform or jax.default_backend()
    if platform == "gpu":
        return BACKEND_NAMES
    return tuple(name for name in BACKEND_NAMES if name != "pallas")


def check_backend(name: str, platform: str | None = None) -> None:
    """Raises a ValueError with the valid names when `name` cannot run on `platform`."""
    platform = platform or jax.default_backend()
    valid = valid_backends(platform)
    if name not in valid:
        why = " (Pallas/Triton kernels need an NVIDIA GPU)" if name == "pallas" else ""
        raise ValueError(
            f"attention_backend={name!r} cannot run on this {platform} platform{why}; "
            f"valid here: {', '.join(map(repr, valid))}"
        )


def get_attention_ops(name: str | AttentionOps = "auto") -> AttentionOps:
    """Returns the paged ops of one backend.

    Args:
        name: "auto" (Pallas kernels when ``jax.default_backend() == "gpu"``, else the
            pure-JAX reference), "pallas" (Pallas/Triton kernels, GPU), "pallas_interpret"
            (the same kernels run by the Pallas interpreter, for CPU tests) or "reference";
            an AttentionOps (e.g. one whose ops run per shard of a mesh) is returned as is.

    Raises:
        ValueError: ``name`` is not one of the names above.
    """
    if isinstance(name, AttentionOps):
        return name
    if name == "auto":
        name = "pallas" if jax.default_backend() == "gpu" else "reference"
    if name == "pallas":
        return _pallas_ops(interpret=False)
    if name == "pallas_interpret":
        return _pallas_ops(interpret=True)
    if name == "reference":
        return _reference_ops()
    raise ValueError(f"name={name!r} must be one of {', '.join(map(repr, BACKEND_NAMES))}")
