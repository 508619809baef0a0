"""Hidden states out: EngineConfig(hidden_state_layers=...) + SamplingParams(return_hidden_states=True).

The rows must equal transformers' residual stream (f32, within 1e-5) for Llama (layers
scanned), Qwen3 and Gemma 2 (unrolled), prompt and generated rows alike, whatever splits
the prompt: chunked prefill, a preemption that computes it again, a prefix another
request cached (an asking request reads none). Nothing compiles after warm-up.
"""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.config import EngineConfig
from paged_jax.engine import Engine
from paged_jax.models import load_model
from tests.engine.test_step_failures import within_time_limit

# A 21-token prompt is prefilled over two steps of 16 tokens.
CHUNKED = dict(
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    max_model_len=64,
    attention_backend="reference",
)
LAYERS = (0, 1, -1)  # the first layer, the second (the last of a 2-layer model), final norm
# Rows of magnitude ~1 summed over 64-wide matmuls and 2 layers in f32: ~1e-6 of error.
# The error grows with the rows' magnitude (Gemma scales its embeddings by sqrt(64) = 8,
# rows reach ~7: 1.05e-5 seen), so check_rows scales TOL by the largest row value.
TOL = 1e-5
# Llama scans its layers (the scan carries the capture buffer); the others run unrolled.
FAMILIES = {"llama": "on", "qwen3": "off", "gemma2": "off"}  # llama: activations_llm


def _prompt(seed: int, length: int, vocab: int = 128) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, length)]


@pytest.fixture(scope="module")
def hf_states():
    """Callable (path, ids) -> {layer: f32[L, hidden]} of transformers for LAYERS: layer
    i's output is hidden_states[i + 1] except for the last layer (hidden_states[-1] is
    normed), read with a forward hook."""
    import torch
    import transformers

    models = {}

    def run(path, ids: list[int]) -> dict[int, np.ndarray]:
        if path not in models:
            models[path] = transformers.AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="eager", dtype=torch.float32
            ).eval()
        model = models[path]
        last = {}

        def keep(_module, _inputs, output):
            last["x"] = output[0] if isinstance(output, tuple) else output

        handle = model.model.layers[-1].register_forward_hook(keep)
        try:
            with torch.no_grad():
                out = model(torch.as_tensor([ids]), output_hidden_states=True)
        finally:
            handle.remove()
        num_layers = len(model.model.layers)
        states = {-1: out.hidden_states[-1][0].numpy()}
        for i in (0, 1):
            x = last["x"] if i == num_layers - 1 else out.hidden_states[i + 1]
            states[i] = x[0].numpy()
        return states

    return run


@pytest.fixture(scope="module")
def _llms(tiny_hf_checkpoint):
    return {}


@pytest.fixture
def llms(_llms, activations_llm, tiny_hf_checkpoint):
    """family -> (LLM, path); Llama is the shared activations engine (tests/engine/conftest.py:
    the same LAYERS, steering built but unused here)."""
    made = _llms
    made["llama"] = activations_llm

    def get(family: str) -> tuple[LLM, object]:
        if family not in made:
            path = tiny_hf_checkpoint(family)
            made[family] = (
                LLM(str(path), hidden_state_layers=LAYERS, scan_layers=FAMILIES[family], **CHUNKED),
                path,
            )
        return made[family]

    return get


def check_rows(got: dict, want: dict, rows: slice) -> None:
    assert sorted(got) == sorted(LAYERS)
    for layer in LAYERS:
        assert got[layer].dtype == np.float32
        ref = want[layer][rows]
        scale = max(1.0, float(np.abs(ref).max(initial=0.0)))
        np.testing.assert_allclose(got[layer], ref, atol=TOL * scale, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hidden_states_equal_transformers_under_chunked_prefill(llms, hf_states, family):
    llm, path = llms(family)
    prompts = [_prompt(1, 21), _prompt(2, 6)]
    asking = SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, return_hidden_states=True
    )
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts, [asking, plain], use_tqdm=False)
    out = outs[0]
    generated = out.outputs[0].token_ids
    assert len(generated) == 4
    want = hf_states(str(path), prompts[0] + generated[:-1])
    p = len(prompts[0])
    check_rows(out.prompt_hidden_states, want, slice(0, p))
    # One row per generated token that was fed back: N - 1.
    check_rows(out.outputs[0].hidden_states, want, slice(p, p + 3))
    assert outs[1].prompt_hidden_states is None and outs[1].outputs[0].hidden_states is None
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


def test_an_asking_request_recomputes_cached_prompt_rows(llms, hf_states):
    llm, path = llms("llama")
    shared = _prompt(10, 24)
    first = llm.generate([shared + [7, 8]], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert first.metrics.num_cached_tokens == 0
    prompt = shared + [9, 10, 11]
    params = SamplingParams(temperature=0.0, max_tokens=1, return_hidden_states=True)
    asked = llm.generate([prompt], params, use_tqdm=False)[0]
    assert asked.metrics.num_cached_tokens == 0, "every prompt row must be computed"
    check_rows(asked.prompt_hidden_states, hf_states(str(path), prompt), slice(0, len(prompt)))
    assert all(v.shape == (0, 64) for v in asked.outputs[0].hidden_states.values())
    # A plain request still hits the blocks the first one cached.
    again = llm.generate([shared + [12]], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert again.metrics.num_cached_tokens == 24
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


def test_preempted_requests_record_every_row_once(tiny_hf_checkpoint, hf_states):
    """A pool too small for everyone: asking requests are preempted (recompute) and run
    their rows again; each position is kept once and equals transformers'."""
    path = tiny_hf_checkpoint("llama")
    config = EngineConfig(
        block_size=4,
        num_kv_blocks=24,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        max_model_len=64,
        attention_backend="reference",
        hidden_state_layers=LAYERS,
    )
    engine = Engine(load_model(path, dtype="float32"), config)
    engine.warmup()
    prompts = {"long": _prompt(30, 40), "mid": _prompt(31, 21), "short": _prompt(32, 9)}
    engine.add_request("decoder", [5, 6, 7], SamplingParams(max_tokens=44, ignore_eos=True))
    asking = SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, return_hidden_states=True
    )
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, asking)

    def run():
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o for o in engine.step()})
        return outs

    outs = within_time_limit(run)
    assert sum(outs[rid].num_preemptions for rid in prompts) > 0
    for rid, prompt in prompts.items():
        out = outs[rid]
        want = hf_states(str(path), prompt + out.token_ids[:-1])
        p = len(prompt)
        check_rows(out.prompt_hidden_states, want, slice(0, p))
        check_rows(out.hidden_states, want, slice(p, p + 9))
    assert outs["decoder"].prompt_hidden_states is None
    assert engine.get_stats()["num_compiles_after_warmup"] == 0


def test_asking_an_engine_without_layers_is_an_error_naming_the_field(small_llm):
    params = SamplingParams(max_tokens=2, return_hidden_states=True)
    with pytest.raises(ValueError, match="hidden_state_layers"):
        small_llm.generate([[5, 6, 7]], params)
    with pytest.raises(ValueError, match="return_hidden_states"):
        SamplingParams(return_hidden_states="yes")


@pytest.mark.parametrize("layers", [(0, 0), (-2,), "0", (0.5,)])
def test_bad_hidden_state_layers_name_the_field(layers):
    with pytest.raises(ValueError, match="hidden_state_layers"):
        EngineConfig(hidden_state_layers=layers)


def test_activation_options_refuse_speculative_decoding_with_the_reason():
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    for field, value, reason in (
        ("hidden_state_layers", (0,), "rejected rows would need rolling back"),
        ("steering_layers", (0,), "run without the steering rows"),
        ("enable_prompt_embeds", True, "carries no embedding rows"),
    ):
        with pytest.raises(ValueError, match=rf"EngineConfig.{field}=.* must be .*{reason}"):
            EngineConfig(speculative_config=spec, **{field: value})


def test_a_layer_past_the_model_is_refused_by_name(tiny_hf_checkpoint):
    with pytest.raises(ValueError, match=r"hidden_state_layers entry 2 must be in \[-1, 2\)"):
        LLM(str(tiny_hf_checkpoint("llama")), hidden_state_layers=(2,), **CHUNKED)


def test_parallel_samples_equal_their_n1_runs_with_activations(llms):
    """n > 1 with return_hidden_states, steering and prompt embeddings: sample j equals the
    n = 1 request seeded seed + j (tokens; rows within TOL: its last prompt token runs as
    a decode row after the fork, not in the prefill), each completion has its own generated
    rows and the prompt's rows come once; the carrier is steered like its samples."""
    from tests.engine.test_steering import _vectors

    llm, _ = llms("llama")
    embeds = np.random.default_rng(3).normal(0, 1, (10, 64)).astype(np.float32)
    cases = [  # (prompt, extra settings): carrier + forks, embeddings, no carrier
        (_prompt(20, 13), {"steering_vectors": _vectors(4)}),
        ({"prompt_embeds": embeds}, {}),
        ([_prompt(21, 1)[0]], {}),
    ]
    base = dict(temperature=1.0, max_tokens=4, ignore_eos=True, return_hidden_states=True)
    for prompt, extra in cases:
        params = SamplingParams(n=3, seed=7, **base, **extra)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        singles = llm.generate(
            [prompt] * 3,
            [SamplingParams(seed=7 + j, **base, **extra) for j in range(3)],
            use_tqdm=False,
        )
        check_rows(out.prompt_hidden_states, singles[0].prompt_hidden_states, slice(None))
        assert len(out.outputs) == 3
        for completion, single in zip(out.outputs, singles):
            assert completion.token_ids == single.outputs[0].token_ids
            check_rows(completion.hidden_states, single.outputs[0].hidden_states, slice(None))
            assert all(rows.shape == (3, 64) for rows in completion.hidden_states.values())
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "samples all alike"
    assert not llm.engine.activations.requests and not llm.engine.prompt_embeds.requests
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
