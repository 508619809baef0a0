"""The bandwidth roofline's byte counts, by hand for Llama-3-8B-shaped decode and the KV ops."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pallas_kernels import roofline

LLAMA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)


def test_decode_bytes_and_time_by_hand():
    t = roofline.decode_traffic([8192] * 64, cache_itemsize=2, q_itemsize=2, **LLAMA)
    # K and V: 64 seqs x 8192 keys x 8 heads x 128 x 2 B, twice: exactly 2 GiB.
    assert t.kv_bytes == 2 * 64 * 8192 * 8 * 128 * 2 == 2**31
    # q in, output out (64 x 32 x 128 x 2 B each); 64 x 512 table entries, lens, starts.
    assert t.other_bytes == 2 * 64 * 32 * 128 * 2 + (64 * 512 + 2 * 64 + 1) * 4
    assert t.total_bytes == 2_148_663_812
    assert t.seconds() == pytest.approx(447.638e-6, rel=1e-5)  # at 4.8 TB/s
    assert t.fraction(2 * t.seconds()) == pytest.approx(0.5)
    fp8 = roofline.decode_traffic([8192] * 64, cache_itemsize=1, q_itemsize=2, **LLAMA)
    assert fp8.kv_bytes * 2 == t.kv_bytes


def test_window_counts_only_visible_keys():
    assert roofline.visible_keys(8192, 1, 4096) == 4096  # positions 4096..8191
    assert roofline.visible_keys(8192, 10, 4096) == 4096 + 9  # the first query's window
    assert roofline.visible_keys(100, 1, 4096) == 100
    assert roofline.visible_keys(8192, 1, None) == 8192
    ragged = roofline.attention_traffic(
        [8192, 300], [10, 300], cache_itemsize=2, q_itemsize=2, sliding_window=4096, **LLAMA
    )
    assert ragged.kv_bytes == 2 * (4105 + 300) * 8 * 128 * 2


def test_kv_op_bytes_by_hand():
    w = roofline.write_kv_traffic(
        512, num_kv_heads=8, head_dim=128, in_itemsize=2, cache_itemsize=1
    )
    assert (w.kv_bytes, w.other_bytes) == (2 * 512 * 8 * 128, 2 * 512 * 8 * 128 * 2 + 512 * 4)
    c = roofline.copy_blocks_traffic(64, num_kv_heads=8, block_size=16, head_dim=128, itemsize=2)
    assert (c.kv_bytes, c.other_bytes) == (4 * 64 * 8 * 16 * 128 * 2, 2 * 64 * 4)


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="measured_seconds=0"):
        roofline.Traffic(1, 0).fraction(0)
    with pytest.raises(ValueError, match="must pair up"):
        roofline.attention_traffic([1, 2], [1], cache_itemsize=2, q_itemsize=2, **LLAMA)


def test_module_is_jax_free():
    code = "import sys, pallas_kernels.roofline; print('jax' in sys.modules)"
    # timeout: a hang guard only (a bare interpreter start; minutes would mean a hang).
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize(
    "contexts,kv_heads,window",
    [([300, 9000, 500, 0, 1], 8, None), ([8192] * 64, 8, None), ([5000, 40, 7000], 4, 1024)],
)
def test_roofline_chunks_are_the_kernels_work_list(contexts, kv_heads, window):
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import plan

    items = np.asarray(
        plan.decode_items(
            jnp.asarray(contexts, jnp.int32),
            jnp.arange(len(contexts) + 1, dtype=jnp.int32),
            block_k=64,
            num_items=plan.num_decode_items(len(contexts), kv_heads),
            sliding_window=window,
        )
    )
    used = items[items[:, plan.ITEM_SEQ] < len(contexts)]
    from_kernel = sorted((used[:, plan.ITEM_HI] - used[:, plan.ITEM_LO]).tolist())
    modelled = sorted(
        roofline.decode_chunks(contexts, num_kv_heads=kv_heads, block_k=64, sliding_window=window)
    )
    assert from_kernel == modelled


def test_predicted_fraction_falls_when_one_program_would_run_alone():
    kw = dict(
        num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, cache_itemsize=2,
        q_itemsize=2,
    )  # fmt: skip
    big = roofline.predicted_decode_fraction([8192] * 256, **kw)
    assert 0.8 < big["fraction"] <= 0.92 and big["balance"] > 0.95
    # Batch 1 x 8k: 16 chunks x 8 heads = 128 programs for 264 slots.
    one = roofline.predicted_decode_fraction([8192], **kw)
    assert one["num_chunks"] == 16 and one["balance"] < 0.5
    # A 32k sequence among 1k ones is chunked, so balance stays high.
    mixed = roofline.predicted_decode_fraction([1024] * 255 + [32768], **kw)
    assert mixed["balance"] > 0.9
