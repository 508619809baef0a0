"""EngineConfig.fitted_to: the config an engine over a given model runs (host only)."""

import pytest

from paged_jax import EngineConfig


def test_max_model_len_defaults_to_the_models_and_may_not_exceed_it():
    assert EngineConfig().fitted_to(128).max_model_len == 128
    assert EngineConfig(max_model_len=64).fitted_to(128).max_model_len == 64
    with pytest.raises(ValueError, match=r"max_model_len=256 must be <= .*=128"):
        EngineConfig(max_model_len=256).fitted_to(128)


def test_speculative_decoding_runs_synchronously():
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    fitted = EngineConfig(speculative_config=spec).fitted_to(64)
    assert fitted.async_scheduling is False
    assert EngineConfig().fitted_to(64).async_scheduling is True
