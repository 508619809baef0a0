"""The generate CLI's hidden states: --hidden-state-layers, the "return_hidden_states" line key,
and the .npy files beside --output (named by line index and layer)."""

from __future__ import annotations

import json

import numpy as np

from paged_jax.entrypoints.generate_cli import main as generate_main
from paged_jax.entrypoints.hidden_state_files import (
    decode_hidden_states,
    encode_hidden_states,
    write_hidden_state_files,
)


def test_asking_lines_get_npy_files_equal_to_transformers(model_dir, tmp_path, capsys):
    import torch
    import transformers

    prompts = tmp_path / "p.jsonl"
    lines = [{"prompt": "one two", "return_hidden_states": True}, {"prompt": "three"}]
    prompts.write_text("\n".join(json.dumps(x) for x in lines))
    out = tmp_path / "out.jsonl"
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--output", str(out)]
    args += ["--max-tokens", "3", "--ignore-eos", "--block-size", "4", "--max-num-seqs", "4"]
    args += ["--max-num-batched-tokens", "16", "--max-model-len", "64", "--no-tqdm"]
    args += ["--hidden-state-layers", "0", "-1", "--no-compile-cache"]
    assert generate_main(args) == 0
    assert "compiles_after_warmup: 0" in capsys.readouterr().out
    records = {r["index"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "hidden_states" not in records[1]
    files = records[0]["hidden_states"]
    assert files["prompt"] == {
        "0": "out.jsonl.0.prompt.layer0.npy",
        "-1": "out.jsonl.0.prompt.layer-1.npy",
    }
    ids = records[0]["prompt_token_ids"] + records[0]["outputs"][0]["token_ids"][:-1]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.as_tensor([ids]), output_hidden_states=True).hidden_states
    p = len(records[0]["prompt_token_ids"])
    for layer, ref in (("0", want[1][0].numpy()), ("-1", want[-1][0].numpy())):
        prompt_rows = np.load(tmp_path / files["prompt"][layer])
        out_rows = np.load(tmp_path / files["outputs"][0][layer])
        assert prompt_rows.shape == (p, 64) and out_rows.shape == (2, 64)
        np.testing.assert_allclose(np.concatenate([prompt_rows, out_rows]), ref, atol=1e-5)


def test_replica_payload_round_trips_to_the_same_files(tmp_path):
    """A data-parallel replica's .npz bytes write the single-process run's files and entry
    (a completion without rows keeps its place); f32 bytes exactly."""
    rng = np.random.default_rng(0)
    states = {
        "prompt": {0: rng.normal(size=(3, 4)).astype(np.float32), -1: np.ones((3, 4), np.float32)},
        "out0": {0: rng.normal(size=(2, 4)).astype(np.float32), -1: np.zeros((2, 4), np.float32)},
        "out1": {},
    }
    got = decode_hidden_states(encode_hidden_states(states))
    assert list(got) == ["prompt", "out0", "out1"] and got["out1"] == {}
    for part, rows in states.items():
        assert list(got[part]) == list(rows)
        for layer in rows:
            np.testing.assert_array_equal(got[part][layer], rows[layer])
    entry = write_hidden_state_files(tmp_path / "o.jsonl", 7, got)["hidden_states"]
    assert entry == {
        "prompt": {"0": "o.jsonl.7.prompt.layer0.npy", "-1": "o.jsonl.7.prompt.layer-1.npy"},
        "outputs": [{"0": "o.jsonl.7.out0.layer0.npy", "-1": "o.jsonl.7.out0.layer-1.npy"}, {}],
    }
    np.testing.assert_array_equal(np.load(tmp_path / entry["outputs"][0]["0"]), states["out0"][0])
    assert write_hidden_state_files(tmp_path / "o.jsonl", 8, None) == {}
