"""The environment of a new process that should see N forced CPU devices.

jax fixes the CPU device count when it starts, from
``XLA_FLAGS=--xla_force_host_platform_device_count=N``; a test that needs several devices
starts a subprocess with that flag *appended* to the suite's XLA_FLAGS (tests/conftest.py
puts its compile settings there, and the subprocess must keep them). No jax import here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def xla_flags_with_cpu_devices(flags: str, num_devices: int) -> str:
    """``flags`` with the device-count flag for ``num_devices`` appended (XLA reads flags
    in order, so it overrides an earlier count)."""
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices!r} must be >= 1")
    return f"{flags} {DEVICE_COUNT_FLAG}={num_devices}".strip()


def env_with_cpu_devices(
    num_devices: int, env: Mapping[str, str] | None = None, *, cpu_only: bool = False
) -> dict[str, str]:
    """A copy of ``env`` (default: os.environ) whose XLA_FLAGS give ``num_devices`` CPU
    devices; ``cpu_only`` also sets JAX_PLATFORMS=cpu (a machine with a GPU plugin)."""
    out = dict(os.environ if env is None else env)
    out["XLA_FLAGS"] = xla_flags_with_cpu_devices(out.get("XLA_FLAGS", ""), num_devices)
    if cpu_only:
        out["JAX_PLATFORMS"] = "cpu"
    return out
