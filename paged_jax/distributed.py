"""Multi-process engines: jax.distributed start-up, admission broadcast, lockstep guard.

One engine spans several processes (hosts) as JAX multi-controller SPMD: every process
runs the same deterministic engine, and each jitted step is one program over a mesh of
every process's devices. The host side (scheduler, block pool, prefix cache) decides
only from request order, token counts and sampled ids, which come back replicated, so
the processes stay in lockstep as long as they admit the same requests in the same order:

    process 0:  prompts ──broadcast_from_primary──▶ every process adds the same requests
    every step: schedule ─▶ LockstepGuard.check (checksum, all-gathered) ─▶ jitted step
    process 0:  writes the outputs; the others drop theirs

A schedule that differs between processes would dispatch different programs (or the
same program with different inputs) into shared collectives: it would hang or compute
garbage. The guard compares a checksum of each process's schedule before the step runs
and stops every process with LockstepError, the same error on each. A process that dies
is noticed by jax.distributed's heartbeat: the survivors exit with its error after
``distributed_heartbeat_timeout_s``.

Start-up has two checks of its own: joining waits at most ``distributed_init_timeout_s``
for every process (and Ctrl-C interrupts the wait), and check_same_config compares the
engine configs of all processes, since two engines sized differently would compile
different programs and meet in mismatched collectives.

CPU processes talk through gloo collectives (set here before the backend starts), so the
whole path runs on one machine: two processes with forced CPU devices each.

jax is imported inside the functions that need it: the CLI's front end reads a job's
settings (settings_from) without starting jax.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import numpy as np

from paged_jax.config import EngineConfig

__all__ = [
    "ENV_COORDINATOR_ADDRESS",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "PER_PROCESS_FIELDS",
    "ConfigMismatchError",
    "DistributedSettings",
    "JoinError",
    "LockstepError",
    "LockstepGuard",
    "allgather_objects",
    "broadcast_from_primary",
    "check_same_config",
    "config_differences",
    "initialize",
    "is_primary",
    "is_runtime_failure",
    "leave_job",
    "num_processes",
    "schedule_digest",
    "settings_from",
]

# jax.distributed.initialize reads the first itself; the other two name the same
# job's size and rank the way launchers (and our CLI) pass them.
ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"

# A broadcast payload is padded to a power of two >= this, so the broadcast's jitted
# program takes few shapes.
_MIN_PAYLOAD = 1024


# EngineConfig fields that may differ between the processes of one job: they say where
# a process sits or how long it waits, and shape no program. Every other field must agree.
PER_PROCESS_FIELDS = frozenset(
    {
        "distributed_coordinator_address",  # the same host, perhaps spelled differently
        "distributed_process_id",
        "distributed_heartbeat_timeout_s",
        "distributed_init_timeout_s",
    }
)

# How long past jax's own timeout the join is waited for before giving up on jax.
_JOIN_GRACE_S = 30
# Seconds between the join wait's checks of stop_requested.
_JOIN_POLL_S = 0.25


class LockstepError(RuntimeError):
    """The processes of one engine scheduled different steps; every process raises it."""


class ConfigMismatchError(LockstepError, ValueError):
    """The processes were given different engine configs (bad input: a ValueError too)."""


class JoinError(RuntimeError):
    """This process could not join the multi-process job (a peer never came, a bad address)."""


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """Where this process sits in a multi-process job, and how long it waits for the others."""

    coordinator_address: str
    num_processes: int
    process_id: int
    heartbeat_timeout_s: int = 30
    init_timeout_s: int = 120


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r} must be an int") from None


def settings_from(
    config: EngineConfig, environ: Mapping[str, str] = os.environ
) -> DistributedSettings | None:
    """The job's settings from the config, else the environment; None for one process.

    Raises:
        ValueError: a job named half-way (an address without a process count or rank,
            or the reverse), naming the field and its environment variable.
    """
    address = config.distributed_coordinator_address or environ.get(ENV_COORDINATOR_ADDRESS)
    n = config.distributed_num_processes
    if n is None:
        n = _env_int(environ, ENV_NUM_PROCESSES)
    rank = config.distributed_process_id
    if rank is None:
        rank = _env_int(environ, ENV_PROCESS_ID)
    if address is None and n in (None, 1) and rank in (None, 0):
        return None
    if n == 1 and rank in (None, 0):
        return None
    for field, env, value in (
        ("distributed_coordinator_address", ENV_COORDINATOR_ADDRESS, address),
        ("distributed_num_processes", ENV_NUM_PROCESSES, n),
        ("distributed_process_id", ENV_PROCESS_ID, rank),
    ):
        if value is None:
            raise ValueError(
                f"EngineConfig.{field}=None must be set (or ${env}) for a multi-process "
                f"engine: got coordinator {address!r}, {n!r} processes, process id {rank!r}"
            )
    if not 0 <= rank < n:
        raise ValueError(f"distributed_process_id={rank!r} must be in [0, {n})")
    return DistributedSettings(
        address,
        n,
        rank,
        config.distributed_heartbeat_timeout_s,
        config.distributed_init_timeout_s,
    )


def initialize(
    settings: DistributedSettings, stop_requested: Callable[[], bool] | None = None
) -> None:
    """Joins the job (jax.distributed.initialize) before any device is queried.

    Idempotent for the same job; CPU processes use gloo collectives. Waits at most
    ``settings.init_timeout_s`` for every process to join. jax's join blocks in C++,
    where Python's Ctrl-C handler never runs, so it runs in a helper thread and this
    thread waits on it in short slices (waits that signals interrupt): Ctrl-C ends the
    wait, and so does ``stop_requested()`` turning true between slices (a Ctrl-C whose
    KeyboardInterrupt Python swallowed, e.g. raised inside a gc callback, is not lost).

    Raises:
        JoinError: a process did not join in time, or the coordinator is unreachable.
        RuntimeError: jax already started its backends in this process (a device was
            queried or an array made first), or it joined another job.
        KeyboardInterrupt: Ctrl-C while waiting (the helper thread is left to die with
            the process).
    """
    import jax

    if jax.distributed.is_initialized():
        if jax.process_count() != settings.num_processes or (
            jax.process_index() != settings.process_id
        ):
            raise RuntimeError(
                f"this process already joined a job of {jax.process_count()} processes as "
                f"process {jax.process_index()}, not {settings.num_processes} as "
                f"{settings.process_id}"
            )
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    failure: list[BaseException] = []

    def join() -> None:
        try:
            jax.distributed.initialize(
                coordinator_address=settings.coordinator_address,
                num_processes=settings.num_processes,
                process_id=settings.process_id,
                heartbeat_timeout_seconds=settings.heartbeat_timeout_s,
                # jax's deadline is later than ours: at its deadline jax aborts the
                # whole process (a C++ fatal error, no Python exception).
                initialization_timeout=settings.init_timeout_s + _JOIN_GRACE_S,
            )
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            failure.append(e)

    where = (
        f"the multi-process job at {settings.coordinator_address} as process "
        f"{settings.process_id} of {settings.num_processes}"
    )
    thread = threading.Thread(target=join, name="paged-jax-join", daemon=True)
    thread.start()
    deadline = time.monotonic() + settings.init_timeout_s
    while thread.is_alive() and (left := deadline - time.monotonic()) > 0:
        thread.join(min(_JOIN_POLL_S, left))
        if stop_requested is not None and stop_requested():
            raise KeyboardInterrupt
    if thread.is_alive():
        raise JoinError(
            f"could not join {where}: not every process joined within "
            f"distributed_init_timeout_s={settings.init_timeout_s} s "
            "(--distributed-init-timeout); did every process start, with the same "
            "--coordinator-address and --num-processes and its own --process-id?"
        )
    if not failure:
        return
    e = failure[0]
    if isinstance(e, jax.errors.JaxRuntimeError):  # the runtime's join itself failed
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise JoinError(
            f"could not join {where}: {first} (did every process start, with the same "
            "--coordinator-address and --num-processes and its own --process-id?)"
        ) from e
    if isinstance(e, RuntimeError):  # jax's own checks, before any connection
        raise RuntimeError(
            f"could not join {where}: {e} (the engine must start before anything else in "
            "the process uses jax devices)"
        ) from e
    raise e


def num_processes() -> int:
    """Processes in this job (1 without jax.distributed)."""
    import jax

    return jax.process_count()


def is_primary() -> bool:
    """True on process 0 (the one that decides admission and writes outputs)."""
    import jax

    return jax.process_index() == 0


def broadcast_from_primary(obj: Any) -> Any:
    """Process 0's `obj` on every process (any picklable object); itself for one process."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return obj
    payload = pickle.dumps(obj) if is_primary() else b""
    size = int(multihost_utils.broadcast_one_to_all(np.array([len(payload)], np.int32))[0])
    width = max(_MIN_PAYLOAD, 1 << (size - 1).bit_length())
    buf = np.zeros(width, np.uint8)
    buf[: len(payload)] = np.frombuffer(payload, np.uint8)
    data = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return pickle.loads(data[:size].tobytes())


def allgather_objects(obj: Any) -> list[Any]:
    """Every process's `obj` (any picklable object), in process order; [obj] for one process."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return [obj]
    payload = pickle.dumps(obj)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([len(payload)], np.int32)))
    sizes = sizes.reshape(-1).tolist()
    width = max(_MIN_PAYLOAD, 1 << (max(sizes) - 1).bit_length())
    buf = np.zeros(width, np.uint8)
    buf[: len(payload)] = np.frombuffer(payload, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), width)
    return [pickle.loads(row[:n].tobytes()) for row, n in zip(rows, sizes)]


def config_differences(configs: list[EngineConfig]) -> dict[str, list[Any]]:
    """Field -> every process's value, for the fields that must agree and do not."""
    differ = {}
    for field in dataclasses.fields(EngineConfig):
        if field.name in PER_PROCESS_FIELDS:
            continue
        values = [getattr(c, field.name) for c in configs]
        if any(v != values[0] for v in values[1:]):
            differ[field.name] = values
    return differ


def check_same_config(config: EngineConfig) -> None:
    """Raises ConfigMismatchError on every process unless all processes' configs agree.

    Called once a multi-process engine has joined its job and before it builds anything:
    engines of different sizes would compile different programs and then wait in
    mismatched collectives (gloo's "collective mismatch", or jax aborting the process).
    Only PER_PROCESS_FIELDS may differ.

    Raises:
        ConfigMismatchError: naming each differing field and every process's value.
    """
    differ = config_differences(allgather_objects(config))
    if differ:
        fields = "; ".join(
            f"{name}: " + ", ".join(f"process {i} {v!r}" for i, v in enumerate(values))
            for name, values in differ.items()
        )
        raise ConfigMismatchError(
            f"the engine's processes were given different engine configs ({fields}): every "
            "process must run the same command (only its --process-id differs)"
        )


def is_runtime_failure(err: BaseException) -> bool:
    """Whether an engine error came from jax's runtime (a collective failed: a peer died).

    A LockstepError, or a Python error in the engine, is raised by every process alike
    and leaves the job intact; a runtime failure may mean a peer is gone.
    """
    import jax

    return isinstance(err, jax.errors.JaxRuntimeError)


def leave_job(code: int) -> NoReturn:
    """Ends this process now with `code`, without jax.distributed's shutdown.

    For a survivor of a dead peer, once its outputs are written: at exit jax would wait
    in a shutdown barrier for every process, and with one gone it waits out the
    heartbeat timeout and then aborts the process (SIGABRT, exit 134, a C++ stack dump)
    instead of exiting with `code`. Python's own exit handlers are skipped too, so
    everything worth keeping must be written and closed first; stdout and stderr are
    flushed here.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def schedule_digest(parts: Any) -> int:
    """A 32-bit checksum of a step's schedule (any repr-stable value of ints and strs)."""
    return zlib.crc32(repr(parts).encode())


def lockstep_parts(out: Any) -> tuple:
    """What a step's schedule (a SchedulerOutput) decides, for the lockstep checksum."""
    return (
        out.scheduled,
        [row.req_id for row in out.new_rows],
        sorted(out.new_block_ids.items()),
        out.preempted_req_ids,
        out.block_copies,
    )


class LockstepGuard:
    """Compares the processes' schedules before a step runs.

    Args:
        interval: check every this many steps...
        every_step: ...or at every step (validate).
    """

    def __init__(self, interval: int, every_step: bool = False):
        self.interval = interval
        self.every_step = every_step
        self.num_checks = 0

    def due(self, step: int, admitted: bool) -> bool:
        """Whether step `step` is checked: every N steps, at admissions, or always."""
        return self.every_step or admitted or step % self.interval == 0

    def check(self, step: int, digest: int) -> None:
        """All-gathers (step, digest) and raises LockstepError on every process if any differ.

        Raises:
            LockstepError: the processes' schedules differ (listing each one's).
        """
        from jax.experimental import multihost_utils

        signed = digest - (1 << 32) if digest >= 1 << 31 else digest  # fits int32
        mine = np.array([step, signed], np.int32)
        every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2)
        self.num_checks += 1
        if (every != every[0]).any():
            seen = ", ".join(
                f"process {i}: step {s}, checksum {d & 0xFFFFFFFF:#010x}"
                for i, (s, d) in enumerate(every.tolist())
            )
            raise LockstepError(
                f"the engine's processes diverged before step {step} ({seen}): every "
                "process must admit the same requests in the same order (pass prompts "
                "through LLM.generate on every process; process 0's are used)"
            )

    def warmup(self) -> None:
        """Builds the check's all-gather program (so no step compiles it later)."""
        from jax.experimental import multihost_utils

        multihost_utils.process_allgather(np.zeros(2, np.int32))
