"""The attention kernels' default warp count: 8 for large tiles, where 4 warps spill.

The thresholds come from deviceless sm_90 compiles (scripts/gpu_compile_check.py, rows in
docs/gpu_compile_h200.json): these cases spill at 4 warps and fit at 8.
"""

from __future__ import annotations

import pytest

from pallas_kernels._attention_kernel import default_num_warps


@pytest.mark.parametrize(
    ("rows", "block_k", "head_dim", "warps"),
    [
        (16, 128, 128, 4),  # decode, head_dim 128 (GQA <= 16): fits at 4
        (16, 128, 256, 8),  # decode, head_dim 256: spills at 4
        (64, 64, 128, 4),  # ragged, GQA 4, block_q 16
        (128, 64, 128, 8),  # ragged, GQA 8: a 128-row tile
        (32, 64, 256, 8),  # ragged, GQA 2, head_dim 256 (Gemma 2)
        (16, 64, 256, 4),  # ragged, GQA 1, head_dim 256
        (16, 64, 64, 4),
    ],
)
def test_default_num_warps(rows, block_k, head_dim, warps):
    assert default_num_warps(rows, block_k, head_dim) == warps
