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
from pallas_kernels.names import BACKEND_NAMES, AttentionBackend


class AttentionOps(NamedTuple):
    """The paged ops, each with the public signature of its reference in reference.py.

    ``validate`` says whether the ops were bound with ``validate=True`` (device-side
    range checks under checkify; see validation.py).
    """

    write_kv: Callable
    ragged_paged_attention: Callable
    paged_attention: Callable
    copy_blocks: Callable
    validate: bool = False


def _pallas_ops() -> AttentionOps:
    """The Pallas kernels, imported on first use: a reference-only caller never loads
    the Triton lowering."""
    from pallas_kernels.block_copy import copy_blocks
    from pallas_kernels.decode_attention import paged_attention
    from pallas_kernels.kv_write import write_kv
    from pallas_kernels.ragged_attention import ragged_paged_attention

    return AttentionOps(write_kv, ragged_paged_attention, paged_attention, copy_blocks)


def _reference_ops() -> AttentionOps:
    return AttentionOps(
        reference.write_kv,
        reference.ragged_paged_attention,
        reference.paged_attention,
        reference.copy_blocks,
    )


def _bind(ops: AttentionOps, validate: bool, **bound) -> AttentionOps:
    """`ops` with `bound` (and ``validate=True`` when asked) fixed in every op."""
    kw = dict(bound, validate=True) if validate else bound

    def bind(fn):
        return functools.partial(fn, **kw) if kw else fn

    return AttentionOps(
        write_kv=bind(ops.write_kv),
        ragged_paged_attention=bind(ops.ragged_paged_attention),
        paged_attention=bind(ops.paged_attention),
        copy_blocks=bind(ops.copy_blocks),
        validate=validate,
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


def get_attention_ops(
    name: AttentionBackend | AttentionOps = "auto", *, validate: bool = False
) -> AttentionOps:
    """Returns the paged ops of one backend.

    Args:
        name: "auto" (Pallas kernels when ``jax.default_backend() == "gpu"``, else the
            pure-JAX reference), "pallas" (Pallas/Triton kernels, GPU), "pallas_interpret"
            (the same kernels run by the Pallas interpreter, for CPU tests) or "reference";
            an AttentionOps (e.g. one whose ops run per shard of a mesh) is returned as is.
        validate: Bind ``validate=True`` into every op: block ids, slots, lengths and
            copy pairs are range-checked on device with checkify (a debug path: the
            caller wraps its jitted function in ``checkify.checkify``).

    Raises:
        ValueError: ``name`` is not one of the names above.
    """
    if isinstance(name, AttentionOps):
        return name
    if name == "auto":
        name = "pallas" if jax.default_backend() == "gpu" else "reference"
    if name in ("pallas", "pallas_interpret"):
        interpret = {"interpret": True} if name == "pallas_interpret" else {}
        return _bind(_pallas_ops(), validate, **interpret)
    if name == "reference":
        return _bind(_reference_ops(), validate)
    raise ValueError(f"name={name!r} must be one of {', '.join(map(repr, BACKEND_NAMES))}")
