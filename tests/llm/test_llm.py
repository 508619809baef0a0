"""LLM.generate and the generate CLI on tiny random-weight checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest

from paged_jax.demo import build_byte_tokenizer, ensure_demo_model
from paged_jax.generate_cli import main as generate_main
from paged_jax.llm import LLM
from paged_jax.sampling_params import SamplingParams

SMALL = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128)


@pytest.fixture(scope="module")
def model_dir(tiny_hf_checkpoint, tmp_path_factory):
    """A tiny Llama whose vocabulary covers the byte tokenizer, with tokenizer.json beside it."""
    src = tiny_hf_checkpoint("llama", vocab_size=259)
    dst = tmp_path_factory.mktemp("llama_tok")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    build_byte_tokenizer().save(str(dst / "tokenizer.json"))
    return dst


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), **SMALL)


def test_string_and_token_prompts_match_transformers(llm, model_dir, hf_greedy):
    texts = ["Hello paged world", "a", "The block table maps logical blocks to physical ones."]
    params = SamplingParams(temperature=0, max_tokens=6)
    outs = llm.generate(texts + [[5, 6, 7, 8, 9]], params, use_tqdm=False)
    assert [o.prompt for o in outs] == texts + [None]
    for o in outs:
        ids = o.prompt_token_ids
        if o.prompt is not None:
            assert ids == [b + 3 for b in o.prompt.encode()]  # byte tokenizer: id = byte + 3
            assert llm.decode(ids) == o.prompt
        want = hf_greedy(model_dir, ids, 6)
        assert o.outputs[0].token_ids == want
        assert o.outputs[0].text == llm.decode(want)
        assert o.metrics.time_to_first_token is not None and o.metrics.time_to_first_token >= 0


def test_parallel_sampling_is_distinct_reproducible_and_shares_blocks(llm):
    prompt = list(range(3, 40))
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8)
    hits_before = llm.get_stats()["prefix_cache_hits"]
    a = llm.generate([prompt], params, use_tqdm=False)[0]
    b = llm.generate([prompt], params, use_tqdm=False)[0]
    samples = [tuple(c.token_ids) for c in a.outputs]
    assert len(samples) == 4 and len(set(samples)) > 1, "children should differ"
    assert samples == [tuple(c.token_ids) for c in b.outputs], "seeded runs should repeat"
    assert [c.index for c in a.outputs] == [0, 1, 2, 3]
    assert llm.get_stats()["prefix_cache_hits"] > hits_before


def test_stop_token_ids_and_stop_strings_cut_at_the_right_place(llm):
    prompt = "Stop here?"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    toks = full.outputs[0].token_ids
    out = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[toks[3]]),
        use_tqdm=False,
    )[0].outputs[0]
    k = toks.index(toks[3])
    assert out.token_ids == toks[: k + 1] and out.finish_reason == "stop"
    assert out.stop_reason == toks[3]
    # A one-character ASCII stop string taken from the greedy output itself.
    k = next(i for i, t in enumerate(toks) if len(s := llm.decode([t])) == 1 and s.isalnum())
    stop = llm.decode([toks[k]])
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == toks[: k + 1]
    assert out.text == llm.decode(toks[:k])


def test_bad_prompts_raise_naming_the_index_and_nothing_runs(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]: .*must be < vocab_size"):
        llm.generate([[1, 2], [1, 999]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    with pytest.raises(
        ValueError, match=r"engine argument max_seqs=4 is not an EngineConfig field"
    ):
        LLM("/nonexistent", max_seqs=4)
    with pytest.raises(FileNotFoundError, match="must be a Hugging Face model directory"):
        LLM("/nonexistent/dir")


def test_demo_model_from_an_empty_cache_dir(tmp_path):
    path = ensure_demo_model(tmp_path / "cache")
    assert (path / "model.safetensors").is_file()
    mtime = (path / "model.safetensors").stat().st_mtime
    assert ensure_demo_model(tmp_path / "cache") == path  # reused, not rewritten
    assert (path / "model.safetensors").stat().st_mtime == mtime
    llm = LLM(str(path), warmup=False, **SMALL)
    out = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


def test_generate_cli_writes_valid_jsonl(model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["one", "two two", "three"]))
    out = tmp_path / "out.jsonl"
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--output", str(out)]
    args += ["--max-tokens", "4", "--block-size", "4", "--max-num-seqs", "8"]
    args += ["--max-num-batched-tokens", "32", "--max-model-len", "64", "--no-tqdm"]
    assert generate_main(args) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["one", "two two", "three"]
    assert all(1 <= len(r["outputs"][0]["token_ids"]) <= 4 for r in records)
    summary = capsys.readouterr().out
    assert "compiles_after_warmup: 0" in summary and "requests: 3" in summary


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--model", "/no/such/dir"], r"--model='/no/such/dir' must be a Hugging Face model"),
        (["--prompts", "/no/such/file.txt"], r"--prompts='/no/such/file.txt' cannot be read"),
        (["--block-size", "12"], r"block_size=12 must be a power of two"),
        (["--temperature", "-1"], r"temperature=-1.0 must be"),
    ],
)
def test_generate_cli_errors_are_clear(args, match, capsys):
    with pytest.raises(SystemExit) as exc:
        generate_main(args)
    assert exc.value.code == 2
    assert pytest.importorskip("re").search(match, capsys.readouterr().err)
