"""The generate CLI's LoRA: --lora-modules NAME=PATH and a JSONL line's "lora": "NAME"."""

from __future__ import annotations

import json

import pytest

from paged_jax.entrypoints.job import lora_of, parse_lora_modules
from paged_jax.entrypoints.prompts_file import parse_jsonl_line
from paged_jax.lora import LoRARequest


def test_lora_modules_and_line_keys():
    modules = parse_lora_modules(["a=/x", "b=/y"])
    assert modules == {"a": LoRARequest("a", 1, "/x"), "b": LoRARequest("b", 2, "/y")}
    with pytest.raises(ValueError, match=r"--lora-modules 'a' must be NAME=PATH"):
        parse_lora_modules(["a"])
    with pytest.raises(ValueError, match=r"the name 'a' is given twice"):
        parse_lora_modules(["a=/x", "a=/y"])
    line = parse_jsonl_line(0, 1, json.dumps({"prompt": "hi", "lora": "b"}))
    assert line.error is None and lora_of(line, modules) == modules["b"]
    assert lora_of(parse_jsonl_line(0, 1, '{"prompt": "hi"}'), modules) is None
    with pytest.raises(ValueError, match=r"lora='c' must be one of the --lora-modules names"):
        lora_of(parse_jsonl_line(0, 1, '{"prompt": "hi", "lora": "c"}'), modules)
    bad = parse_jsonl_line(0, 3, '{"prompt": "hi", "lora": 5}')
    assert bad.error == "line 3: lora=5 must be the name of a --lora-modules adapter"


def test_cli_serves_lines_with_their_adapter(model_dir, tmp_path, capsys):
    pytest.importorskip("peft", reason="needs peft (the parity oracle)")
    from paged_jax.entrypoints.generate_cli import main as generate_main
    from paged_jax.testing.tiny_lora import build_tiny_peft_adapter, greedy_with_logits, peft_model

    adapter = build_tiny_peft_adapter(model_dir, tmp_path / "ad", rank=4, seed=5)
    lines = [
        {"prompt": "lora line", "lora": "ad"},
        {"prompt": "lora line"},
        {"prompt": "x", "lora": "zz"},
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in lines))
    out = tmp_path / "out.jsonl"
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--output", str(out)]
    args += ["--max-tokens", "4", "--temperature", "0", "--ignore-eos", "--block-size", "4"]
    args += ["--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--max-model-len", "64"]
    args += ["--lora-modules", f"ad={adapter}", "--max-lora-rank", "8", "--no-tqdm"]
    generate_main([*args, "--no-compile-cache"])
    records = sorted(
        (json.loads(x) for x in out.read_text().splitlines()), key=lambda r: r["index"]
    )
    assert "must be one of the --lora-modules names ['ad']" in records[2]["error"]
    prompt_ids = records[0]["prompt_token_ids"]
    assert records[1]["prompt_token_ids"] == prompt_ids
    want_lora, _ = greedy_with_logits(peft_model(model_dir, adapter), prompt_ids, 4)
    want_base, _ = greedy_with_logits(peft_model(model_dir, None), prompt_ids, 4)
    assert want_lora != want_base  # the adapter matters on this prompt
    assert records[0]["outputs"][0]["token_ids"] == want_lora
    assert records[1]["outputs"][0]["token_ids"] == want_base
