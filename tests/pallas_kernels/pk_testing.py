"""Case builders and an independent numpy attention for the kernel tests.

Caches are filled so that everything an output must NOT depend on (block 0, unused
blocks, slots past seq_len) holds poison (NaN, or huge finite values), while the live
slots hold random data. Block tables use a random permutation of the block ids.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import export
from jax.experimental.pallas import cdiv

from paged_jax.testing.bounded import call_within

# The custom call a Pallas Triton kernel lowers to.
TRITON_CALL = "__gpu$xla.gpu.triton"

# Per-dtype tolerances, stated once. f32: the kernel and reference differ only in
# summation order. bf16: inputs are bf16, the kernel feeds bf16 probabilities to the
# p @ V dot (as flash attention does) and outputs round to bf16 (eps 2^-8).
TOL = {
    "float32": dict(atol=2e-5, rtol=2e-5),
    "bfloat16": dict(atol=3e-2, rtol=3e-2),
}


@dataclass(frozen=True)
class Case:
    q: jnp.ndarray  # f[num_rows, num_q_heads, head_dim]
    k_cache: jnp.ndarray  # f[num_blocks, num_kv_heads, block_size, head_dim] (poisoned)
    v_cache: jnp.ndarray
    clean_k: np.ndarray  # f32 numpy copy with poison replaced by 0 (for the naive check)
    clean_v: np.ndarray
    block_tables: jnp.ndarray  # i32[num_seqs, max_blocks_per_seq]
    seq_lens: jnp.ndarray  # i32[num_seqs]
    query_start_loc: jnp.ndarray  # i32[num_seqs + 1] (decode: arange)


def make_case(
    seed: int,
    *,
    seq_lens: list[int],
    q_lens: list[int] | None = None,  # None: decode (one query per sequence)
    num_rows: int | None = None,  # ragged: q rows incl. padding past query_start_loc[-1]
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: str = "float32",
    poison: float = float("nan"),
    spare_blocks: int = 3,
    extra_table_cols: int = 1,
) -> Case:
    rng = np.random.default_rng(seed)
    blocks_per_seq = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    width = max(max(blocks_per_seq), 1) + extra_table_cols
    ids = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(seq_lens), width), np.int32)
    live = np.zeros((num_blocks, block_size), bool)
    cursor = 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        tables[i, :nb] = ids[cursor : cursor + nb]
        cursor += nb
        for t in range(n):
            live[tables[i, t // block_size], t % block_size] = True
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    clean = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    mask = live[:, None, :, None]
    clean = [np.where(mask, c, 0.0).astype(np.float32) for c in clean]
    poisoned = [np.where(mask, c, poison) for c in clean]
    # Round the live values to the cache dtype so the naive check sees the same inputs.
    k_cache, v_cache = (jnp.asarray(p, dtype=dtype) for p in poisoned)
    clean = [np.where(mask, np.asarray(c.astype(jnp.float32)), 0.0) for c in (k_cache, v_cache)]

    if q_lens is None:
        q_lens = [1] * len(seq_lens)
        num_rows = len(seq_lens)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_rows = int(qsl[-1]) if num_rows is None else num_rows
    q = rng.standard_normal((num_rows, num_kv_heads * group, head_dim)).astype(np.float32)
    return Case(
        q=jnp.asarray(q, dtype=dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        clean_k=clean[0],
        clean_v=clean[1],
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray(np.asarray(seq_lens, np.int32)),
        query_start_loc=jnp.asarray(qsl),
    )


def naive_attention(
    case: Case,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> np.ndarray:  # f64[num_rows, num_q_heads, head_dim]; padding rows 0
    """Loop-per-query float64 attention over the clean cache, written apart from the reference."""
    q = np.asarray(case.q.astype(jnp.float32), np.float64)
    tables = np.asarray(case.block_tables)
    seq_lens = np.asarray(case.seq_lens)
    qsl = np.asarray(case.query_start_loc)
    _, num_kv_heads, block_size, _ = case.clean_k.shape
    group = q.shape[1] // num_kv_heads
    out = np.zeros_like(q)
    for i, n in enumerate(seq_lens):
        if n == 0:
            continue  # a padded sequence: its (decode) row sees nothing and is 0
        ks = np.stack(
            [case.clean_k[tables[i, t // block_size], :, t % block_size] for t in range(n)]
        )
        vs = np.stack(
            [case.clean_v[tables[i, t // block_size], :, t % block_size] for t in range(n)]
        )
        q_len = qsl[i + 1] - qsl[i]
        for j in range(q_len):
            row, pos = qsl[i] + j, n - q_len + j
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(q.shape[1]):
                kh = ks[lo : pos + 1, h // group].astype(np.float64)
                vh = vs[lo : pos + 1, h // group].astype(np.float64)
                s = kh @ q[row, h] * scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                p = np.exp(s - s.max())
                out[row, h] = (p / p.sum()) @ vh
    return out


def assert_close(actual, expected, dtype: str) -> None:
    actual = np.asarray(jnp.asarray(actual).astype(jnp.float32))
    assert np.isfinite(actual).all(), "output has NaN/inf: poison leaked"
    np.testing.assert_allclose(actual, np.asarray(expected, np.float32), **TOL[dtype])


def h200_target():
    """A context in which Pallas lowers for an (abstract) H200: 132 SMs, sm_90."""
    if not hasattr(jax.sharding, "AbstractDevice"):  # pragma: no cover - older jax
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice("NVIDIA H200", 132, "gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


@contextlib.contextmanager
def capture_triton_asm():
    """Records the Triton IR text of every Pallas kernel lowered inside the block.

    Yields a dict, kernel name (the pallas_call ``name``) -> list of module texts, one per
    lowering, filled as kernels lower (e.g. by ``lower_for_cuda``): the IR shows what the
    GPU will run (offset widths, masks, loops) with nothing allocated. Wraps the private
    ``jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module``; skips the calling
    test when this jax lacks it. jax's caches are cleared first so no cached lowering
    bypasses the hook.

    Example::

        with capture_triton_asm() as asm:
            lower_for_cuda(pk.write_kv, cache, cache, new, new, slots)
        (text,) = asm["paged_write_kv"]
    """
    import pytest

    try:
        from jax._src.pallas.triton import lowering as triton_lowering
    except ImportError as e:  # pragma: no cover - a jax without the Triton lowering
        pytest.skip(f"jax has no Pallas Triton lowering module: {e}")
    original = getattr(triton_lowering, "lower_jaxpr_to_triton_module", None)
    if original is None:  # pragma: no cover - private API moved
        pytest.skip("jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module is gone")
    captured: dict[str, list[str]] = {}

    def recording(*args, **kwargs):
        result = original(*args, **kwargs)
        op = result.module.operation
        name = str(op.attributes["sym_name"]).strip('"')
        captured.setdefault(name, []).append(op.get_asm())
        return result

    jax.clear_caches()
    triton_lowering.lower_jaxpr_to_triton_module = recording
    try:
        yield captured
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = original
        jax.clear_caches()


def lower_for_cuda(fn, *shapes) -> str:
    """StableHLO text of `fn` exported for CUDA (Triton custom calls allowed)."""
    with h200_target():
        exported = export.export(
            fn if hasattr(fn, "lower") else jax.jit(fn),
            platforms=("cuda",),
            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
        )(*shapes)
    return exported.mlir_module()


def with_timeout(fn, *args, limit_s: float = 300, **kwargs):
    """fn(*args, **kwargs), blocked until ready, in a thread: the test fails if it runs
    past `limit_s` instead of hanging CI (an interpreted kernel call takes seconds). The
    limit is that hang guard, generous on purpose, never a speed check."""
    return call_within(limit_s, lambda: jax.block_until_ready(fn(*args, **kwargs)))
