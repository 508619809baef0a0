"""Non-finite logits are flagged on device, per sequence, and reach the host with the ids.

The sampler checks each row's raw logits (one reduction, inside the jitted step) and
marks a bad row in its sampled id; the runner's StepResult turns the mark into
``nonfinite`` (bool per real sequence) and token 0. SumModel's ``nonfinite_token_id``
poisons one sequence's logits; the tensor-parallel case poisons a real checkpoint's
embedding row and runs in a subprocess on two forced CPU devices.

    python tests/worker/test_nonfinite.py CHECKPOINT_DIR OUT_JSON   # the TP subprocess
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.config import EngineConfig
from paged_jax.constants import NONFINITE_TOKEN_ID
from paged_jax.core.scheduler_output import ScheduledSeq
from paged_jax.sampling_params import SamplingParams
from paged_jax.testing.cpu_devices import env_with_cpu_devices
from paged_jax.testing.fake_model import SumModel, SumModelConfig
from paged_jax.worker.input_batch import InputBatch
from paged_jax.worker.runner import Runner, StepResult, num_backend_compiles
from paged_jax.worker.sampling import SamplingMetadata, sample

VOCAB = 97
BAD = 5  # the token id whose next-token logits are poisoned
PROMPTS = {"a": [1, 2, 3], "b": [7, 8, BAD], "c": [4, 4]}  # "b" alone ends in BAD
ENGINE = dict(
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    max_model_len=32,
    num_kv_blocks=16,
    attention_backend="reference",
)


def _meta(rows: int, temperature: float, masked: list[list[int]] | None = None):
    masked_ids = np.full((rows, 2), -1, np.int32)
    for row, ids in enumerate(masked or []):
        masked_ids[row, : len(ids)] = ids
    return SamplingMetadata(
        temperature=jnp.full(rows, temperature, jnp.float32),
        top_k=jnp.zeros(rows, jnp.int32),
        top_p=jnp.ones(rows, jnp.float32),
        min_p=jnp.zeros(rows, jnp.float32),
        seeds=jnp.arange(rows, dtype=jnp.uint32),
        counters=jnp.zeros(rows, jnp.int32),
        masked_token_ids=jnp.asarray(masked_ids),
    )


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampler_marks_exactly_the_rows_with_a_nonfinite_logit(temperature):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 20)).astype(np.float32)
    logits[1, 3] = np.nan
    logits[2, 7] = np.inf
    logits[3, 0] = -np.inf
    logits[4, :] = np.nan
    bad = np.array([False, True, True, True, True, False])
    # Row 5 bans token 2 (-inf after the check): a ban is not a non-finite logit.
    out = sample(jnp.asarray(logits), _meta(6, temperature, [[], [], [], [], [], [2]]))
    ids = np.asarray(out.token_ids)
    np.testing.assert_array_equal(ids == NONFINITE_TOKEN_ID, bad)
    assert np.isnan(np.asarray(out.logprobs)[bad]).all()
    assert np.isfinite(np.asarray(out.logprobs)[~bad]).all()
    assert np.isnan(np.asarray(out.top_logprobs)[bad]).all()
    assert (np.asarray(out.top_token_ids)[bad] == 0).all()
    # The finite rows sample as they do in a batch without the bad rows.
    meta = _meta(6, temperature, [[], [], [], [], [], [2]])
    keep = np.array([0, 5])
    alone = sample(
        jnp.asarray(logits[keep]),
        SamplingMetadata(*(None if f is None else f[keep] for f in meta)),
    )
    np.testing.assert_array_equal(ids[keep], alone.token_ids)
    np.testing.assert_allclose(np.asarray(out.logprobs)[keep], alone.logprobs, rtol=1e-6)
    assert ids[5] != 2


def _prefill_and_decode(runner: Runner, batch: InputBatch, with_logprobs: bool):
    """Prefills PROMPTS in one step, then decodes each once with its token fed on device."""
    params = SamplingParams(temperature=0.0)
    for i, (req_id, prompt) in enumerate(PROMPTS.items()):
        batch.add_request(req_id, prompt, [1 + 2 * i, 2 + 2 * i], params, seed=0)
    prefill = batch.prepare([ScheduledSeq(r, 0, len(p), 0) for r, p in PROMPTS.items()])
    first = runner.dispatch(prefill, with_logprobs=with_logprobs)
    # Async scheduling: the decode step is built before the prefill's ids reach the host.
    decode = batch.prepare([ScheduledSeq(r, len(p), 1, 1) for r, p in PROMPTS.items()])
    second = runner.dispatch(decode, with_logprobs=with_logprobs)
    return first.result(), second.result()


def _check_prefill_result(result: StepResult, with_logprobs: bool) -> None:
    assert result.nonfinite.dtype == bool
    assert result.nonfinite.tolist() == [False, True, False]  # exactly "b"
    want = [SumModel.reference_continuation(p, 1, VOCAB)[0] for p in PROMPTS.values()]
    assert result.token_ids.tolist() == [want[0], 0, want[2]]  # token 0 on the bad row
    if with_logprobs:
        assert np.isnan(result.logprobs[1]) and np.isfinite(result.logprobs[[0, 2]]).all()
        assert np.isnan(result.top_logprobs[1]).all()
    else:
        assert result.logprobs is None and result.top_logprobs is None


@pytest.mark.parametrize(
    "logit, with_logprobs, validate",
    # -inf (a flag on a row whose token looks normal) is covered by the sampler test.
    [("nan", False, False), ("inf", True, False), ("nan", True, True)],
)
def test_step_flags_exactly_the_sequence_with_nonfinite_logits(logit, with_logprobs, validate):
    cfg = EngineConfig(**ENGINE, validate=validate)
    model = SumModel(
        SumModelConfig(vocab_size=VOCAB, nonfinite_token_id=BAD, nonfinite_logit=logit)
    )
    runner = Runner(model, cfg)
    batch = InputBatch(cfg)
    runner.warmup([batch.dummy_step_input(t, s) for t, s in cfg.step_shapes()])
    compiles = num_backend_compiles()
    prefill, decode = _prefill_and_decode(runner, batch, with_logprobs)
    _check_prefill_result(prefill, with_logprobs)
    # The bad row's device feed slot got token 0 (a real id), so the next step reads a
    # finite row again: a normal step reports all False.
    assert decode.nonfinite.tolist() == [False, False, False]
    a, _, c = PROMPTS.values()
    assert decode.token_ids[0] == SumModel.reference_continuation(a, 2, VOCAB)[1]
    assert decode.token_ids[2] == SumModel.reference_continuation(c, 2, VOCAB)[1]
    assert num_backend_compiles() == compiles, "the non-finite flag compiled after warm-up"


def test_normal_steps_report_all_false():
    cfg = EngineConfig(**ENGINE)
    runner = Runner(SumModel(SumModelConfig(vocab_size=VOCAB)), cfg)
    prefill, decode = _prefill_and_decode(runner, InputBatch(cfg), with_logprobs=False)
    assert prefill.nonfinite.tolist() == decode.nonfinite.tolist() == [False] * 3
    want = [SumModel.reference_continuation(p, 1, VOCAB)[0] for p in PROMPTS.values()]
    assert prefill.token_ids.tolist() == want


# ------------------------------------------------------------------ tensor parallel
def _poison_embedding_row(src, dst, token_id: int) -> None:
    """Copies a checkpoint with the input embedding of token_id set to NaN."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    tensors = load_file(file)
    tensors["model.embed_tokens.weight"][token_id] = np.nan
    assert "lm_head.weight" in tensors, "an untied head keeps the other rows' logits finite"
    save_file(tensors, file, metadata={"format": "pt"})


def _tp_main(checkpoint: str, out: str) -> None:
    """Under TP=2: one prefill with one poisoned sequence, then a decode; writes JSON."""
    from paged_jax.llm import LLM

    llm = LLM(checkpoint, tensor_parallel_size=2, **ENGINE)
    engine = llm.engine
    compiles = num_backend_compiles()
    report = {}
    for with_logprobs in (False, True):
        batch = InputBatch(engine.config)
        prefill, decode = _prefill_and_decode(engine.runner, batch, with_logprobs)
        report[str(with_logprobs)] = dict(
            prefill=prefill.nonfinite.tolist(),
            prefill_ids=prefill.token_ids.tolist(),
            decode=decode.nonfinite.tolist(),
            logprobs=None if prefill.logprobs is None else prefill.logprobs.tolist(),
        )
    report["compiles_after_warmup"] = num_backend_compiles() - compiles
    report["sharded"] = len(engine.runner.kv_caches[0][0].sharding.device_set)
    with open(out, "w") as f:
        json.dump(report, f)


def test_flag_works_under_tensor_parallelism(tiny_hf_checkpoint, tmp_path):
    src = tiny_hf_checkpoint("llama", tie_word_embeddings=False)
    _poison_embedding_row(src, tmp_path / "model", BAD)
    env = env_with_cpu_devices(2, cpu_only=True)
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp_path / "model"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,  # a hang guard only, far above the run on a loaded 2-core machine
    )
    assert proc.returncode == 0, f"TP subprocess failed:\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    assert report["sharded"] == 2
    for with_logprobs in ("False", "True"):
        run = report[with_logprobs]
        assert run["prefill"] == [False, True, False], run
        assert run["prefill_ids"][1] == 0
        # "b" keeps its NaN KV: its decode is non-finite again; the others stay finite.
        assert run["decode"] == [False, True, False], run
    logprobs = report["True"]["logprobs"]
    assert np.isnan(logprobs[1]) and np.isfinite([logprobs[0], logprobs[2]]).all()
    assert report["compiles_after_warmup"] == 0


if __name__ == "__main__":
    _tp_main(*sys.argv[1:])
