"""Kernel timing for the bench scripts: jitted loops of a static number of dependent calls
whose every array enters as an argument, the device's copy ceiling, the checks that
no large array was captured as a compile-time constant, and the relative error a loop's
first call is held to against a reference.

Why arguments: a jitted closure that captures a concrete array gets it embedded in the
program as a constant. On jax 0.11.2 a captured 256 MiB array took 12.4 s to lower and
6.8 s to compile (0.18 s passed as an argument); a multi-GiB KV cache never finishes in a
device run's time. ``time_loop`` refuses such a function before lowering it (its traced
jaxpr's constants) and after (the lowered StableHLO's constants).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MAX_CONSTANT_BYTES = 1 << 20  # a larger constant in a timed program is a captured array
NUDGE = 1e-3  # each call's query is the last one's plus NUDGE x its output
# rel_err of a timed kernel against a reference on bf16 q/out: the kernels round the
# probabilities to bf16 (~4e-3 typical), so a larger error is a wrong output.
MAX_REL_ERR = 2e-2


class CapturedArrayError(ValueError):
    """A timed function embeds a large array as a constant instead of taking it as an argument."""


@dataclass(frozen=True)
class LoopTiming:
    """Seconds per call of each timed loop of ``calls_per_loop`` calls (one sync per loop)."""

    calls_per_loop: int
    samples_s: tuple[float, ...]
    lower_s: float
    compile_s: float

    @property
    def median_s(self) -> float:
        return float(np.median(self.samples_s))

    def us_stats(self) -> dict[str, float]:
        """median, min and max microseconds per call (the bench JSONs' us fields)."""
        s = self.samples_s
        return dict(us=self.median_s * 1e6, us_min=min(s) * 1e6, us_max=max(s) * 1e6)


def rel_err(got: Any, want: Any) -> float:
    """Relative L2 error ||got - want|| / ||want|| in f32; inf when got is not all finite."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def looped(fn: Callable, n: int) -> Callable:
    """``jax.jit`` of (x, *operands) -> fn(x, *operands), run n times (n static) in one
    program: call i gets x_i = x_{i-1} + NUDGE * out_{i-1}, so XLA can neither hoist nor
    merge calls, and the first call's output (exactly ``fn(x, *operands)``) is returned.

    fn must return an array of x's shape (attention: the query's). Every array fn reads
    must be among ``operands``: what it closes over is compiled in as a constant.
    """
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"n={n!r} must be an int >= 1")

    def run(x, *operands):
        def body(i, carry):
            x, first = carry
            out = fn(x, *operands)
            first = jnp.where(i == 0, out.astype(first.dtype), first)
            return x + (out * NUDGE).astype(x.dtype), first

        _, first = jax.lax.fori_loop(0, n, body, (x, jnp.zeros_like(x)))
        return first

    return jax.jit(run)


def captured_arrays(traced_consts: Sequence[Any]) -> list[tuple[tuple[int, ...], str, int]]:
    """(shape, dtype, bytes) of each array among a traced jaxpr's constants."""
    out = []
    for c in traced_consts:
        if isinstance(c, (jax.Array, np.ndarray)):
            out.append((tuple(c.shape), str(c.dtype), int(c.size) * c.dtype.itemsize))
    return out


_CONSTANT = re.compile(r"stablehlo\.constant\b.*:\s*tensor<([^>]*)>\s*$")
_CONSTANT_GENERIC = re.compile(r'"stablehlo\.constant"\(\).*:\s*tensor<([^>]*)>\s*\}')


def _tensor_bytes(spec: str) -> int:
    """Bytes of a StableHLO tensor type body, e.g. "4096x8x16x128xbf16" or "f32"."""
    *dims, elem = spec.split("x") if "x" in spec and spec[0].isdigit() else ("", spec)
    dims = [d for d in dims if d]
    count = int(np.prod([int(d) for d in dims])) if dims else 1
    bits = re.search(r"(\d+)", elem)
    if elem.startswith("complex"):
        nbits = 2 * int(bits.group(1)) if bits else 64
    else:
        nbits = int(bits.group(1)) if bits else 32
    return count * max(1, nbits // 8)


def hlo_constants(text: str) -> list[tuple[str, int]]:
    """(tensor type, bytes) of every ``stablehlo.constant`` in a lowered module's text."""
    found = []
    for line in text.splitlines():
        if "stablehlo.constant" not in line:
            continue
        m = _CONSTANT.search(line) or _CONSTANT_GENERIC.search(line)
        if m:
            found.append((m.group(1), _tensor_bytes(m.group(1))))
    return found


def check_no_captured_arrays(jitted: Callable, *args, limit: int = MAX_CONSTANT_BYTES) -> Any:
    """Traces and lowers ``jitted(*args)`` and returns the lowered program; raises
    CapturedArrayError when the trace holds a constant array over `limit` bytes (checked
    before lowering, which is what a big constant makes slow) or the StableHLO does."""
    traced = jitted.trace(*args)
    consts = traced.jaxpr.consts
    big = [c for c in captured_arrays(consts) if c[2] > limit]
    if big:
        raise CapturedArrayError(
            f"the timed function captures {len(big)} array(s) over {limit} B as constants "
            f"(shape, dtype, bytes: {big[:3]}); pass them as arguments"
        )
    lowered = traced.lower()
    big_hlo = [c for c in hlo_constants(lowered.as_text()) if c[1] > limit]
    if big_hlo:
        raise CapturedArrayError(
            f"the lowered program holds {len(big_hlo)} constant(s) over {limit} B "
            f"(type, bytes: {big_hlo[:3]}); pass the arrays as arguments"
        )
    return lowered


def time_loop(
    fn: Callable, x, operands: Sequence[Any], *, n: int, reps: int, time_it: bool = True
) -> tuple[LoopTiming | None, Any]:
    """(timing, fn(x, *operands)) from one compiled loop of n calls (``looped``).

    Checks the program for captured arrays first (``check_no_captured_arrays``), runs it
    once (the warm-up; its first call's output is returned), then times ``reps`` loops,
    one sync each. With ``time_it=False`` it only lowers and checks: (a timing without
    samples, None).
    """
    jitted = looped(fn, n)
    t0 = time.perf_counter()
    lowered = check_no_captured_arrays(jitted, x, *operands)
    lower_s = time.perf_counter() - t0
    if not time_it:
        return LoopTiming(n, (), round(lower_s, 4), 0.0), None
    t0 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    first = jax.block_until_ready(compiled(x, *operands))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(x, *operands))
        samples.append((time.perf_counter() - t0) / n)
    return LoopTiming(n, tuple(samples), round(lower_s, 4), round(compile_s, 4)), first


def copy_ceiling(nbytes: int = 1 << 30, *, n: int = 10, reps: int = 3) -> dict[str, Any]:
    """The device's streaming bandwidth: a jitted loop of n passes over an array of
    `nbytes` (uint32; each pass reads and writes every element: y ^ (y << 13), which no
    simplifier folds across passes), (bytes read + written) / s at the median of `reps`.

    Returns gbps (1e9 B/s), the array's bytes, calls per loop, and the per-pass seconds.
    """
    if nbytes < 4:
        raise ValueError(f"nbytes={nbytes!r} must be >= 4")
    x = jnp.zeros((nbytes // 4,), jnp.uint32) + jnp.uint32(1)

    def one_pass(y, _):
        return y ^ (y << 13)

    @jax.jit
    def passes(y):
        return jax.lax.fori_loop(0, n, lambda i, y: one_pass(y, i), y)

    lowered = check_no_captured_arrays(passes, x)
    compiled = lowered.compile()
    jax.block_until_ready(compiled(x))  # warm-up
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(x))
        samples.append((time.perf_counter() - t0) / n)
    seconds = float(np.median(samples))
    moved = 2 * x.size * 4
    del x
    return dict(
        gbps=moved / seconds / 1e9,
        array_bytes=moved // 2,
        bytes_per_pass=moved,
        passes_per_loop=n,
        seconds_per_pass=seconds,
        samples_s=[float(s) for s in samples],
        method="jitted fori_loop of n passes y ^ (y << 13) over a uint32 array; "
        "(bytes read + written) / median seconds per pass",
    )
