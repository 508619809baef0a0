"""One input validator shared by every kernel and its reference (static shapes/dtypes only).

Checks run at trace time on shapes and dtypes; they never look at values, so they are
free under jit. Errors are ValueErrors naming the argument and what was expected.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _shape(name: str, x: Any) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None or getattr(x, "dtype", None) is None:
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(shape)


def _expect(name: str, x: Any, shape: tuple[int | None, ...], what: str, dtypes=None) -> None:
    """`shape` entries of None are free; `what` spells the expected shape for messages."""
    got = _shape(name, x)
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
        FLOAT_DTYPES,
    )
    _expect("v_cache", v_cache, tuple(k_cache.shape), f"{tuple(k_cache.shape)} (same as k_cache)")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache must have dtype {k_cache.dtype} (as k_cache), got {v_cache.dtype}"
        )
    return tuple(k_cache.shape)


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
) -> None:
    """Validates decode (query_start_loc=None) or ragged attention inputs."""
    _, num_kv_heads, _, head_dim = validate_kv_cache(k_cache, v_cache)
    q_rows = "num_seqs" if query_start_loc is None else "num_tokens"
    _expect("q", q, (None, None, head_dim), f"[{q_rows}, num_q_heads, {head_dim}]")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q must have dtype {k_cache.dtype} (the cache dtype), got {q.dtype}")
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


def validate_write_kv(k_cache: Any, v_cache: Any, k: Any, v: Any, slot_mapping: Any) -> None:
    _, num_kv_heads, _, head_dim = validate_kv_cache(k_cache, v_cache)
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
