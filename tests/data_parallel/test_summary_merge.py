"""The data-parallel summary merges the replicas' figures into the single-process summary's
keys (issue 38 item 11): counts summed, rates recomputed from the summed counts, start-up
figures the largest replica's. Host-only: the replicas' figures are written out here."""

from __future__ import annotations

import pytest

from paged_jax.entrypoints.data_parallel import merge_replica_figures


def _replica(name, **figures):
    base = {
        "name": name,
        "load_s": 1.0,
        "warmup_s": 2.0,
        "kv_blocks": 64,
        "peak_kv_usage": 0.5,
        "prefix_cache_hit_rate": 0.0,
        "prefix_cache_queries": 0,
        "prefix_cache_hits": 0,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "preemptions": 0,
        "start": "cold",
        "programs": 4,
        "programs_compiled": 4,
        "programs_loaded": 0,
        "warmup_trace_s": 0.1,
        "warmup_lower_s": 0.1,
        "warmup_compile_s": 1.0,
        "warmup_cache_load_s": 0.0,
        "warmup_cache_save_s": 0.2,
        "warmup_run_s": 0.3,
        "warmup_other_s": 0.0,
        "executable_cache_problems": 0,
        "warmup_compiles": 4,
        "compiles_after_warmup": 0,
        "steps": 10,
        "median_step_ms": 5.0,
        "compile_cache": "/cache",
        "compile_cache_hits": 0,
        "compile_cache_misses": 4,
    }
    return {**base, **figures}


def test_speculation_counts_are_summed_and_rates_recomputed():
    # Before: the data-parallel summary had no spec_* keys at all.
    a = _replica(
        "a",
        spec_method="ngram",
        spec_num_draft_tokens=10,
        spec_num_accepted_tokens=9,
        spec_drafted_per_position=[5, 5],
        spec_accepted_per_position=[5, 4],
    )
    b = _replica(
        "b",
        spec_method="ngram",
        spec_num_draft_tokens=90,
        spec_num_accepted_tokens=9,
        spec_drafted_per_position=[50, 40],
        spec_accepted_per_position=[6, 3],
    )
    merged = merge_replica_figures([a, b])
    assert merged["spec_method"] == "ngram"
    assert (merged["spec_draft_tokens"], merged["spec_accepted_tokens"]) == (100, 18)
    assert merged["spec_acceptance_rate"] == 0.18  # not the mean of 0.9 and 0.1
    assert merged["spec_accept_per_position"] == [round(11 / 55, 3), round(7 / 45, 3)]


def test_start_up_figures_are_there_counts_summed_seconds_the_largest():
    # Before: no start, programs*, warmup_*_s, executable_cache_problems or compile_cache_*.
    a = _replica("a", warmup_compile_s=3.0, prefix_cache_queries=10, prefix_cache_hits=9)
    b = _replica(
        "b",
        start="warm",
        programs_compiled=0,
        programs_loaded=4,
        warmup_cache_load_s=0.5,
        executable_cache_problems=1,
        compile_cache_hits=4,
        compile_cache_misses=0,
        prefix_cache_queries=90,
        prefix_cache_hits=1,
        steps=5,
    )
    merged = merge_replica_figures([a, b])
    assert merged["start"] == "partial"  # one cold, one warm
    assert (merged["programs"], merged["programs_compiled"], merged["programs_loaded"]) == (4, 4, 4)
    assert merged["warmup_compile_s"] == 3.0 and merged["warmup_cache_load_s"] == 0.5
    assert merged["executable_cache_problems"] == 1 and merged["steps"] == 15
    assert (merged["compile_cache_hits"], merged["compile_cache_misses"]) == (4, 4)
    assert merged["prefix_cache_hit_rate"] == 0.1  # 10 hits of 100 queries, not (0.9+0.01)/2
    assert "spec_method" not in merged  # no speculation: no spec keys, as single-process
    assert merge_replica_figures([a, dict(a, name="c")])["start"] == "cold"


@pytest.mark.parametrize("each", [[], [_replica("a")]])
def test_merging_no_or_one_replica_keeps_every_key(each):
    merged = merge_replica_figures(each)
    assert "warmup_run_s" in merged and "compile_cache" in merged
    if each:
        assert merged["warmup_run_s"] == 0.3 and merged["kv_blocks"] == 64
