"""Work assignment of the attention kernels: which program attends which rows and keys.

Both attention kernels run one program per *work item*, KV head and split. An item is one
row of an int32 table ``items[num_items, 4]``:

    column  ITEM_SEQ   ITEM_ROW          ITEM_LO / ITEM_HI
            sequence   first flat q row  key range [lo, hi) in tokens, intersected with
            (num_seqs                    the causal (and sliding-window) range of the rows
            = unused)

* Ragged items are *query blocks*: block_q consecutive new tokens of one sequence, the
  whole key range. A sequence of q_len new tokens has cdiv(q_len, block_q) of them; the
  static count cdiv(num_tokens, block_q) + num_seqs always suffices. The unused items'
  rows cover the padding rows past ``query_start_loc[-1]`` so the kernel zeroes them.
  With ``skip_decode`` the single-token (decode) sequences get no query block: a step
  sends those to the decode kernel instead, whose tile has one token's rows rather than
  block_q tokens' (a decode token in a 16-token query block does 16x the work it needs).
* Decode items are *key chunks* of the single-token sequences (flash-decoding with a
  work list): every chunk holds the same number of keys, chosen per call from the real
  total length so that about TARGET_PROGRAMS programs share the work, so a long
  sequence among short ones is cut into several chunks while short ones keep one and
  no program runs much longer than the rest. Chunks of one sequence are merged by
  log-sum-exp (``_attention_kernel.combine_items``). With W = num_seqs +
  cdiv(TARGET_PROGRAMS, num_kv_heads) items, sum(cdiv(len_i, chunk)) <= W always holds
  for chunk = cdiv(total, W - num_seqs).

    lengths  s0: 300   s1: 9000                       s2: 500
    chunk = 2048:  [s0][s1 0:2k][s1 2k:4k][s1 4k:6k][s1 6k:8k][s1 8k:9k][s2][unused..]

An ``AttentionPlan`` holds both tables and the per-row maps of one engine step. It is
computed once per step (``pallas_kernels.step_attention`` memoizes it in the ops'
plan cache) and shared by every layer, instead of being recomputed in each layer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.names import DECODE_TARGET_PROGRAMS as TARGET_PROGRAMS
from pallas_kernels.names import MIN_CHUNK_TOKENS as MIN_CHUNK_TOKENS
from pallas_kernels.names import cdiv

ITEM_SEQ, ITEM_ROW, ITEM_LO, ITEM_HI = range(4)
NO_KEY_LIMIT = 2**30  # ITEM_HI of an item that takes its whole causal key range

_STATIC = {"static": True}


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """Work tables of one step's attention (see the module docstring); a pytree.

    Attributes:
        query_start_loc: i32[num_seqs + 1], as given to the kernels.
        decode_items: i32[num_decode_items, 4] key chunks of the single-token sequences.
        ragged_items: i32[num_query_blocks, 4] query blocks, or None (decode-only step).
        row_seq: i32[num_tokens] sequence of each flat row (num_seqs for padding rows).
        decode_row: bool[num_tokens] rows that are a single-token sequence's token.
        decode_block_k, ragged_block_q: the tilings the tables were cut for (static).
        skip_decode: the ragged table leaves the decode sequences out (static).
    """

    query_start_loc: jax.Array
    decode_items: jax.Array
    ragged_items: jax.Array | None
    row_seq: jax.Array
    decode_row: jax.Array
    decode_block_k: int = dataclasses.field(metadata=_STATIC, default=64)
    ragged_block_q: int = dataclasses.field(metadata=_STATIC, default=16)
    skip_decode: bool = dataclasses.field(metadata=_STATIC, default=True)


jax.tree_util.register_dataclass(AttentionPlan)


def _q_lens(query_start_loc):  # -> i32[num_seqs]
    return jnp.maximum(query_start_loc[1:] - query_start_loc[:-1], 0)


def ragged_items(
    query_start_loc,  # i32[num_seqs + 1]
    num_tokens: int,
    block_q: int,
    *,
    skip_decode: bool = False,
):  # -> i32[cdiv(num_tokens, block_q) + num_seqs, 4]
    """Query-block items of the ragged kernel (module docstring)."""
    num_seqs = query_start_loc.shape[0] - 1
    q_lens = _q_lens(query_start_loc)
    if skip_decode:
        q_lens = jnp.where(q_lens == 1, 0, q_lens)
    blocks = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(blocks)
    num_items = cdiv(num_tokens, block_q) + num_seqs
    j = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.searchsorted(ends, j, side="right").astype(jnp.int32)  # num_seqs when unused
    seq_c = jnp.minimum(seq, num_seqs - 1)
    row = query_start_loc[seq_c] + (j - (ends[seq_c] - blocks[seq_c])) * block_q
    # The k-th unused item zeroes padding rows [end + k * block_q, end + (k + 1) * block_q).
    pad_row = query_start_loc[-1] + (j - ends[-1]) * block_q
    used = seq < num_seqs
    return jnp.stack(
        [
            seq,
            jnp.where(used, row, pad_row),
            jnp.zeros_like(seq),
            jnp.full_like(seq, NO_KEY_LIMIT),
        ],
        axis=1,
    ).astype(jnp.int32)


def num_decode_items(num_seqs: int, num_kv_heads: int) -> int:
    """Static length of a decode work list: one item per sequence plus spare chunks."""
    return num_seqs + cdiv(TARGET_PROGRAMS, max(num_kv_heads, 1))


def decode_items(
    seq_lens,  # i32[num_seqs]
    query_start_loc,  # i32[num_seqs + 1]
    *,
    block_k: int,
    num_items: int,
    sliding_window: int | None = None,
):  # -> i32[num_items, 4]
    """Equal key chunks of every single-token sequence (module docstring).

    A sequence whose query_start_loc range is not exactly one row, or whose length is 0,
    gets no item. `sliding_window` (HF convention) trims each chunk list to the keys the
    query can see.
    """
    num_seqs = seq_lens.shape[0]
    is_decode = _q_lens(query_start_loc) == 1
    ctx = jnp.where(is_decode, jnp.maximum(seq_lens, 0), 0)
    lo = jnp.zeros_like(ctx) if sliding_window is None else jnp.maximum(ctx - sliding_window, 0)
    cb_lo = lo // block_k
    cb_hi = (ctx + block_k - 1) // block_k
    cbs = jnp.maximum(cb_hi - cb_lo, 0)
    spare = max(num_items - num_seqs, 1)
    min_chunk = max(1, MIN_CHUNK_TOKENS // block_k)
    chunk = jnp.maximum(min_chunk, (jnp.sum(cbs) + spare - 1) // spare)
    counts = (cbs + chunk - 1) // chunk
    ends = jnp.cumsum(counts)
    j = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.searchsorted(ends, j, side="right").astype(jnp.int32)
    seq_c = jnp.minimum(seq, num_seqs - 1)
    k = j - (ends[seq_c] - counts[seq_c])
    first = cb_lo[seq_c] + k * chunk
    last = jnp.minimum(first + chunk, cb_hi[seq_c])
    return jnp.stack([seq, query_start_loc[seq_c], first * block_k, last * block_k], axis=1).astype(
        jnp.int32
    )


def row_sequences(query_start_loc, num_tokens: int):  # -> (i32[num_tokens], bool[num_tokens])
    """The sequence of each flat row (num_seqs past the last) and whether it is a decode row."""
    num_seqs = query_start_loc.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(query_start_loc[1:], t, side="right").astype(jnp.int32)
    seq = jnp.where(t < query_start_loc[-1], jnp.minimum(seq, num_seqs), num_seqs)
    q_lens = _q_lens(query_start_loc)
    decode = (seq < num_seqs) & (q_lens[jnp.minimum(seq, num_seqs - 1)] == 1)
    return seq, decode


def make_plan(
    seq_lens,  # i32[num_seqs]
    query_start_loc,  # i32[num_seqs + 1]
    *,
    num_tokens: int,
    num_kv_heads: int,
    decode_block_k: int,
    ragged_block_q: int,
    decode_only: bool,
    sliding_window: int | None = None,
    route_decode: bool = True,
) -> AttentionPlan:
    """The plan of one step: decode chunks, query blocks (unless decode-only), row maps.

    route_decode=False (batch-invariant steps): no row is a decode row and the query
    blocks cover the single-token sequences too, so every row goes through the ragged
    kernel, whose key loop does not depend on the other sequences (the decode kernel's
    key chunks are sized from the whole step's lengths).
    """
    assert route_decode or not decode_only, "a decode-only step routes every row to decode"
    row_seq, decode_row = row_sequences(query_start_loc, num_tokens)
    if not route_decode:
        decode_row = jnp.zeros_like(decode_row)
    dec = decode_items(
        seq_lens,
        query_start_loc,
        block_k=decode_block_k,
        num_items=num_decode_items(seq_lens.shape[0], num_kv_heads),
        sliding_window=sliding_window,
    )
    ragged = None
    if not decode_only:
        ragged = ragged_items(query_start_loc, num_tokens, ragged_block_q, skip_decode=route_decode)
    return AttentionPlan(
        query_start_loc=query_start_loc,
        decode_items=dec,
        ragged_items=ragged,
        row_seq=row_seq,
        decode_row=decode_row,
        decode_block_k=decode_block_k,
        ragged_block_q=ragged_block_q,
        skip_decode=route_decode,
    )
