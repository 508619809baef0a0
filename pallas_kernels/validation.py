"""One input validator shared by every kernel and its reference (static shapes/dtypes only).

Checks run at trace time on shapes and dtypes; they never look at values, so they are
free under jit. Errors are ValueErrors naming the argument and what was expected.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax.numpy as jnp

from pallas_kernels.layout import max_offset_safe_blocks, offsets_wrap
from pallas_kernels.quantization import FP8_DTYPES, is_fp8

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES


def array_shape(name: str, x: Any) -> tuple[int, ...]:
    """x's shape, or a ValueError naming `name` when x is not one array."""
    shape = getattr(x, "shape", None)
    if isinstance(x, (tuple, list)):
        # paged_jax's AttentionMetadata.block_tables / slot_mappings hold one array per
        # KV-cache group; a model written to the one-group contract passes the tuple.
        raise ValueError(
            f"{name} must be an array, got a {type(x).__name__} of {len(x)} (one per "
            "KV-cache group?): pass one group's array, e.g. "
            "attn_metadata.for_group(0).block_table / .slot_mapping"
        )
    if shape is None or getattr(x, "dtype", None) is None:
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(shape)


def _expect(name: str, x: Any, shape: tuple[int | None, ...], what: str, dtypes=None) -> None:
    """`shape` entries of None are free; `what` spells the expected shape for messages."""
    got = array_shape(name, x)
    if len(got) != len(shape) or any(e is not None and e != g for e, g in zip(shape, got)):
        raise ValueError(f"{name} must have shape {what}, got {got}")
    if dtypes is not None and jnp.dtype(x.dtype) not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({names}), got {x.dtype}")


def validate_kv_cache(k_cache: Any, v_cache: Any) -> tuple[int, int, int, int]:
    """Returns (num_blocks, num_kv_heads, block_size, head_dim)."""
    _expect(
        "k_cache",
        k_cache,
        (None, None, None, None),
        "[num_blocks, num_kv_heads, block_size, head_dim]",
        CACHE_DTYPES,
    )
    _expect("v_cache", v_cache, tuple(k_cache.shape), f"{tuple(k_cache.shape)} (same as k_cache)")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache must have dtype {k_cache.dtype} (as k_cache), got {v_cache.dtype}"
        )
    return tuple(k_cache.shape)


def check_offsets_fit(name: str, array: Any) -> None:
    """Refuses an array that a Triton kernel would address with wrapping offsets.

    JAX's Triton lowering uses 32-bit signed element offsets for arrays of at most 2**32
    bytes, so more than 2**31 elements there (a 1-byte fp8 cache of 2-4 GiB) would read
    and write out of bounds (layout.py). Static: shapes and dtypes only.

    Raises:
        ValueError: naming ``name``, its shape, dtype and bytes, and the most blocks
            (leading dim) it may have.
    """
    shape = array_shape(name, array)
    itemsize = jnp.dtype(array.dtype).itemsize
    if not offsets_wrap(shape, itemsize):
        return
    block_elems = math.prod(shape[1:])
    safe = max_offset_safe_blocks(block_elems, itemsize, shape[0])
    nbytes = math.prod(shape) * itemsize
    raise ValueError(
        f"{name} of shape {shape} dtype {array.dtype} ({nbytes} bytes) has more than 2**31 "
        "elements in at most 2**32 bytes: a Triton kernel addresses it with 32-bit element "
        f"offsets that wrap (out-of-bounds reads and writes); use at most {safe} blocks "
        f"(num_kv_blocks <= {safe})"
    )


def validate_kv_scales(k_cache: Any, k_scale: Any, v_scale: Any) -> None:
    """Scales are None (1.0) or float scalars (traced is fine), and only for an fp8 cache."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if value is None:
            continue
        if not is_fp8(k_cache.dtype):
            raise ValueError(
                f"{name} must be None for a {k_cache.dtype} cache (scales apply to fp8 caches)"
            )
        # Under jit the wrappers see tracers: only shape and dtype can be checked here.
        shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
        if isinstance(value, float):
            continue
        if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{name} must be a float scalar (shape ()), got shape {shape} dtype {dtype}"
            )


def validate_attention_inputs(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any = None,
    *,
    scale: Any = 1.0,
    sliding_window: Any = None,
    soft_cap: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
) -> None:
    """Validates decode (query_start_loc=None) or ragged attention inputs."""
    _, num_kv_heads, _, head_dim = validate_kv_cache(k_cache, v_cache)
    q_rows = "num_seqs" if query_start_loc is None else "num_tokens"
    _expect("q", q, (None, None, head_dim), f"[{q_rows}, num_q_heads, {head_dim}]")
    if is_fp8(k_cache.dtype):
        if jnp.dtype(q.dtype) not in FLOAT_DTYPES:
            raise ValueError(f"q must have a float dtype in {FLOAT_DTYPES}, got {q.dtype}")
    elif q.dtype != k_cache.dtype:
        raise ValueError(f"q must have dtype {k_cache.dtype} (the cache dtype), got {q.dtype}")
    validate_kv_scales(k_cache, k_scale, v_scale)
    num_q_heads = q.shape[1]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q has num_q_heads={num_q_heads}, which must be a multiple of "
            f"num_kv_heads={num_kv_heads}"
        )
    _expect(
        "block_tables",
        block_tables,
        (None, None),
        "[num_seqs, max_blocks_per_seq]",
        (jnp.dtype(jnp.int32),),
    )
    num_seqs = block_tables.shape[0]
    if block_tables.shape[1] == 0:
        raise ValueError("block_tables must have max_blocks_per_seq >= 1, got 0")
    _expect("seq_lens", seq_lens, (num_seqs,), f"[{num_seqs}] (num_seqs)", (jnp.dtype(jnp.int32),))
    if query_start_loc is None:
        if q.shape[0] != num_seqs:
            raise ValueError(f"q must have shape [{num_seqs}, ...] (num_seqs), got {q.shape}")
    else:
        _expect(
            "query_start_loc",
            query_start_loc,
            (num_seqs + 1,),
            f"[{num_seqs + 1}] (num_seqs + 1)",
            (jnp.dtype(jnp.int32),),
        )
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
        raise ValueError(f"scale={scale!r} must be a positive Python float")
    if sliding_window is not None and (
        not isinstance(sliding_window, int)
        or isinstance(sliding_window, bool)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window={sliding_window!r} must be None or an int >= 1")
    if soft_cap is not None and (
        not isinstance(soft_cap, (int, float)) or isinstance(soft_cap, bool) or soft_cap <= 0
    ):
        raise ValueError(f"soft_cap={soft_cap!r} must be None or a positive Python float")


def validate_write_kv(
    k_cache: Any,
    v_cache: Any,
    k: Any,
    v: Any,
    slot_mapping: Any,
    k_scale: Any = None,
    v_scale: Any = None,
) -> None:
    _, num_kv_heads, _, head_dim = validate_kv_cache(k_cache, v_cache)
    validate_kv_scales(k_cache, k_scale, v_scale)
    what = f"[num_tokens, {num_kv_heads}, {head_dim}] (num_tokens, num_kv_heads, head_dim)"
    _expect("k", k, (None, num_kv_heads, head_dim), what)
    _expect("v", v, tuple(k.shape), what)
    _expect(
        "slot_mapping",
        slot_mapping,
        (k.shape[0],),
        f"[{k.shape[0]}] (num_tokens)",
        (jnp.dtype(jnp.int32),),
    )


def validate_copy_blocks(
    k_cache: Any, v_cache: Any, src_block_ids: Any, dst_block_ids: Any
) -> None:
    validate_kv_cache(k_cache, v_cache)
    _expect("src_block_ids", src_block_ids, (None,), "[num_copies]", (jnp.dtype(jnp.int32),))
    n = src_block_ids.shape[0]
    _expect("dst_block_ids", dst_block_ids, (n,), f"[{n}] (num_copies)", (jnp.dtype(jnp.int32),))


# --------------------------------------------------------------------------------------
# Value checks (validate=True): run on device under jax.experimental.checkify.
#
# Triton does no bounds checking: an out-of-range block id or slot is an illegal address
# (or a silent write into another block) on a GPU, while interpret mode and the XLA
# references clamp or drop it and so hide the bug on CPU. With validate=True each kernel
# and reference checks the ids it will dereference against the pool first. The checks
# are checkify.check calls, so the caller must functionalize them: wrap the function (or
# the jitted step that calls it) in checkify.checkify and call .throw() on the error, or
# use pallas_kernels.checked(fn), which does both. Without that wrapper, tracing fails
# loudly ("Cannot abstractly evaluate a checkify.check which was not functionalized")
# rather than skipping the checks.


def _first_bad(bad):  # bool[...] -> (any bad, flat index of the first bad entry)
    flat = bad.reshape(-1)
    return jnp.any(flat), jnp.argmax(flat).astype(jnp.int32)


def check_block_tables(block_tables: Any, num_blocks: int) -> None:
    """Every entry of block_tables i32[S, W] is a block id in [0, num_blocks)."""
    from jax.experimental import checkify

    width = block_tables.shape[1]
    any_bad, i = _first_bad((block_tables < 0) | (block_tables >= num_blocks))
    checkify.check(
        ~any_bad,
        f"block_tables[{{row}}, {{col}}] = {{value}} is not a block id in [0, {num_blocks}) "
        "(the KV pool's num_blocks)",
        row=i // width,
        col=i % width,
        value=block_tables.reshape(-1)[i],
    )


def check_seq_lens(
    seq_lens: Any, max_blocks_per_seq: int, block_size: int, query_start_loc: Any = None
) -> None:
    """0 <= seq_lens <= the block table's capacity; with query_start_loc, the new tokens
    fit in their context (0 <= q_len <= seq_len) and query_start_loc starts at 0."""
    from jax.experimental import checkify

    cap = max_blocks_per_seq * block_size
    any_bad, i = _first_bad((seq_lens < 0) | (seq_lens > cap))
    checkify.check(
        ~any_bad,
        f"seq_lens[{{i}}] = {{value}} must be in [0, {cap}] (max_blocks_per_seq * block_size)",
        i=i,
        value=seq_lens[i],
    )
    if query_start_loc is None:
        return
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    any_bad, i = _first_bad((q_lens < 0) | (q_lens > seq_lens))
    checkify.check(
        ~any_bad,
        "sequence {i} has q_len = query_start_loc[i+1] - query_start_loc[i] = {q_len}, "
        "which must be in [0, seq_lens[i] = {seq_len}]",
        i=i,
        q_len=q_lens[i],
        seq_len=seq_lens[i],
    )
    checkify.check(
        query_start_loc[0] == 0, "query_start_loc[0] = {v} must be 0", v=query_start_loc[0]
    )


def check_num_tokens(query_start_loc: Any, num_tokens: int) -> None:
    """The new tokens of all sequences fit in the q rows: query_start_loc[-1] <= num_tokens."""
    from jax.experimental import checkify

    checkify.check(
        query_start_loc[-1] <= num_tokens,
        f"query_start_loc[-1] = {{v}} must be <= num_tokens = {num_tokens} (rows of q)",
        v=query_start_loc[-1],
    )


def check_slot_mapping(slot_mapping: Any, num_blocks: int, block_size: int) -> None:
    """Each slot is -1 (dropped) or in [0, num_blocks * block_size); real slots distinct."""
    from jax.experimental import checkify

    num_slots = num_blocks * block_size
    any_bad, i = _first_bad((slot_mapping < -1) | (slot_mapping >= num_slots))
    checkify.check(
        ~any_bad,
        f"slot_mapping[{{i}}] = {{value}} must be -1 (padding) or a slot in [0, {num_slots}) "
        f"(num_blocks * block_size = {num_blocks} * {block_size})",
        i=i,
        value=slot_mapping[i],
    )
    if slot_mapping.shape[0] > 1:
        s = jnp.sort(slot_mapping)
        any_dup, j = _first_bad((s[1:] == s[:-1]) & (s[1:] >= 0))
        checkify.check(
            ~any_dup,
            "slot_mapping writes slot {slot} twice (real slots must be distinct)",
            slot=s[j + 1],
        )


def check_copy_pairs(src_block_ids: Any, dst_block_ids: Any, num_blocks: int) -> None:
    """src in [0, num_blocks); dst -1 (skipped) or in [0, num_blocks); real destinations
    distinct and never also a source of the same call (copies run in any order)."""
    from jax.experimental import checkify

    any_bad, i = _first_bad((src_block_ids < 0) | (src_block_ids >= num_blocks))
    checkify.check(
        ~any_bad,
        f"src_block_ids[{{i}}] = {{value}} is not a block id in [0, {num_blocks})",
        i=i,
        value=src_block_ids[i],
    )
    any_bad, i = _first_bad((dst_block_ids < -1) | (dst_block_ids >= num_blocks))
    checkify.check(
        ~any_bad,
        f"dst_block_ids[{{i}}] = {{value}} must be -1 (padding) or a block id in [0, {num_blocks})",
        i=i,
        value=dst_block_ids[i],
    )
    n = dst_block_ids.shape[0]
    if n > 1:
        live = dst_block_ids >= 0
        same = (dst_block_ids[:, None] == dst_block_ids[None, :]) & live[:, None]
        same &= ~jnp.eye(n, dtype=bool)
        any_dup, i = _first_bad(jnp.any(same, axis=1))
        checkify.check(
            ~any_dup,
            "dst_block_ids[{i}] = {value} appears twice (destinations must be distinct)",
            i=i,
            value=dst_block_ids[i],
        )
        is_src = jnp.any(dst_block_ids[:, None] == src_block_ids[None, :], axis=1) & live
        any_bad, i = _first_bad(is_src)
        checkify.check(
            ~any_bad,
            "dst_block_ids[{i}] = {value} is also a source of this copy (copies run in any order)",
            i=i,
            value=dst_block_ids[i],
        )


def check_decode_rows(query_start_loc: Any) -> None:
    """A decode-only step: every sequence has at most one new token, row i = sequence i
    (query_start_loc = [0, 1, ..., n, n, ..., n])."""
    from jax.experimental import checkify

    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    n = query_start_loc[-1]
    expected = (jnp.arange(q_lens.shape[0]) < n).astype(q_lens.dtype)
    any_bad, i = _first_bad(q_lens != expected)
    checkify.check(
        ~any_bad,
        "decode_only step, but sequence {i} has {q_len} new tokens (row i must be "
        "sequence i's single new token)",
        i=i,
        q_len=q_lens[i],
    )


def check_attention_values(
    k_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any = None,
    num_tokens: int | None = None,
) -> None:
    """The value checks every attention kernel and reference runs under validate=True."""
    num_blocks, _, block_size, _ = k_cache.shape
    check_block_tables(block_tables, num_blocks)
    check_seq_lens(seq_lens, block_tables.shape[1], block_size, query_start_loc)
    if query_start_loc is not None and num_tokens is not None:
        check_num_tokens(query_start_loc, num_tokens)


def checked(fn):
    """``fn`` with its validate=True checks functionalized: raises
    ``jax.experimental.checkify.JaxRuntimeError`` naming the first failed check.

    Example: ``checked(partial(pk.paged_attention, scale=s, validate=True))(q, ...)``.
    Syncs with the device after each call (a debug path).
    """
    from jax.experimental import checkify

    wrapped = checkify.checkify(fn)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        err, out = wrapped(*args, **kwargs)
        err.throw()
        return out

    return run
