"""The one seam that picks an implementation of the paged ops: ``get_attention_ops(name)``,
and ``step_attention``, which sends one engine step through it (decode or ragged kernel).

Backends: the Pallas Triton kernels ("pallas", "pallas_interpret"), the Mosaic GPU
attention kernels ("mosaic_gpu", "mosaic_gpu_interpret") and the pure-JAX reference;
callers (models, engine) only ever hold an ``AttentionOps``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import reference
from pallas_kernels.names import BACKEND_NAMES, AttentionBackend, mosaic_jax_reason
from pallas_kernels.validation import check_decode_rows


class AttentionOps(NamedTuple):
    """The paged ops, each with the public signature of its reference in reference.py.

    ``validate`` says whether the ops were bound with ``validate=True`` (device-side
    range checks under checkify; see validation.py). ``takes_plan``: the attention ops
    accept a step's precomputed ``plan=`` (pallas_kernels/plan.py), so ``step_attention``
    computes it once per step and sends a mixed step's decode tokens to the decode
    kernel (the Pallas kernels; the reference needs neither). ``plan_cache``: a dict in
    which ``step_attention`` memoizes plans for the step being traced (``for_step``).
    """

    write_kv: Callable
    ragged_paged_attention: Callable
    paged_attention: Callable
    copy_blocks: Callable
    validate: bool = False
    takes_plan: bool = False
    plan_cache: dict | None = None

    def for_step(self) -> AttentionOps:
        """These ops with a fresh plan cache: call once per traced step (one forward),
        so every layer of the step shares its plan and no traced value outlives it."""
        return AttentionOps(
            self.write_kv,
            self.ragged_paged_attention,
            self.paged_attention,
            self.copy_blocks,
            self.validate,
            self.takes_plan,
            {},
        )


def _pallas_ops() -> AttentionOps:
    """The Pallas kernels, imported on first use: a reference-only caller never loads
    the Triton lowering."""
    from pallas_kernels.block_copy import copy_blocks
    from pallas_kernels.decode_attention import paged_attention
    from pallas_kernels.kv_write import write_kv
    from pallas_kernels.ragged_attention import ragged_paged_attention

    return AttentionOps(
        write_kv, ragged_paged_attention, paged_attention, copy_blocks, takes_plan=True
    )


def _mosaic_ops(interpret: bool, validate: bool) -> AttentionOps:
    """The Mosaic GPU attention kernels (both take a step plan). write_kv and copy_blocks
    are the Triton kernels on a GPU and the references in GPU interpret mode: Pallas
    Triton kernels do not run under Mosaic's interpreter, and the references write the
    same cache bytes."""
    from pallas_kernels.mosaic_decode import paged_attention_mosaic
    from pallas_kernels.mosaic_ragged import ragged_paged_attention_mosaic

    if interpret:
        write_kv, copy_blocks = reference.write_kv, reference.copy_blocks
    else:
        from pallas_kernels.block_copy import copy_blocks
        from pallas_kernels.kv_write import write_kv
    kw = {"validate": True} if validate else {}
    attn = dict(kw, interpret=True) if interpret else kw

    def bind(fn, bound):
        return functools.partial(fn, **bound) if bound else fn

    return AttentionOps(
        write_kv=bind(write_kv, kw),
        ragged_paged_attention=bind(ragged_paged_attention_mosaic, attn),
        paged_attention=bind(paged_attention_mosaic, attn),
        copy_blocks=bind(copy_blocks, kw),
        validate=validate,
        takes_plan=True,
    )


def mosaic_unavailable(name: str, target=None) -> str | None:
    """Why backend `name` ("mosaic_gpu" or "mosaic_gpu_interpret") cannot run here, in
    one line, or None. Both need jax >= names.MOSAIC_MIN_JAX_VERSION; "mosaic_gpu" also
    a GPU of compute capability >= 9 (Hopper: TMA and wgmma).

    Args:
        name: The backend name.
        target: The device the kernels will be compiled for, when it is not this
            process's default device: e.g. a compile-only H200 from
            ``jax.experimental.topologies`` (a deviceless compile on a CPU host). Its
            platform and compute capability are checked instead of
            ``jax.devices()[0]``'s. None: the default device.
    """
    reason = mosaic_jax_reason(jax.__version__)
    if reason is not None or name != "mosaic_gpu":
        return reason
    if target is None:
        if jax.default_backend() != "gpu":
            return (
                "the Mosaic GPU kernels need an NVIDIA GPU, found the "
                f"{jax.default_backend()} platform (compiling for a GPU target: "
                "get_attention_ops(..., target=device))"
            )
        target = jax.devices()[0]
    elif target.platform != "gpu":
        return f"the Mosaic GPU kernels need an NVIDIA GPU target, got a {target.platform} device"
    capability = str(getattr(target, "compute_capability", "0"))
    if float(capability) < 9:
        return (
            f"the Mosaic GPU kernels need a Hopper or newer GPU (compute capability >= 9.0), "
            f"found {target.device_kind} ({capability})"
        )
    return None


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
        takes_plan=ops.takes_plan,
    )


def valid_backends(platform: str | None = None) -> tuple[str, ...]:
    """Backend names that run on `platform` (default: jax's default backend).

    "pallas" compiles the kernels with Triton and "mosaic_gpu" with Mosaic GPU, so both
    need a GPU; elsewhere the kernels only run in an interpreter ("pallas_interpret",
    "mosaic_gpu_interpret"). Both Mosaic names need jax >= 0.11.2 (``mosaic_unavailable``;
    a pre-Hopper GPU is refused when the ops are built).
    """
    platform = platform or jax.default_backend()
    gpu_only = () if platform == "gpu" else ("pallas", "mosaic_gpu")
    if mosaic_jax_reason(jax.__version__) is not None:
        gpu_only += ("mosaic_gpu", "mosaic_gpu_interpret")
    return tuple(name for name in BACKEND_NAMES if name not in gpu_only)


def check_backend(name: str, platform: str | None = None) -> None:
    """Raises a ValueError with the valid names when `name` cannot run on `platform`."""
    platform = platform or jax.default_backend()
    valid = valid_backends(platform)
    if name not in valid:
        why = " (Pallas/Triton kernels need an NVIDIA GPU)" if name == "pallas" else ""
        if name in ("mosaic_gpu", "mosaic_gpu_interpret"):
            reason = mosaic_jax_reason(jax.__version__) or "the Mosaic GPU kernels need a GPU"
            why = f" ({reason})"
        raise ValueError(
            f"attention_backend={name!r} cannot run on this {platform} platform{why}; "
            f"valid here: {', '.join(map(repr, valid))}"
        )


def get_attention_ops(
    name: AttentionBackend | AttentionOps = "auto", *, validate: bool = False, target=None
) -> AttentionOps:
    """Returns the paged ops of one backend.

    Args:
        name: "auto" (Pallas kernels when ``jax.default_backend() == "gpu"``, else the
            pure-JAX reference), "pallas" (Pallas/Triton kernels, GPU), "pallas_interpret"
            (the same kernels run by the Pallas interpreter, for CPU tests), "mosaic_gpu"
            (the Mosaic GPU attention kernels: Hopper or newer, jax >= 0.11.2),
            "mosaic_gpu_interpret" (the same in GPU interpret mode on CPU) or
            "reference"; an AttentionOps (e.g. one whose ops run per shard of a mesh) is
            returned as is. "auto" keeps the Triton kernels on a GPU until a measurement
            shows the Mosaic ones ahead (docs/kernels.md).
        validate: Bind ``validate=True`` into every op: block ids, slots, lengths and
            copy pairs are range-checked on device with checkify (a debug path: the
            caller wraps its jitted function in ``checkify.checkify``).
        target: For a compile-only caller: the GPU device the ops will be compiled for
            (a deviceless compile, e.g. scripts/gpu_compile_check.py's compile-only H200
            on a CPU host). "mosaic_gpu" is then checked against it rather than against
            this process's devices, so the ops come back without a GPU client; running
            them still needs the GPU. None (every engine): this process's default device,
            so a CPU engine asking for "mosaic_gpu" is refused.

    Raises:
        ValueError: ``name`` is not one of the names above, or a Mosaic name where it
            cannot run (``mosaic_unavailable`` says why).
    """
    if isinstance(name, AttentionOps):
        return name
    if name == "auto":
        name = "pallas" if jax.default_backend() == "gpu" else "reference"
    if name in ("pallas", "pallas_interpret"):
        interpret = {"interpret": True} if name == "pallas_interpret" else {}
        return _bind(_pallas_ops(), validate, **interpret)
    if name in ("mosaic_gpu", "mosaic_gpu_interpret"):
        reason = mosaic_unavailable(name, target)
        if reason is not None:
            raise ValueError(f"attention_backend={name!r}: {reason}")
        return _mosaic_ops(name == "mosaic_gpu_interpret", validate)
    if name == "reference":
        return _bind(_reference_ops(), validate)
    raise ValueError(f"name={name!r} must be one of {', '.join(map(repr, BACKEND_NAMES))}")


# Attention of one engine step. Decode rows always go to the decode kernel, whose program
# packs all q heads of one KV head into one tile (one query row per sequence); the ragged
# kernel would give each decode token a block_q-token query block, computing block_q
# times the rows it needs. Whether the step is decode-only is a static Python bool chosen
# on the host, so each (bucket, path) compiles once and the step never branches on device.
#
#     decode-only step:  decode kernel (work list of key chunks) -> rows
#     mixed step:        ragged kernel on the prefill chunks (decode sequences get no
#                        query block) + decode kernel on the single-token sequences,
#                        merged per row: out[t] = decode_row[t] ? dec[row_seq[t]] : ragged[t]
#
# With ops that take a plan, the work tables are computed once per step (memoized in
# ops.plan_cache by their static tiling) and shared by every layer. Ops without one (the
# reference) get the decode kernel for decode-only steps and the ragged one otherwise.


def _step_plan(
    ops, q, k_cache, seq_lens, query_start_loc, *, decode_only, sliding_window, route_decode=True
):
    from pallas_kernels.decode_attention import decode_defaults
    from pallas_kernels.plan import make_plan
    from pallas_kernels.ragged_attention import ragged_block_q, ragged_defaults

    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    block_k = decode_defaults(k_cache.dtype, head_dim, group, block_size)["block_k"]
    block_q = ragged_block_q(
        group, ragged_defaults(k_cache.dtype, head_dim, group, block_size)["block_q"]
    )
    key = (
        num_tokens,
        seq_lens.shape[0],
        num_kv_heads,
        block_k,
        block_q,
        decode_only,
        sliding_window,
        route_decode,
    )
    cache = ops.plan_cache
    if cache is not None and key in cache:
        return cache[key]
    plan = make_plan(
        seq_lens,
        query_start_loc,
        num_tokens=num_tokens,
        num_kv_heads=num_kv_heads,
        decode_block_k=block_k,
        ragged_block_q=block_q,
        decode_only=decode_only,
        sliding_window=sliding_window,
        route_decode=route_decode,
    )
    if cache is not None:
        cache[key] = plan
    return plan


def step_attention(
    ops,  # pallas_kernels.AttentionOps
    q,  # f[num_tokens, num_q_heads, head_dim]
    k_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    v_cache,  # f[num_blocks, num_kv_heads, block_size, head_dim]
    block_tables,  # i32[num_seqs, max_blocks_per_seq]
    seq_lens,  # i32[num_seqs]
    query_start_loc,  # i32[num_seqs + 1]
    *,
    decode_only: bool,
    ragged_only: bool = False,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale=None,  # f32 scalar (traced) or None = 1.0; fp8 caches only
    v_scale=None,
):  # -> f[num_tokens, num_q_heads, head_dim]
    """Ragged paged attention of one step, decode rows through the decode kernel.

    Args:
        ops: The backend's ops (``get_attention_ops``; ``ops.for_step()`` once per traced
            step shares one plan between the layers).
        decode_only: Static. True promises query_start_loc = [0, 1, ..., n, n, ..., n]:
            sequence i's single new token is row i; padded sequences have seq_len 0.
            Checked on device when ``ops.validate``.
        ragged_only: Static. Every row through the ragged kernel, none through the
            decode kernel, whose key chunks depend on the whole step's lengths (a
            batch-invariant engine's steps; with decode_only False). The references have
            one path already.
        Others: As in ``ragged_paged_attention``.

    Returns:
        The same values as ``ops.ragged_paged_attention`` (rows past the real tokens 0).
    """
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if k_scale is not None or v_scale is not None:  # fp8 caches (others reject scales)
        kw.update(k_scale=k_scale, v_scale=v_scale)
    if decode_only and ops.validate:
        check_decode_rows(query_start_loc)
    if ragged_only and decode_only:
        raise ValueError("ragged_only=True needs decode_only=False (one attention path)")
    if ops.takes_plan:
        return _planned_step(
            ops,
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            decode_only,
            kw,
            route_decode=not ragged_only,
        )
    if not decode_only:
        return ops.ragged_paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, **kw
        )
    num_tokens = q.shape[0]
    num_seqs = block_tables.shape[0]
    if num_tokens >= num_seqs:
        q_seq = q[:num_seqs]
    else:
        q_seq = jnp.pad(q, ((0, num_seqs - num_tokens), (0, 0), (0, 0)))
    out = ops.paged_attention(q_seq, k_cache, v_cache, block_tables, seq_lens, **kw)
    # Rows past query_start_loc[-1] (padding tokens) must be 0, as the ragged kernel's are.
    row = jnp.arange(num_seqs, dtype=jnp.int32)
    out = jnp.where((row < query_start_loc[-1])[:, None, None], out, 0)
    if num_tokens >= num_seqs:
        return jnp.pad(out, ((0, num_tokens - num_seqs), (0, 0), (0, 0)))
    return out[:num_tokens]


def _planned_step(
    ops, q, k_cache, v_cache, block_tables, seq_lens, qsl, decode_only, kw, route_decode=True
):
    """step_attention through kernels that take a plan (see the comment above)."""
    plan = _step_plan(
        ops,
        q,
        k_cache,
        seq_lens,
        qsl,
        decode_only=decode_only,
        sliding_window=kw["sliding_window"],
        route_decode=route_decode,
    )
    if not route_decode:
        return ops.ragged_paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, qsl, plan=plan, **kw
        )
    num_seqs = block_tables.shape[0]
    dec = ops.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, plan=plan, **kw)
    dec_rows = dec[jnp.minimum(plan.row_seq, num_seqs - 1)]  # f[num_tokens, heads, d]
    if decode_only:
        other = jnp.zeros((), q.dtype)
    else:
        other = ops.ragged_paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, qsl, plan=plan, **kw
        )
    return jnp.where(plan.decode_row[:, None, None], dec_rows, other)
