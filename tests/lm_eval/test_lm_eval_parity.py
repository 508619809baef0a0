"""lm-eval itself against the `paged-jax` and `hf` backends on the local tasks of tasks/.

One simple_evaluate per backend and family on the same tiny checkpoint (a byte tokenizer
with BOS, saved as transformers saves one): multiple choice (loglikelihood; the choices
of a question share its context through the prefix cache), rolling perplexity over
documents longer than the 64-token window, greedy generation cut at stop strings.
Per-document loglikelihoods agree within 1e-4 (f32), generations and accuracies exactly.
"""

from __future__ import annotations

import math
import pathlib
import shutil

import pytest

pytest.importorskip("lm_eval.evaluator", reason="needs lm-eval: pip install 'paged-jax[eval]'")
pytest.importorskip("torch", reason="the hf backend needs torch")
pytest.importorskip("transformers", reason="the hf backend needs transformers")

from paged_jax.testing.lm_eval_tasks import (  # noqa: E402  (after the skips)
    TASK_NAMES,
    evaluate_local_tasks,
    per_document,
)

TASKS_DIR = pathlib.Path(__file__).parent / "tasks"
MAX_LENGTH = 64  # lm-eval's window: hf's max_length, paged-jax's max_model_len
# A summed loglikelihood adds up to ~170 f32 terms of magnitude <= 10: 1e-4 bounds it.
LOGLIK_TOL = 1e-4
ENGINE_ARGS = dict(
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    attention_backend="reference",
)


def byte_checkpoint(tiny_hf_checkpoint, tmp_path_factory, family: str) -> pathlib.Path:
    """A tiny random checkpoint of family with a byte tokenizer that adds BOS."""
    from paged_jax.testing.lm_eval_tasks import save_byte_tokenizer

    src = tiny_hf_checkpoint(family, vocab_size=259)
    dst = tmp_path_factory.mktemp(f"lm_eval_{family}")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    save_byte_tokenizer(dst)
    return dst


def evaluate(model, model_args=None):
    return evaluate_local_tasks(model, TASKS_DIR, model_args=model_args, batch_size=8)


@pytest.fixture(scope="module")
def runs(tiny_hf_checkpoint, tmp_path_factory):
    from lm_eval.api.registry import get_model

    import paged_jax.lm_eval  # noqa: F401  (registers "paged-jax")

    made = {}

    def get(family: str):
        if family not in made:
            path = byte_checkpoint(tiny_hf_checkpoint, tmp_path_factory, family)
            hf = evaluate(
                "hf", {"pretrained": str(path), "dtype": "float32", "max_length": MAX_LENGTH}
            )
            lm = get_model("paged-jax")(
                pretrained=str(path), dtype="float32", max_model_len=MAX_LENGTH, **ENGINE_ARGS
            )
            ours = evaluate(lm)
            made[family] = hf, ours, lm
        return made[family]

    return get


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_paged_jax_equals_the_hf_backend(runs, family):
    hf, ours, lm = runs(family)
    # Multiple choice: every choice's (loglikelihood, is_greedy).
    for want, got in zip(per_document(hf, "pj_mc"), per_document(ours, "pj_mc"), strict=True):
        assert len(got) == len(want) == 4
        for (w_ll, w_greedy), (g_ll, g_greedy) in zip(want, got):
            assert g_ll == pytest.approx(w_ll, abs=LOGLIK_TOL)
            assert g_greedy == w_greedy
    # Rolling: one loglikelihood per document over windows of MAX_LENGTH tokens.
    rolling_docs = [s["doc"]["text"] for s in ours["samples"]["pj_rolling"]]
    assert min(len(text) for text in rolling_docs) > 2 * MAX_LENGTH, "several windows each"
    for want, got in zip(
        per_document(hf, "pj_rolling"), per_document(ours, "pj_rolling"), strict=True
    ):
        assert got == pytest.approx(want, abs=LOGLIK_TOL)
    # Generation: the same greedy text, cut at the same stop strings.
    gens = per_document(ours, "pj_gen")
    assert gens == per_document(hf, "pj_gen")
    gens = [text for resp in gens for text in resp]
    assert len(gens) == 6
    assert any(len(lm.tok_encode(g, add_special_tokens=False)) < 12 for g in gens), (
        f"no generation was cut by a stop string: the task does not test them: {gens!r}"
    )
    for task in TASK_NAMES:
        want, got = hf["results"][task], ours["results"][task]
        for key, value in want.items():
            if key == "alias" or key.endswith("_stderr,none"):
                continue
            if isinstance(value, float) and not math.isnan(value):
                assert got[key] == pytest.approx(value, rel=1e-5), (task, key)
            else:
                assert got[key] == value, (task, key)
    # The choices of each question read its context from the prefix cache.
    stats = lm.llm.get_stats()
    assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_hit_rate"] > 0
    assert stats["num_compiles_after_warmup"] == 0


def instances(request_type: str, args: list[tuple]):
    from lm_eval.api.instance import Instance

    return [
        Instance(request_type=request_type, doc={}, arguments=a, idx=i) for i, a in enumerate(args)
    ]


def test_an_existing_llm_scores_as_the_evaluated_model(runs):
    """PagedJaxLM(llm=...) (a training loop's engine) gives the hf backend's numbers, and
    sampled generations follow their seeds."""
    from paged_jax.lm_eval import PagedJaxLM

    hf, _, lm = runs("llama")
    live = PagedJaxLM(llm=lm.llm, batch_size=3)
    assert live.max_length == MAX_LENGTH
    samples = sorted(hf["samples"]["pj_mc"], key=lambda s: s["doc_id"])[:2]
    pairs = [tuple(arg) for s in samples for arg in s["arguments"]]
    want = [resp for s in samples for resp in s["filtered_resps"]]
    got = live.loglikelihood(instances("loglikelihood", pairs))
    for (w_ll, w_greedy), (g_ll, g_greedy) in zip(want, got, strict=True):
        assert g_ll == pytest.approx(w_ll, abs=LOGLIK_TOL) and g_greedy == w_greedy
    sampled = {"until": ["\n"], "max_gen_toks": 6, "do_sample": True, "temperature": 1.0}
    prompts = [("star child cat", dict(sampled)), ("star child cat", dict(sampled, seed=7))]
    first = live.generate_until(instances("generate_until", prompts))
    again = live.generate_until(instances("generate_until", prompts))
    assert first == again, "seeded sampling must repeat"
    greedy = live.generate_until(
        instances("generate_until", [("star child cat", {"until": ["\n"], "max_gen_toks": 6})])
    )
    assert first[0] != greedy[0] or first[1] != greedy[0], "do_sample must sample"


def test_chat_templates_render_through_lm_evals_hooks(runs):
    from paged_jax.lm_eval import PagedJaxLM

    _, _, lm = runs("llama")
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    live = PagedJaxLM(llm=lm.llm, chat_template=template)
    chat = [{"role": "user", "content": "hi"}]
    assert live.chat_template(True) == template
    with pytest.raises(ValueError, match="no chat template"):
        lm.apply_chat_template(chat)  # the tiny checkpoint has none
    # The template sees the checkpoint's special tokens (tokenizer_config.json).
    assert live.apply_chat_template(chat) == "<s>[user] hi\n[assistant]"
    # No generation prompt: the last message is continued (cut after its content).
    assert live.apply_chat_template(chat, add_generation_prompt=False) == "<s>[user] hi"
    # A rendered prompt that starts with BOS's text gets no second BOS.
    assert live.tok_encode("<s>[user] hi") == lm.llm.encode(
        "<s>[user] hi", add_special_tokens=False
    )
    assert live.tok_encode("[user] hi")[0] == 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(pretrained="x", data_parallel_size=2), r"data_parallel_size=2 must be 1"),
        (dict(pretrained="x", batch_size="big"), r"batch_size='big' must be 'auto' or an int"),
        (dict(), r"pretrained=None: pass a model directory or llm="),
        (dict(llm="not an LLM"), r"llm='not an LLM' must be a paged_jax.LLM"),
        (
            dict(pretrained="x", max_length=64, max_model_len=32),
            r"max_length=64 and max_model_len=32 must agree",
        ),
    ],
)
def test_bad_model_args_are_refused_by_name(kwargs, match):
    from paged_jax.lm_eval import PagedJaxLM

    with pytest.raises(ValueError, match=match):
        PagedJaxLM(**kwargs)


def test_unknown_generation_kwargs_are_refused_by_name(runs):
    from paged_jax.lm_eval import PagedJaxLM

    _, _, lm = runs("llama")
    live = PagedJaxLM(llm=lm.llm)
    with pytest.raises(ValueError, match=r"gen_kwargs num_beams=4 is not a generation setting"):
        live.generate_until(instances("generate_until", [("a", {"num_beams": 4})]))
    with pytest.raises(ValueError, match=r"max_model_len=64 must not be given with llm="):
        PagedJaxLM(llm=lm.llm, max_model_len=64)


def test_paged_jax_eval_hands_its_arguments_to_lm_evals_cli(monkeypatch):
    """The command registers `paged-jax` and runs lm-eval's own CLI: the model args reach
    PagedJaxLM (a refused data_parallel_size shows it without building an engine)."""
    from paged_jax.entrypoints.eval_cli import main

    monkeypatch.setattr("sys.argv", ["paged-jax-eval"])
    argv = [
        "run",
        "--model",
        "paged-jax",
        "--model_args",
        "pretrained=unused,data_parallel_size=2",
        "--tasks",
        "pj_gen",
        "--include_path",
        str(TASKS_DIR),
    ]
    with pytest.raises(ValueError, match=r"data_parallel_size=2 must be 1"):
        main(argv)
