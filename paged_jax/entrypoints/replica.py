"""One engine replica of a data-parallel job: builds its LLM once, then turns batches of
request rows into output records.

A request row is a prompts-file line as a mapping: the JSONL keys ("prompt" |
"prompt_token_ids" | "messages", "id", SamplingParams overrides), plus "index" and "line"
when it comes from a file; or the line's JSON text under "request_json" (what the CLI
sends, so any JSON value survives the trip through Arrow). Each row is parsed, rendered,
tokenized and served exactly as the single-process CLI serves a line, and its record is
the CLI's record (entrypoints/records.py).

Nothing here imports ray (it only reads the running task's id when Ray has loaded):
Ray Data calls a Replica like any callable class (entrypoints/data_parallel.py builds
the pool), and the tests call it directly. Placement
(CPU cores, forced CPU devices) is applied before jax is first imported in the process.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pathlib
import socket
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any

from paged_jax.entrypoints.hidden_state_files import encode_hidden_states, request_hidden_states
from paged_jax.entrypoints.job import make_requests
from paged_jax.entrypoints.prompts_file import ALLOWED_KEYS, PromptLine, parse_jsonl_line
from paged_jax.entrypoints.records import rejected_error, request_record
from paged_jax.sampling_params import SamplingParams

# The test hook: "INDEX:MARKER" makes the replica that serves request INDEX exit the
# process (os._exit) right after that request finishes, once: the first replica to get
# there creates the MARKER file, and a retry finds it and carries on.
CRASH_HOOK_ENV = "PAGED_JAX_TEST_REPLICA_CRASH"
CRASH_EXIT_STATUS = 17
# Rows carrying the line as JSON text (the CLI's rows) use this column.
REQUEST_JSON = "request_json"
NO_LINE_PREFIX = "line None: "  # errors of a row that carries no line number


def request_json(line: PromptLine) -> str:
    """A parsed prompts-file line back as its JSONL text (id, prompt and overrides)."""
    record: dict[str, Any] = {} if line.id is None else {"id": line.id}
    record[line.kind] = line.value
    record.update(line.overrides)
    return json.dumps(record, ensure_ascii=False)


def request_line(row: Mapping[str, Any]) -> PromptLine:
    """The PromptLine of one request row (a bad row gets `.error`, never raises).

    Keys besides "index", "line", REQUEST_JSON and the JSONL keys are ignored (a
    dataset's own columns), and so are null values (Arrow's missing cells).
    """
    index, line_no = row.get("index"), row.get("line")
    text = row.get(REQUEST_JSON)
    if text is None:
        fields = {k: v for k, v in row.items() if k in ALLOWED_KEYS and v is not None}
        text = json.dumps(fields, ensure_ascii=False)
    return parse_jsonl_line(index, line_no, text)


def _located(line: PromptLine, error: str) -> str:
    """A row without a line number has no "line N: " to name; its record has the id."""
    return error.removeprefix(NO_LINE_PREFIX) if line.line is None else error


def pin_to_cores(num_cores: int, slot_dir: str | os.PathLike) -> list[int] | None:
    """Pins this process to its own `num_cores` of the cores it may run on.

    Replicas on one host share `slot_dir`; each takes the first free slot (an flock held
    for the life of the process, so a crashed replica's slot frees itself) and runs on
    that slot's cores, so XLA's CPU thread pools (sized from the cores a process may run
    on) hold `num_cores` threads and replicas do not fight over cores.

    Returns:
        The cores, or None (every slot taken: the process stays unpinned).
    """
    cores = sorted(os.sched_getaffinity(0))
    num_cores = min(num_cores, len(cores))  # a share past this host: all of it
    directory = pathlib.Path(slot_dir)
    directory.mkdir(parents=True, exist_ok=True)
    for slot in range(len(cores) // num_cores):
        fd = os.open(directory / f"slot{slot}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        mine = cores[slot * num_cores : (slot + 1) * num_cores]
        os.sched_setaffinity(0, mine)
        return mine  # the fd stays open: the slot is held until the process ends
    return None


def compile_cache_use(before: Mapping[str, int], report: Any) -> dict[str, int]:
    """The compile cache's hits and misses of one warm-up, as the summary names them.

    Its step programs loaded (hits) and compiled (misses), and JAX's persistent-cache
    events for whatever else warm-up compiled (since `before`, a
    ``compile_cache.cache_counts()`` taken before the warm-up).

    Args:
        before: cache_counts() before the warm-up.
        report: the engine's WarmupReport after it.
    """
    from paged_jax.compile_cache import cache_counts

    use = {k: v - before[k] for k, v in cache_counts().items()}
    if report.cache_dir is not None:
        use["hits"] += report.num_loaded
        use["misses"] += report.num_compiled
    return {f"compile_cache_{k}": v for k, v in use.items()}


class Replica:
    """One engine replica: an LLM built once, serving batches of request rows.

    Args:
        model: a Hugging Face model directory.
        sampling_params: the run's SamplingParams, before each row's overrides.
        engine_args: EngineConfig keyword arguments (LLM's keywords).
        chat_template: Jinja text for "messages" rows instead of the checkpoint's.
        compile_cache: LLM's compile_cache (True, False or a directory).
        cpu_cores: pin the process to this many cores of its host (see pin_to_cores);
            None leaves it unpinned.
        job_dir: a directory the replicas of one job on one host share (core slots,
            batch attempts).
        max_batch_retries: a batch whose replica died is served again at most this
            many times; after that its rows get error records (a request that kills
            every replica must not loop forever).
        cpu_devices: > 1: force this many CPU devices (tensor parallelism on CPU).
        platform: "cpu" restricts jax to the CPU (a CPU replica on a GPU host).
        crash_hook: the test hook's "INDEX:MARKER" (see CRASH_HOOK_ENV).
    """

    def __init__(
        self,
        model: str,
        sampling_params: SamplingParams,
        *,
        engine_args: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        compile_cache: bool | str = True,
        cpu_cores: int | None = None,
        job_dir: str | None = None,
        max_batch_retries: int = 3,
        cpu_devices: int = 1,
        platform: str | None = None,
        crash_hook: str | None = None,
    ):
        self.cores = self._place(cpu_cores, job_dir, cpu_devices, platform)
        self.job_dir = None if job_dir is None else pathlib.Path(job_dir)
        self.max_batch_retries = max_batch_retries
        # Batches served per Ray task by this process (see _count_attempt).
        self.task_calls: dict[str, int] = {}
        from paged_jax.llm import LLM

        t0 = time.perf_counter()
        self.llm = LLM(
            str(model),
            warmup=False,
            compile_cache=compile_cache,
            chat_template=chat_template,
            **dict(engine_args or {}),
        )
        self.load_s = time.perf_counter() - t0
        from paged_jax.compile_cache import cache_counts

        t0, before = time.perf_counter(), cache_counts()
        self.llm.engine.warmup()
        self.warmup_s = time.perf_counter() - t0
        self.cache_use = compile_cache_use(before, self.llm.engine.warmup_report)
        self.params = sampling_params
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.crash_at, self.crash_marker = parse_crash_hook(crash_hook)
        self.batches = self.requests = 0
        self.busy_s = 0.0
        self.first_start: float | None = None
        self.last_end: float | None = None

    @staticmethod
    def _place(cpu_cores, job_dir, cpu_devices, platform) -> list[int] | None:
        """Sets what jax reads when it starts; too late (and said so) once it has."""
        if "jax" in sys.modules:
            warnings.warn(
                "jax was imported before the replica was placed: its cores and devices "
                "are the process's as they were",
                stacklevel=3,
            )
        if platform is not None:
            os.environ["JAX_PLATFORMS"] = platform
        if cpu_devices > 1:
            flag = f"--xla_force_host_platform_device_count={cpu_devices}"
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
        if cpu_cores is None or job_dir is None:
            return None
        return pin_to_cores(cpu_cores, pathlib.Path(job_dir) / "cores")

    def __call__(self, batch: Any) -> Any:
        """Ray Data's entry: a pyarrow Table of request rows -> a Table of records.

        Returns:
            Columns "index" (the row's, or null), "record" (the record as JSON text),
            "hidden_states" (a request's hidden states as encode_hidden_states' .npz
            bytes; null when it asked for none) and "replica" (this replica's figures so
            far, JSON text).
        """
        import pyarrow as pa

        served = self.serve_with_hidden_states(batch.to_pylist())
        stats = json.dumps(self.stats())
        return pa.table(
            {
                "index": pa.array([r["index"] for r, _ in served], pa.int64()),
                "record": pa.array([json.dumps(r, ensure_ascii=False) for r, _ in served]),
                "hidden_states": pa.array([states for _, states in served], pa.binary()),
                "replica": pa.array([stats] * len(served)),
            }
        )

    def serve(self, rows: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The records of `rows`, one per row (bad rows first, then in finish order)."""
        return [record for record, _ in self.serve_with_hidden_states(rows)]

    def serve_with_hidden_states(
        self, rows: list[Mapping[str, Any]]
    ) -> list[tuple[dict[str, Any], bytes | None]]:
        """serve's records, each with its request's hidden states (encode_hidden_states'
        bytes; None when the request asked for none or failed)."""
        start = time.time()
        self.first_start = start if self.first_start is None else self.first_start
        lines = [request_line(row) for row in rows]
        tries = self._count_attempt(rows)
        if tries > 1 + self.max_batch_retries:
            deaths = tries - 1
            error = (
                f"the replicas serving this request's batch died {deaths} "
                f"time{'s' if deaths != 1 else ''} (max_batch_retries={self.max_batch_retries})"
            )
            return [
                (request_record(ln, error=_located(ln, f"line {ln.line}: {error}")), None)
                for ln in lines
            ]
        requests = make_requests(
            lines,
            self.params,
            tokenizer=self.llm.tokenizer,
            chat_template=self.llm.chat_template,
            max_model_len=self.llm.config.max_model_len,
        )
        records = [
            (request_record(ln, error=_located(ln, ln.error)), None) for ln in lines if ln.error
        ]
        unfinished = dict(enumerate(requests))
        stream = self.llm.generate_iter([r.prompt for r in requests], [r.params for r in requests])
        try:
            for i, out in stream:
                line = unfinished.pop(i).line
                if out.error is not None:
                    error = _located(line, rejected_error(line, i, out.error))
                    records.append((request_record(line, error=error), None))
                else:
                    states = request_hidden_states(out)
                    payload = None if states is None else encode_hidden_states(states)
                    records.append((request_record(line, out), payload))
                self._maybe_crash(line)
        except Exception as err:  # noqa: BLE001 - as the CLI: the rest get error records
            what = f"{type(err).__name__}: {err}"
            for request in unfinished.values():
                line = request.line
                error = f"line {line.line}: the engine failed before this request finished ({what})"
                records.append((request_record(line, error=_located(line, error)), None))
        finally:
            stream.close()
        self.last_end = time.time()
        self.busy_s += self.last_end - start
        self.batches += 1
        self.requests += len(rows)
        return records

    def _count_attempt(self, rows: list[Mapping[str, Any]]) -> int:
        """How many times this batch was started on this host, this time included.

        A batch is known by its Ray task (a retry keeps the task's id), its place among
        that task's batches (a task may serve several; a restarted replica counts them
        from 0 again, as the retried task runs them again in order) and its rows, so two
        batches of equal rows are not taken for retries of each other.
        """
        if self.job_dir is None:
            return 1
        task = current_task_id()
        place = self.task_calls.get(task, 0)
        self.task_calls[task] = place + 1
        text = f"{task}:{place}:" + json.dumps(rows, sort_keys=True, default=str)
        key = hashlib.sha256(text.encode()).hexdigest()
        directory = self.job_dir / "attempts"
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / key, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        try:
            os.write(fd, b".")
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def _maybe_crash(self, line: PromptLine) -> None:
        if self.crash_at is None or line.index != self.crash_at:
            return
        try:
            fd = os.open(self.crash_marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            return  # a retry: the first attempt already died here
        os.write(fd, f"{self.name}\n".encode())
        os.close(fd)
        os._exit(CRASH_EXIT_STATUS)

    def stats(self) -> dict[str, Any]:
        """This replica's figures so far, JSON-ready (the data-parallel summary's input).

        Counts come as counts (prefix-cache queries and hits, speculative draft and
        accepted tokens per position), so the summary can sum them over the replicas
        and recompute the rates.
        """
        stats = self.llm.get_stats()
        return {
            "name": self.name,
            "cores": self.cores,
            "load_s": round(self.load_s, 3),
            "warmup_s": round(self.warmup_s, 3),
            "batches": self.batches,
            "requests": self.requests,
            "busy_s": round(self.busy_s, 3),
            "first_start": self.first_start,
            "last_end": self.last_end,
            "kv_blocks": stats["num_kv_blocks"],
            "peak_kv_usage": stats["kv_cache_usage_peak"],
            "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
            "prefix_cache_queries": stats["prefix_cache_queries"],
            "prefix_cache_hits": stats["prefix_cache_hits"],
            "max_num_seqs": self.llm.config.max_num_seqs,
            "max_num_batched_tokens": self.llm.config.max_num_batched_tokens,
            "preemptions": stats["num_preemptions"],
            "warmup_compiles": stats["num_compiles"] - stats["num_compiles_after_warmup"],
            "compiles_after_warmup": stats["num_compiles_after_warmup"],
            "steps": stats["num_steps"],
            "median_step_ms": stats["step_time_ms"],
            **self.llm.engine.warmup_report.summary(),
            "compile_cache": str(self.llm.compile_cache_dir)
            if self.llm.compile_cache_dir
            else None,
            **(self.cache_use if self.llm.compile_cache_dir else {}),
            **self._spec_counts(stats),
        }

    def _spec_counts(self, stats: Mapping[str, Any]) -> dict[str, Any]:
        """Speculative decoding's counters (none without it), per position included."""
        speculator = self.llm.engine.speculator
        if "spec_method" not in stats or speculator is None:
            return {}
        return {
            "spec_method": stats["spec_method"],
            "spec_num_draft_tokens": stats["spec_num_draft_tokens"],
            "spec_num_accepted_tokens": stats["spec_num_accepted_tokens"],
            "spec_drafted_per_position": [int(x) for x in speculator.drafted_at],
            "spec_accepted_per_position": [int(x) for x in speculator.accepted_at],
        }


def current_task_id() -> str:
    """The Ray task running this call ("" outside Ray: ray is never imported here)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return ""
    return ray.get_runtime_context().get_task_id() or ""


def parse_crash_hook(hook: str | None) -> tuple[int | None, str | None]:
    """(request index, marker file) of the test hook's value; (None, None) when unset."""
    if not hook:
        return None, None
    index, sep, marker = hook.partition(":")
    if not sep or not marker or not index.strip().isdigit():
        raise ValueError(f"{CRASH_HOOK_ENV}={hook!r} must be INDEX:MARKER_FILE")
    return int(index), marker
