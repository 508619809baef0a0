"""n > 1 on hybrid models (a sliding-window and a full-attention KV-cache group).

A fork shares its parent's partial last block in every KV-cache group, so its first
write copies one block per group: Gemma-2 and Gemma-3 copy twice per child. The step's
copy arrays are sized for that (max_num_seqs x groups); before, 2 prompts x n=4 at
max_num_seqs 8 (or 5 x n=8 at the default 64) failed the whole run. Seeded samples
must equal serving each prompt alone, and the LLM must keep serving afterwards.
"""

from __future__ import annotations

import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.core.copy_on_write import max_copies_per_step
from paged_jax.testing.bounded import call_within

HYBRID_FAMILIES = ("gemma2", "gemma3_text")
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18, 19, 20, 21], [22, 23, 24]]
# A hang guard, not a speed check: generous for a loaded 2-core machine.
HANG_GUARD_S = 1200


def _completions(outs):
    return [[tuple(c.token_ids) for c in o.outputs] for o in outs]


# Each family once, each size once (the copy arrays' width depends on max_num_seqs and
# the number of KV-cache groups, which both families share: two groups).
@pytest.mark.parametrize(
    "family,max_num_seqs,num_prompts,n",
    [("gemma2", 8, 2, 4), ("gemma3_text", 64, 5, 8)],  # small, and the default max_num_seqs
)
def test_n_samples_on_hybrid_models_equal_serving_each_prompt_alone(
    tiny_hf_checkpoint, family, max_num_seqs, num_prompts, n
):
    path = tiny_hf_checkpoint(family)
    llm = LLM(
        str(path),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=8,
    )
    assert llm.engine.input_batch.copies_width == max_copies_per_step(max_num_seqs, 2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:num_prompts]]
    params = SamplingParams(n=n, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    together = call_within(HANG_GUARD_S, llm.generate, prompts, params, use_tqdm=False)
    assert [len(o.outputs) for o in together] == [n] * num_prompts
    alone = [
        call_within(HANG_GUARD_S, llm.generate, [p], params, use_tqdm=False)[0] for p in prompts
    ]
    assert _completions(together) == _completions(alone)
    # Still serving: another forked batch afterwards.
    again = call_within(HANG_GUARD_S, llm.generate, prompts, params, use_tqdm=False)
    assert _completions(again) == _completions(together)
    stats = llm.get_stats()
    assert stats["num_compiles_after_warmup"] == 0
    kv = llm.engine.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_usable_blocks
