"""InputBatch.prepare's decode path and reused sampling arrays equal a per-token reference.

prepare skips the per-token index arithmetic when every sequence has one new token and
reuses the padded per-row sampling arrays while the scheduled rows (and their
requests) stay the same. A plain per-token, per-sequence reference packer must give
identical arrays on random decode-only and mixed steps, across requests leaving and
new ones (with other sampling settings) taking their rows.
"""

from __future__ import annotations

import random

import numpy as np

from paged_jax.config import EngineConfig, bucket_for
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.input_batch import PAD_SLOT_ID, InputBatch, ScheduledSeq
from paged_jax.worker.step_input import StepInput

BS = 4
MAX_LEN = 32


def packed(step: StepInput) -> dict[str, np.ndarray]:
    """The StepInput's arrays under the reference's names (one KV-cache group)."""
    attention, sampling, feed = step.attention, step.sampling, step.feed
    out = {"token_ids": step.token_ids, "positions": step.positions}
    out.update(slot_mapping=attention.slot_mappings[0], block_tables=attention.block_tables[0])
    for name in ("seq_lens", "query_start_loc", "logits_indices"):
        out[name] = getattr(attention, name)
    for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "counters"):
        out[name] = getattr(sampling, name)
    out["masked_token_ids"] = sampling.masked_token_ids
    out.update(token_rows=feed.token_rows, sample_rows=feed.sample_rows)
    return out


def reference(batch: InputBatch, seqs: list[ScheduledSeq]) -> dict[str, np.ndarray]:
    cfg = batch.config
    table = batch.block_table.tables[0]
    n = len(seqs)
    t = sum(s.num_new_tokens for s in seqs)
    t_pad = bucket_for(t, cfg.token_buckets)
    s_pad = bucket_for(min(t_pad, cfg.max_num_seqs), cfg.seq_buckets)  # S follows from T
    assert s_pad >= n
    out = {
        "token_ids": np.zeros(t_pad, np.int32),
        "positions": np.zeros(t_pad, np.int32),
        "slot_mapping": np.full(t_pad, PAD_SLOT_ID, np.int32),
        "token_rows": np.full(t_pad, -1, np.int32),
        "block_tables": np.zeros((s_pad, table.shape[1]), np.int32),
        "seq_lens": np.zeros(s_pad, np.int32),
        "query_start_loc": np.full(s_pad + 1, t, np.int32),
        "logits_indices": np.zeros(s_pad, np.int32),
        "temperature": np.zeros(s_pad, np.float32),
        "top_k": np.zeros(s_pad, np.int32),
        "top_p": np.ones(s_pad, np.float32),
        "min_p": np.zeros(s_pad, np.float32),
        "seeds": np.zeros(s_pad, np.uint32),
        "counters": np.zeros(s_pad, np.int32),
        "masked_token_ids": np.full((s_pad, batch.stop_ids.shape[1]), -1, np.int32),
        "sample_rows": np.full(s_pad, len(batch.req_of_row), np.int32),
    }
    out["query_start_loc"][0] = 0
    k = 0
    for i, s in enumerate(seqs):
        row = batch.row_of[s.req_id]
        for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
            out["token_ids"][k] = batch.token_ids[row, pos]
            out["positions"][k] = pos
            block = table[row, pos // BS]
            out["slot_mapping"][k] = block * BS + pos % BS
            out["token_rows"][k] = row if pos >= batch.num_token_ids[row] else -1
            k += 1
        out["block_tables"][i] = table[row]
        out["seq_lens"][i] = s.num_computed_tokens + s.num_new_tokens
        out["query_start_loc"][i + 1] = k
        out["logits_indices"][i] = k - 1
        for name in ("temperature", "top_k", "top_p", "min_p", "seeds"):
            out[name][i] = getattr(batch, name)[row]
        out["counters"][i] = s.num_output_tokens
        if s.num_output_tokens < batch.min_tokens[row]:
            out["masked_token_ids"][i] = batch.stop_ids[row]
        out["sample_rows"][i] = row
    return out


def test_prepare_matches_a_per_token_reference_on_decode_and_mixed_steps():
    rng = random.Random(7)
    cfg = EngineConfig(
        block_size=BS,
        max_num_seqs=8,
        max_num_batched_tokens=8 * MAX_LEN,
        max_model_len=MAX_LEN,
        num_kv_blocks=80,
    )
    batch = InputBatch(cfg)
    live: dict[str, list[int]] = {}  # req_id -> [num_computed, num_output]
    next_block = 1
    decode_steps = reused = 0
    previous = None
    for step in range(300):
        # Requests leave (done, or at random) and new ones (other settings) take rows.
        for rid in [r for r, (computed, _) in live.items() if computed >= MAX_LEN - 2]:
            batch.remove_request(rid)
            del live[rid]
        if live and rng.random() < 0.1:
            gone = rng.choice(sorted(live))
            batch.remove_request(gone)
            del live[gone]
        while len(live) < 8 and (not live or rng.random() < 0.3):
            rid = f"r{step}-{len(live)}"
            prompt = [rng.randrange(100) for _ in range(rng.randint(1, 12))]
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.7, 1.3]),
                top_k=rng.choice([0, 5]),
                top_p=rng.choice([1.0, 0.9]),
                min_tokens=rng.choice([0, 0, 3]),
                stop_token_ids=[rng.randrange(100)],
            )
            blocks = list(range(next_block, next_block + MAX_LEN // BS))
            next_block += len(blocks)
            batch.add_request(
                rid,
                prompt,
                blocks,
                params,
                seed=rng.randrange(2**31),
                min_tokens_stop_ids=params.stop_token_ids,
            )
            live[rid] = [rng.randint(0, len(prompt) - 1), 0]
        # Schedule: mostly everyone decoding one token, sometimes prefill chunks too.
        decode = rng.random() < 0.7
        seqs = []
        for rid, (computed, num_out) in live.items():
            num_new = 1 if decode else rng.randint(1, MAX_LEN - 2 - computed)
            seqs.append(ScheduledSeq(rid, computed, num_new, num_out))
        if rng.random() < 0.2:
            rng.shuffle(seqs)
        got = batch.prepare(seqs)
        # Reused: the very arrays of the previous step, not equal copies.
        reused += previous is not None and got.sampling.temperature is previous.temperature
        previous = got.sampling
        want = reference(batch, seqs)
        got_arrays = packed(got)
        for name, value in want.items():
            np.testing.assert_array_equal(got_arrays[name], value, err_msg=f"{name} @ {step}")
        assert got.attention.decode_only == all(s.num_new_tokens == 1 for s in seqs)
        decode_steps += got.attention.decode_only
        # The step ran; some rows get their sampled token on the host (others keep a
        # placeholder, read on device), so token_rows varies.
        for s in seqs:
            entry = live[s.req_id]
            entry[0] += s.num_new_tokens
            row = batch.row_of[s.req_id]
            if batch.num_token_ids[row] < MAX_LEN and rng.random() < 0.5:
                batch.append_sampled([row], [rng.randrange(100)])
                entry[1] += 1
    assert decode_steps > 100
    assert reused > 20  # the sampling arrays were reused, and still matched
