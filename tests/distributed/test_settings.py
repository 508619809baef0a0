"""Multi-process job settings: from EngineConfig fields, else JAX's environment variables."""

from __future__ import annotations

import pytest

from paged_jax.config import EngineConfig
from paged_jax.distributed import (
    PER_PROCESS_FIELDS,
    ConfigMismatchError,
    DistributedSettings,
    LockstepError,
    LockstepGuard,
    allgather_objects,
    check_same_config,
    config_differences,
    schedule_digest,
    settings_from,
)


def test_one_process_by_default():
    assert settings_from(EngineConfig(), environ={}) is None
    assert settings_from(EngineConfig(distributed_num_processes=1), environ={}) is None


def test_fields_win_over_the_environment():
    env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert settings_from(EngineConfig(), environ=env) == DistributedSettings("h:1", 4, 3, 30)
    config = EngineConfig(
        distributed_coordinator_address="10.0.0.1:1234",
        distributed_num_processes=2,
        distributed_process_id=1,
        distributed_heartbeat_timeout_s=5,
    )
    assert settings_from(config, environ=env) == DistributedSettings("10.0.0.1:1234", 2, 1, 5)


@pytest.mark.parametrize(
    "env,missing",
    [
        ({"JAX_COORDINATOR_ADDRESS": "h:1"}, "distributed_num_processes"),
        ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "distributed_coordinator_address"),
        ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"}, "distributed_process_id"),
    ],
)
def test_a_half_named_job_is_an_error_naming_the_field(env, missing):
    with pytest.raises(ValueError, match=missing):
        settings_from(EngineConfig(), environ=env)


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match="distributed_coordinator_address"):
        EngineConfig(distributed_coordinator_address="no-port")
    with pytest.raises(ValueError, match=r"distributed_process_id=2 must be .* < 2"):
        EngineConfig(distributed_num_processes=2, distributed_process_id=2)
    with pytest.raises(ValueError, match="lockstep_check_interval"):
        EngineConfig(lockstep_check_interval=0)
    with pytest.raises(ValueError, match=r"\$JAX_PROCESS_ID='x' must be an int"):
        settings_from(
            EngineConfig(),
            environ={
                "JAX_COORDINATOR_ADDRESS": "h:1",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": "x",
            },
        )


def test_the_guard_checks_every_n_steps_at_admissions_or_always():
    g = LockstepGuard(16)
    assert [s for s in range(40) if g.due(s, admitted=False)] == [0, 16, 32]
    assert g.due(5, admitted=True)
    assert LockstepGuard(16, every_step=True).due(5, admitted=False)
    assert schedule_digest([("a", 1)]) != schedule_digest([("a", 2)])


def test_the_join_timeout_travels_from_the_config_and_the_cli_flag():
    from paged_jax.entrypoints.generate_cli import build_parser, engine_args_from_args

    job = dict(distributed_coordinator_address="h:1", distributed_num_processes=2)
    config = EngineConfig(**job, distributed_process_id=0, distributed_init_timeout_s=7)
    assert settings_from(config, environ={}).init_timeout_s == 7
    assert settings_from(EngineConfig(**job, distributed_process_id=1), environ={}) == (
        DistributedSettings("h:1", 2, 1, 30, 120)
    )
    args = build_parser().parse_args(["--distributed-init-timeout", "5"])
    assert engine_args_from_args(args)["distributed_init_timeout_s"] == 5
    with pytest.raises(ValueError, match="distributed_init_timeout_s=0 must be an int >= 1"):
        EngineConfig(distributed_init_timeout_s=0)


def test_config_differences_name_every_field_that_shapes_programs():
    a = EngineConfig(max_num_seqs=4, distributed_num_processes=2, distributed_process_id=0)
    b = EngineConfig(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        distributed_num_processes=2,
        distributed_process_id=1,
        distributed_heartbeat_timeout_s=5,
        distributed_init_timeout_s=9,
    )
    assert config_differences([a, b]) == {
        "max_num_seqs": [4, 8],
        "max_num_batched_tokens": [512, 256],
    }
    assert config_differences([a, a]) == {}
    assert "distributed_process_id" in PER_PROCESS_FIELDS
    # The CLI reports it as bad input (exit 2); the engine as a lockstep failure.
    assert issubclass(ConfigMismatchError, ValueError)
    assert issubclass(ConfigMismatchError, LockstepError)


def test_one_process_agrees_with_itself():
    assert allgather_objects({"a": 1}) == [{"a": 1}]
    check_same_config(EngineConfig(max_num_seqs=4))  # no other process: nothing to differ
