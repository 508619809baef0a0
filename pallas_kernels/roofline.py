"""Bandwidth roofline of the paged kernels: the bytes each must move, and that time on an H200.

Every kernel here is memory-bound at the shapes users run (decode reads each K/V byte
once and does ~2 flops per byte per q head), so its floor is ``bytes / bandwidth``. A
measured time reads as ``roofline_seconds / measured_seconds``: 1.0 is the HBM limit.

Counted: each operand's bytes read and written once (K/V of every visible key, q, the
output, block-table and length entries). Not counted: split-K partials and their
combine, padding rows, re-reads a kernel may do. ``predicted_decode_fraction`` adds
what the decode kernel's design costs on top (partials, load balance of its work list)
and predicts the fraction of peak a GPU run should read. The benchmarks' bandwidth facts
live here too: peak HBM bandwidth by device (``peak_gbps``) and how many calls fill a
timed loop (``calls_per_loop``). Plain Python: no jax, so the benchmark, the compile
check and host code can all use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pallas_kernels.names import DECODE_TARGET_PROGRAMS, MIN_CHUNK_TOKENS, cdiv

H200_BYTES_PER_S = 4.8e12  # HBM3e peak, 4.8 TB/s
INT32_BYTES = 4
# Peak HBM bandwidth (GB/s) by device kind; a name matches its longest key (peak_gbps).
PEAK_GBPS = {
    "H200": H200_BYTES_PER_S / 1e9,
    "H100 SXM": 3350.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "A100": 2039.0,
}
# Device time of one timed loop of the kernel benchmarks (timing.time_loop), and the
# bandwidth that sizes it: a call moving nbytes is assumed to take nbytes / 3 TB/s.
LOOP_SECONDS = 0.02
LOOP_SIZING_BYTES_PER_S = 3e12


def peak_gbps(device_kind: str) -> float | None:
    """Peak HBM bandwidth (GB/s) of a device kind ("NVIDIA H100 80GB HBM3"), None when
    unknown; the longest matching key of PEAK_GBPS wins ("H100 PCIe" before "H100")."""
    hits = [k for k in PEAK_GBPS if k.lower() in device_kind.lower()]
    return PEAK_GBPS[max(hits, key=len)] if hits else None


def calls_per_loop(
    nbytes: int, loop_seconds: float = LOOP_SECONDS, *, lo: int = 5, hi: int = 500
) -> int:
    """Calls of a kernel moving `nbytes` per call that fill ~loop_seconds of device time
    at LOOP_SIZING_BYTES_PER_S, within [lo, hi] (enough calls to dwarf one sync, few
    enough to compile the loop quickly)."""
    return int(min(hi, max(lo, loop_seconds * LOOP_SIZING_BYTES_PER_S / max(nbytes, 1))))


@dataclass(frozen=True)
class Traffic:
    """Bytes one kernel call must move: K/V (the dominant term) and everything else."""

    kv_bytes: int
    other_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.other_bytes

    def seconds(self, bytes_per_s: float = H200_BYTES_PER_S) -> float:
        """The roofline time: every byte at peak bandwidth."""
        return self.total_bytes / bytes_per_s

    def fraction(self, measured_seconds: float, bytes_per_s: float = H200_BYTES_PER_S) -> float:
        """roofline / measured time: the share of peak bandwidth a measured call reached."""
        if measured_seconds <= 0:
            raise ValueError(f"measured_seconds={measured_seconds!r} must be > 0")
        return self.seconds(bytes_per_s) / measured_seconds


def visible_keys(context: int, q_len: int, sliding_window: int | None) -> int:
    """Keys a sequence's q_len newest tokens see together, out of a `context`-token
    history: all of them, or (with a window) those at positions >= first query - window + 1."""
    if sliding_window is None:
        return context
    first_query = context - q_len
    return context - max(0, first_query - sliding_window + 1)


def attention_traffic(
    seq_lens: Sequence[int],
    q_lens: Sequence[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    cache_itemsize: int,
    q_itemsize: int,
    sliding_window: int | None = None,
) -> Traffic:
    """Ragged (or decode, with q_lens all 1) paged attention.

    Args:
        seq_lens: Each sequence's context, its new tokens included.
        q_lens: Each sequence's new tokens (1 for a decode).
        cache_itemsize, q_itemsize: Bytes per element of the cache (1 for fp8) and of
            q / the output.
    """
    if len(seq_lens) != len(q_lens):
        raise ValueError(f"seq_lens ({len(seq_lens)}) and q_lens ({len(q_lens)}) must pair up")
    keys = sum(visible_keys(c, q, sliding_window) for c, q in zip(seq_lens, q_lens))
    kv = 2 * keys * num_kv_heads * head_dim * cache_itemsize  # K and V
    rows = sum(q_lens)
    q_and_out = 2 * rows * num_q_heads * head_dim * q_itemsize
    pages = sum(cdiv(c, block_size) for c in seq_lens)
    metadata = (pages + 2 * len(seq_lens) + 1) * INT32_BYTES  # tables, lens, query starts
    return Traffic(kv, q_and_out + metadata)


def decode_traffic(
    contexts: Sequence[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    cache_itemsize: int,
    q_itemsize: int,
    sliding_window: int | None = None,
) -> Traffic:
    """Decode attention: one new token per sequence (``attention_traffic`` with q_len 1)."""
    return attention_traffic(
        contexts,
        [1] * len(contexts),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        cache_itemsize=cache_itemsize,
        q_itemsize=q_itemsize,
        sliding_window=sliding_window,
    )


def write_kv_traffic(
    num_tokens: int, *, num_kv_heads: int, head_dim: int, in_itemsize: int, cache_itemsize: int
) -> Traffic:
    """KV write: read new K and V rows and their slots, write them into the caches."""
    elems = 2 * num_tokens * num_kv_heads * head_dim
    return Traffic(elems * cache_itemsize, elems * in_itemsize + num_tokens * INT32_BYTES)


def copy_blocks_traffic(
    num_copies: int, *, num_kv_heads: int, block_size: int, head_dim: int, itemsize: int
) -> Traffic:
    """Block copy: read and write whole K and V blocks (all heads), plus the id pairs."""
    block = num_kv_heads * block_size * head_dim * itemsize
    return Traffic(2 * 2 * num_copies * block, 2 * num_copies * INT32_BYTES)


def decode_chunks(
    contexts: Sequence[int],
    *,
    num_kv_heads: int,
    block_k: int,
    sliding_window: int | None = None,
) -> list[int]:
    """Keys of each program's chunk in the decode kernel's work list (plan.decode_items,
    in plain Python): equal chunks cut from the real total, about
    DECODE_TARGET_PROGRAMS programs in all."""
    blocks = []
    for c in contexts:
        lo = 0 if sliding_window is None else max(c - sliding_window, 0)
        blocks.append(max(cdiv(c, block_k) - lo // block_k, 0))
    spare = max(cdiv(DECODE_TARGET_PROGRAMS, num_kv_heads), 1)
    chunk = max(max(1, MIN_CHUNK_TOKENS // block_k), cdiv(sum(blocks), spare))
    return [
        min(chunk, n - i) * block_k for n in blocks for i in range(0, n, chunk)
    ]  # each sequence's chunks, the last one partial


def predicted_decode_fraction(
    contexts: Sequence[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    cache_itemsize: int,
    q_itemsize: int,
    block_k: int = 64,
    sliding_window: int | None = None,
    num_sms: int = 132,
    programs_per_sm: int = 2,
    dram_efficiency: float = 0.92,
) -> dict:
    """What the decode kernel's design predicts as a fraction of peak bandwidth.

    A model, not a measurement: (1) bytes: the roofline's, plus the work list's partial
    outputs and log-sum-exps written and read back by the merge; (2) balance: the
    programs (chunks x KV heads, longest first) run on num_sms x programs_per_sm slots
    that share the bandwidth equally, so the call lasts as long as the busiest slot; (3)
    dram_efficiency: the share of peak HBM bandwidth streaming reads reach on Hopper at
    best (an assumption, about 0.9). fraction = roofline time / modelled time.
    """
    base = decode_traffic(
        contexts,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        cache_itemsize=cache_itemsize,
        q_itemsize=q_itemsize,
        sliding_window=sliding_window,
    )
    chunks = decode_chunks(
        contexts, num_kv_heads=num_kv_heads, block_k=block_k, sliding_window=sliding_window
    )
    group = num_q_heads // num_kv_heads
    items = len(contexts) + cdiv(DECODE_TARGET_PROGRAMS, num_kv_heads)  # static list
    partial_bytes = 2 * items * num_kv_heads * group * (head_dim + 1) * 4  # write + read
    # Busiest slot under longest-first greedy placement, in bytes of K/V.
    per_key = 2 * head_dim * cache_itemsize
    slots = [0] * (num_sms * programs_per_sm)
    for keys in sorted((k for k in chunks for _ in range(num_kv_heads)), reverse=True):
        i = min(range(len(slots)), key=slots.__getitem__)
        slots[i] += keys * per_key
    busiest = max(slots) if chunks else 0
    mean = sum(slots) / len(slots)
    balance = mean / busiest if busiest else 1.0
    total = base.total_bytes + partial_bytes
    modelled_s = total / (H200_BYTES_PER_S * dram_efficiency * balance)
    return dict(
        roofline_us=base.seconds() * 1e6,
        modelled_us=modelled_s * 1e6,
        fraction=base.seconds() / modelled_s,
        balance=balance,
        partial_bytes=partial_bytes,
        num_chunks=len(chunks),
    )
