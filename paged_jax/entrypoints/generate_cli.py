"""The main job: offline batched generation from the command line (`paged-jax-generate`).

paged-jax-generate                          # built-in demo model and prompts
paged-jax-generate --model DIR --prompts prompts.jsonl --output out.jsonl --summary-json s.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import signal
import sys
import threading
import time
import traceback
from typing import Any, NamedTuple

from paged_jax.config import EngineConfig
from paged_jax.constants import PROMPT_BYTES_PER_TOKEN
from paged_jax.distributed import (
    JoinError,
    broadcast_from_primary,
    is_runtime_failure,
    leave_job,
    settings_from,
)
from paged_jax.distributed import initialize as initialize_distributed
from paged_jax.entrypoints.data_parallel import (
    add_data_parallel_flags,
    check_data_parallel_args,
)
from paged_jax.entrypoints.field_flags import Flag, add_field_flags, field_values
from paged_jax.entrypoints.hidden_state_files import (
    write_hidden_state_files,
)
from paged_jax.entrypoints.job import (
    SIZED_FIELDS,
    JobRequest,
    JobSize,
    make_requests,
    parse_lora_modules,
    size_engine,
)
from paged_jax.entrypoints.output_file import (
    JsonlStream,
    OutputWriteError,
    check_distinct_paths,
    check_writable,
    write_json_atomic,
)
from paged_jax.entrypoints.prompts_file import (
    LINE_SLACK_BYTES,
    MAX_PROMPTS_FILE_BYTES,
    MAX_PROMPTS_FILE_LINES,
    PromptLine,
    check_readable,
    read_prompt_lines,
)
from paged_jax.entrypoints.records import (
    NOT_SERVED,
    one_line,
    rejected_error,
    request_record,
)
from paged_jax.sampling_params import MAX_LOGPROBS, SamplingParams
from paged_jax.spec_decode.proposer import SpeculativeConfig
from paged_jax.structured_outputs import StructuredOutputsParams

PROG = "paged-jax-generate"
EPILOG = f"""\
prompts file: JSONL when its first non-blank line is a JSON object, else one prompt per
line. A JSONL line holds exactly one of "prompt" (text), "prompt_token_ids" (list of
ints) or "messages" (a chat, rendered with --chat-template or the checkpoint's chat
template), an optional "id" echoed in the output, and optional SamplingParams overrides
such as "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", and
"structured_outputs" ({{"json": schema}}, {{"regex": ...}}, {{"choice": [...]}},
{{"grammar": ...}}, {{"json_object": true}}: vLLM's keys; null for none), which wins over
--json-schema, --regex or --choice; a line's constraint that is invalid, or that the
grammar library cannot compile, is that line's error record, while a flag's is checked
(compiled) before the model loads and stops the run (exit status 2). "-" reads standard
input. Every line is rendered and tokenized before the model loads.

output: one JSON line per request, written as each request finishes (so in finish
order; "index" is the position in the prompts file). A request that cannot be served
(bad line, empty or too long prompt, bad token id, no tokenizer, no chat template)
gets a record with "error" and the others complete; when no line can be served the
model is not loaded. If the engine fails mid-run, the finished records stay and every
unfinished request gets an error record naming the failure (exit status 1). The file
is written as OUTPUT.partial and renamed when every request has its record; a leftover
OUTPUT.partial is moved to OUTPUT.partial.N first. Ctrl-C leaves the records so far in
OUTPUT.partial (exit status 130). A symlinked --output or --summary-json is refused.

engine size: without --max-num-seqs / --max-num-batched-tokens the engine is sized to
the job (its sequences, n included, and its prompt tokens, rounded up to a power of two
and a token bucket, at most the defaults), so a small job warms up few, small step
programs; one line says what was chosen. A flag given is kept as given.

limits: a prompts-file line past {6 * PROMPT_BYTES_PER_TOKEN} bytes per token of max_model_len \
+ {LINE_SLACK_BYTES >> 20} MiB is an
error record; a file over {MAX_PROMPTS_FILE_BYTES >> 30} GiB or {MAX_PROMPTS_FILE_LINES:,} \
lines is refused; a text prompt over {PROMPT_BYTES_PER_TOKEN}
characters per token of max_model_len is refused before it is tokenized.

defaults: the CLI samples greedily (--temperature 0) and generates up to 32 tokens;
the Python API's SamplingParams() defaults to temperature 1.0 and max_tokens 16, as
vLLM's does.

compile cache: on, in --compile-cache-dir, else $PAGED_JAX_COMPILE_CACHE, else
$PAGED_JAX_CACHE/jax_compile_cache (~/.cache/paged_jax/jax_compile_cache when neither is
set): JAX's persistent compilation cache, and in its executables/ folder the compiled
step programs, which a second run with the same model, engine settings and package
version loads instead of compiling (a "warm" start; the summary gives each phase of the
start). --no-compile-cache or PAGED_JAX_COMPILE_CACHE=0 turns both off.

exit status: 0 all requests succeeded, 1 some requests failed (see their records),
2 nothing was run (bad flag, unreadable or endless prompts, unwritable output, unusable
model, config.json, tokenizer.json, chat template or max_model_len), 130 interrupted
(Ctrl-C). {PROG} never prints a traceback for these.
"""
_DEFAULT_ENGINE = EngineConfig()


# SamplingParams fields on the command line, in --help order. The CLI's own defaults:
# greedy and 32 tokens (the API's SamplingParams() samples at temperature 1, 16 tokens).
SAMPLING_FLAGS = {
    "n": Flag("completions per prompt"),
    "temperature": Flag("0 = greedy (API: 1.0)", default=0.0),
    "top_p": Flag("nucleus mass; 1 = off"),
    "top_k": Flag("0 or -1 = off"),
    "min_p": Flag("0 = off"),
    "seed": Flag("per-request seed"),
    "max_tokens": Flag("most tokens per completion", default=32),
    "min_tokens": Flag("EOS/stop masked before"),
    "stop": Flag(
        "stop string (repeat the flag for more)", default=None, extra={"action": "append"}
    ),
    "stop_token_ids": Flag("besides EOS", default=None, extra={"nargs": "+", "metavar": "ID"}),
    "ignore_eos": Flag("generate past EOS"),
    "logprobs": Flag(f"top logprobs per token (0-{MAX_LOGPROBS})"),
    "logprobs_mode": Flag("processed_logprobs: of the distribution sampled from"),
    "prompt_logprobs": Flag(f"top logprobs per prompt token (0-{MAX_LOGPROBS})"),
    "prompt_logprobs_tail": Flag(
        "prompt logprobs of the last N prompt tokens only (the rest may come from the cache)"
    ),
    "presence_penalty": Flag("[-2, 2]"),
    "frequency_penalty": Flag("[-2, 2]"),
    "repetition_penalty": Flag("> 0; 1 = off"),
    "include_stop_str_in_output": Flag("keep the stop string / stop token text in the output text"),
    "skip_special_tokens": Flag("keep special tokens in the output text"),
    "return_hidden_states": Flag(
        "write the --hidden-state-layers rows of every line as .npy files beside --output"
    ),
    "steering_vectors": Flag(
        'a JSON object {"LAYER": [hidden_size floats], ...}, or a file holding one, added '
        "after those --steering-layers for every line (a line's own key wins)",
        extra={
            "type": lambda value: _json_object_arg(value, "--steering-vectors"),
            "metavar": "JSON",
        },
    ),
}
SAMPLING_ABSENT = {
    # Not one flag per field: one of three flags builds the constraint (add_constraint_flags).
    "structured_outputs": "--json-schema FILE, --regex PATTERN or --choice A,B,C",
}
# The flags that set SamplingParams.structured_outputs for the whole file, by its field.
CONSTRAINT_FLAGS = {"json": "--json-schema", "regex": "--regex", "choice": "--choice"}


def _json_object_arg(value: str, flag: str) -> dict[str, Any]:
    """A flag's JSON object, given inline (JSON text) or as a file's path."""
    text = value
    if not value.lstrip().startswith(("{", "[")):
        try:
            text = pathlib.Path(value).read_text()
        except OSError as err:
            raise argparse.ArgumentTypeError(
                f"{flag}={value!r} is neither a JSON object nor a readable file ({err})"
            ) from err
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{flag}: not valid JSON ({err})") from err
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(
            f"{flag} must be a JSON object (layer -> vector), not {type(obj).__name__}"
        )
    return obj


class ConstraintFlag(NamedTuple):
    """The constraint flag given: its StructuredOutputsParams field and the flag's value."""

    field: str
    value: str


# EngineConfig fields on the command line, in --help order.
ENGINE_FLAGS = {
    "block_size": Flag("tokens per KV block"),
    "num_kv_blocks": Flag(
        "KV blocks in the pool, the null block included (default: sized from --kv-cache-memory)"
    ),
    "kv_cache_memory": Flag(
        "KV budget: bytes (> 1) or a fraction of free device memory (<= 1) (default: 0.9 "
        "on accelerators; on CPU room for --max-num-seqs full-length sequences, at most 1 GiB)"
    ),
    "gpu_memory_utilization": Flag(
        "vLLM's: the fraction in (0, 1] of device memory for weights + KV cache + "
        "activations; the KV pool gets what the weights and activations leave (ignored "
        "on CPU; instead of --kv-cache-memory)"
    ),
    "max_num_seqs": Flag(
        "most sequences per step (default: sized to the job, at most "
        f"{_DEFAULT_ENGINE.max_num_seqs})",
        default=None,
    ),
    "max_num_batched_tokens": Flag(
        "token budget per step (default: sized to the job, at most "
        f"{_DEFAULT_ENGINE.max_num_batched_tokens})",
        default=None,
    ),
    "max_model_len": Flag("longest prompt + output (default: the model's max_position_embeddings)"),
    "tensor_parallel_size": Flag(
        "split weights and KV caches over the first N devices (docs/scale_out.md)"
    ),
    "preemption_mode": Flag("recompute (vLLM V1) or swap to host memory"),
    "attention_backend": Flag(
        "auto = Pallas on GPU, reference elsewhere; pallas needs a GPU; mosaic_gpu needs "
        "a Hopper GPU and jax >= 0.11.2 (mosaic_gpu_interpret: its CPU interpreter)"
    ),
    "dtype": Flag("auto = bf16 on GPU, else f32"),
    "kv_cache_dtype": Flag(
        "auto (= --dtype) or fp8: an fp8 pool holds 2x the KV blocks of a bf16 one (the GPU "
        "default) in the same memory, 4x those of f32 (the CPU default)"
    ),
    "quantization": Flag(
        "8-bit weights, quantized on load (weight-only: activations stay in --dtype); a "
        "block-wise fp8 checkpoint is served 8-bit without it (docs/quantization.md)"
    ),
    "quantize_embeddings": Flag(
        "with --quantization: the token embedding and the LM head 8-bit too (one scale per "
        "vocab row; a tied head shares the table)"
    ),
    "enable_prefix_caching": Flag("turn prefix caching off", name="no-prefix-caching"),
    "async_scheduling": Flag("read each step's tokens before scheduling the next (for debugging)"),
    "scan_layers": Flag(
        "run repeating layers as one scanned body (compile time independent of depth); "
        "auto = on accelerators, off on CPU"
    ),
    # --seed is the per-request SamplingParams.seed.
    "seed": Flag("seed for unseeded requests", name="engine-seed"),
    "distributed_coordinator_address": Flag(
        "multi-process engine: process 0's host:port; every process runs this command "
        "with its own --process-id, only process 0 writes output (default: "
        "$JAX_COORDINATOR_ADDRESS; docs/scale_out.md)",
        name="coordinator-address",
    ),
    "distributed_num_processes": Flag(
        "processes of a multi-process engine (default: $JAX_NUM_PROCESSES)",
        name="num-processes",
    ),
    "distributed_process_id": Flag(
        "this process's rank in [0, --num-processes) (default: $JAX_PROCESS_ID)",
        name="process-id",
    ),
    "enable_lora": Flag("serve LoRA adapters (--lora-modules turns it on; docs/lora.md)"),
    "max_loras": Flag("LoRA adapters resident on the device at once (one batch mixes them)"),
    "max_lora_rank": Flag("the largest LoRA rank served (smaller ranks are zero-padded)"),
    "distributed_init_timeout_s": Flag(
        "multi-process engine: seconds to wait for every process to join before failing "
        "(a peer that never starts)",
        name="distributed-init-timeout",
    ),
    "batch_invariant": Flag(
        "a request's tokens and logprobs bitwise independent of the batch, its chunking "
        "and prefix-cache hits (one bucket, fixed reduction orders; slower)"
    ),
    "hidden_state_layers": Flag(
        "layers whose residual stream lines may ask for (return_hidden_states): i = after "
        "decoder layer i, -1 = the final-norm output",
        extra={"nargs": "+", "metavar": "LAYER"},
    ),
    "steering_layers": Flag(
        "decoder layers that lines may steer (their steering_vectors key)",
        extra={"nargs": "+", "metavar": "LAYER"},
    ),
}
ENGINE_ABSENT = {
    "enable_prompt_embeds": "prompt embeddings are arrays: the Python API takes them",
    "scheduling_policy": "the prompts file carries no request priority",
    "hash_algo": "the prefix-cache hash changes no output",
    "validate": "a debugging switch of the tests (device-side range checks)",
    "distributed_heartbeat_timeout_s": "a multi-host knob of the Python API",
    "lockstep_check_interval": "a multi-host knob of the Python API",
    "speculative_config": "--speculative-config JSON (vLLM's dict in one flag)",
}


def speculative_config_flag(text: str) -> SpeculativeConfig:
    """--speculative-config's value: vLLM's dict as JSON (argparse exits 2 on an error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {err}") from None
    try:
        return SpeculativeConfig.from_dict(value)
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Offline batched generation with paged-jax.",
        epilog=EPILOG,
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--model", help="Hugging Face model directory (default: the built-in demo model)"
    )
    p.add_argument(
        "--cache-dir",
        help="where the demo model is written (default: $PAGED_JAX_CACHE, else ~/.cache/paged_jax)",
    )
    p.add_argument(
        "--prompts", help="JSONL or text prompts file, '-' for stdin (default: the built-in set)"
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template for the 'messages' lines, instead of the checkpoint's "
        "(default: its chat_template.jinja or tokenizer_config.json's chat_template)",
    )
    p.add_argument("--num-prompts", type=int, default=200, help="size of the built-in set")
    p.add_argument("--output", help="write one JSON line per request here")
    p.add_argument("--summary-json", help="write the run's summary as JSON here")
    s = p.add_argument_group("sampling (SamplingParams fields; JSONL lines may override)")
    add_field_flags(s, SamplingParams, SAMPLING_FLAGS, SAMPLING_ABSENT)
    add_constraint_flags(s)
    e = p.add_argument_group("engine (EngineConfig fields)")
    add_field_flags(e, EngineConfig, ENGINE_FLAGS, ENGINE_ABSENT)
    e.add_argument(
        "--speculative-config",
        type=speculative_config_flag,
        default=None,
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (docs/speculative_decoding.md)',
    )
    e.add_argument(
        "--compile-cache-dir",
        default=None,
        help="the compile cache's directory (default: $PAGED_JAX_COMPILE_CACHE, else "
        "$PAGED_JAX_CACHE/jax_compile_cache, else ~/.cache/paged_jax/jax_compile_cache)",
    )
    e.add_argument(
        "--no-compile-cache", action="store_true", help="compile every step program afresh"
    )
    e.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help='PEFT LoRA adapters a JSONL line picks with "lora": "NAME" (turns on '
        "--enable-lora; docs/lora.md)",
    )
    add_data_parallel_flags(p)
    p.add_argument("--no-tqdm", action="store_true", help="no progress bar or load progress")
    return p


def add_constraint_flags(group: Any) -> None:
    """--json-schema / --regex / --choice: at most one (argparse exits 2 naming both);
    --disable-any-whitespace for --json-schema."""
    flags = group.add_mutually_exclusive_group()
    helps = {
        "json": ("FILE", "outputs are JSON valid under the JSON schema in FILE"),
        "regex": ("PATTERN", "outputs fullmatch the regex (Rust regex syntax)"),
        "choice": ("A,B,C", "outputs are exactly one of the comma-separated strings"),
    }
    for field, flag in CONSTRAINT_FLAGS.items():
        metavar, text = helps[field]
        flags.add_argument(
            flag,
            dest="structured_outputs",
            metavar=metavar,
            type=functools.partial(ConstraintFlag, field),
            default=None,
            help=f'{text}, for every line without its own "structured_outputs" '
            "(docs/structured_outputs.md)",
        )
    group.add_argument(
        "--disable-any-whitespace",
        action="store_true",
        help="with --json-schema: compact JSON, no whitespace between tokens. By default "
        "the grammar allows any whitespace there, which a small or weak model may fill "
        "with newlines until --max-tokens; compact JSON stops that, at the cost of a "
        "layout the model may write less well than the indented JSON it was trained on "
        '(a line\'s own constraint takes "disable_any_whitespace": true)',
    )


def constraint_from_args(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """The run-wide constraint of the constraint flags, or None without one.

    Checked here for its form (a --json-schema file that is not a JSON schema, an empty
    --choice); whether the grammar library compiles it is checked with the tokenizer
    before the model loads (preflight.check_constraint).

    Raises:
        ValueError: one line naming the flag (nothing is run).
    """
    given: ConstraintFlag | None = args.structured_outputs
    compact = bool(getattr(args, "disable_any_whitespace", False))
    if given is None or given.field != "json":
        if compact:
            used = "no constraint flag" if given is None else CONSTRAINT_FLAGS[given.field]
            raise ValueError(
                f"--disable-any-whitespace applies to --json-schema, not to {used}; a JSONL "
                'line\'s own JSON constraint takes "disable_any_whitespace": true'
            )
        if given is None:
            return None
    flag = constraint_flag_text(given)
    value: Any = given.value
    if given.field == "json":
        try:
            value = pathlib.Path(given.value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{flag} cannot be read: {err}") from err
    elif given.field == "choice":
        value = value.split(",")
    options = {"disable_any_whitespace": True} if compact else {}
    try:
        return StructuredOutputsParams(**{given.field: value}, **options)
    except ValueError as err:
        raise ValueError(f"{flag}: {one_line(str(err))}") from None
    except RecursionError:
        raise ValueError(f"{flag}: the schema is nested too deeply to read") from None


def constraint_flag_text(given: ConstraintFlag) -> str:
    """How errors name the constraint flag given: --regex='a(b'."""
    return f"{CONSTRAINT_FLAGS[given.field]}={given.value!r}"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every default once and keeps the epilog's line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "(default: " in action.help:  # said in words already
            return action.help
        # A switch (a flag without a value) is off unless given, whichever field value
        # it sets: --no-prefix-caching and --ignore-eos both show False.
        if action.option_strings and action.nargs == 0 and action.default is not argparse.SUPPRESS:
            return f"{action.help} (default: False)"
        return super()._get_help_string(action)


def engine_args_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig keyword arguments of the engine flags (the LLM's keywords too).

    The step sizes the command line did not give (SIZED_FIELDS) are left out: the CLI
    sizes them to the job (job.size_engine).
    """
    engine_args = field_values(args, EngineConfig, ENGINE_FLAGS)
    if getattr(args, "lora_modules", None):
        engine_args["enable_lora"] = True
    if getattr(args, "speculative_config", None) is not None:
        engine_args["speculative_config"] = args.speculative_config
    for name in SIZED_FIELDS:
        if engine_args[name] is None:
            del engine_args[name]
    memory = engine_args["kv_cache_memory"]
    if memory is not None and memory > 1:
        engine_args["kv_cache_memory"] = int(memory)  # bytes; <= 1 is a fraction
    return engine_args


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """The run-wide SamplingParams: one flag per field (ValueError names the field)."""
    return SamplingParams(**field_values(args, SamplingParams, SAMPLING_FLAGS))


class _Interrupt:
    """Ctrl-C during one run: raises KeyboardInterrupt, as Python's own handler does, and
    remembers it, so an interrupt that lands where Python swallows exceptions (jax's gc
    callback, a __del__) still ends the run at the next check()."""

    def __init__(self) -> None:
        self.seen = False
        self._previous: Any = None

    def __enter__(self) -> _Interrupt:
        # Only Python's default handler is replaced (signals reach the main thread only).
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        self.seen = True
        if getattr(getattr(frame, "f_code", None), "co_name", "") == "_xla_gc_callback":
            return  # Python would print it as ignored; check() raises it instead
        raise KeyboardInterrupt

    def check(self) -> None:
        """Raises KeyboardInterrupt when Ctrl-C was pressed, even if that one was lost."""
        if self.seen:
            raise KeyboardInterrupt


@dataclasses.dataclass
class _Plan:
    """Everything checked before the model is loaded."""

    engine_args: dict
    params: SamplingParams
    lines: list[PromptLine]
    requests: list[JobRequest]  # the servable lines, rendered and tokenized
    job_size: JobSize | None  # None: no request to size the engine for
    model_dir: pathlib.Path
    output: JsonlStream | None
    summary_path: pathlib.Path | None
    compile_cache: bool | str
    chat_template: str | None  # the --chat-template file's text
    cache_use: dict[str, int] = dataclasses.field(default_factory=dict)  # warm-up hits/misses
    interrupt: _Interrupt | None = None
    multiprocess: bool = False  # one of the processes of a multi-process engine


def _prepare(args: argparse.Namespace, interrupt: _Interrupt | None = None) -> _Plan:
    """Fatal checks, cheapest first, so a doomed run fails in seconds without loading.

    The output file is opened last, so a run that fails here touches no file.

    Raises:
        ValueError / FileNotFoundError: one line each, naming the flag or file.
    """
    summary_path = (
        check_writable(args.summary_json, "--summary-json") if args.summary_json else None
    )
    if args.output:
        check_writable(args.output, "--output")
    check_distinct_paths(
        {
            "--prompts": args.prompts,
            "--chat-template": args.chat_template,
            "--output": args.output,
            "--summary-json": args.summary_json,
        }
    )
    check_data_parallel_args(args)
    engine_args = engine_args_from_args(args)
    lora_modules = parse_lora_modules(args.lora_modules or ())
    if lora_modules and args.data_parallel_size > 1:
        raise ValueError(
            f"--lora-modules is not served with --data-parallel-size={args.data_parallel_size} "
            "yet: run one replica"
        )
    # Checked (and the model checked) at the default sizes for what the job will size.
    default = _DEFAULT_ENGINE
    provisional, _ = size_engine(
        engine_args,
        num_sequences=default.max_num_seqs,
        num_prompt_tokens=default.max_num_batched_tokens,
    )
    EngineConfig(**provisional)
    params = sampling_params_from_args(args)
    constraint = constraint_from_args(args)
    params = dataclasses.replace(params, structured_outputs=constraint)
    if args.prompts is not None:
        check_readable(args.prompts)
    elif args.num_prompts < 1:
        raise ValueError(f"--num-prompts={args.num_prompts!r} must be >= 1")
    from paged_jax.entrypoints.preflight import (
        check_constraint,
        check_model,
        read_chat_template,
    )

    chat_template = None if args.chat_template is None else read_chat_template(args.chat_template)
    if args.model is None:
        from paged_jax.entrypoints.demo import ensure_demo_model

        try:
            model_dir = ensure_demo_model(args.cache_dir)
        except OSError as err:
            raise ValueError(f"--cache-dir: the demo model cannot be written: {err}") from err
        _say(args, f"using the built-in demo model (random weights) at {model_dir}")
    else:
        model_dir = pathlib.Path(args.model)
        if not (model_dir / "config.json").is_file():
            raise ValueError(
                f"--model={args.model!r} must be a Hugging Face model directory with config.json"
            )
    facts = check_model(model_dir, provisional, chat_template=chat_template)
    if constraint is not None:  # compiled once now, so a bad one fails before loading
        _check_grammar_library()
        check_constraint(constraint, facts, constraint_flag_text(args.structured_outputs))
    if args.prompts:
        # Read after the model check: the line limit derives from max_model_len.
        _, lines = read_prompt_lines(args.prompts, facts.max_model_len)
        if all(line.error for line in lines):
            raise ValueError(f"--prompts={args.prompts!r} holds no valid line: {lines[0].error}")
    else:
        from paged_jax.entrypoints.demo_prompts import builtin_prompts

        texts = builtin_prompts(args.num_prompts)
        lines = [PromptLine(i, i + 1, kind="prompt", value=t) for i, t in enumerate(texts)]
    requests = make_requests(
        lines,
        params,
        tokenizer=facts.tokenizer,
        chat_template=facts.chat_template,
        max_model_len=facts.max_model_len,
        lora_modules=lora_modules,
    )
    # A multi-process engine: every process runs this command, process 0 writes.
    job = settings_from(
        EngineConfig(**{k: v for k, v in engine_args.items() if k.startswith("distributed_")})
    )
    if job is not None:  # join before the checks below start jax's backend
        initialize_distributed(job, None if interrupt is None else lambda: interrupt.seen)
        # Process 0's job is every process's: admission comes from it (LLM.generate_iter),
        # and an engine sized to each process's own file would compile other programs.
        lines, requests = broadcast_from_primary((lines, requests))
    if any(r.params.structured_outputs is not None for r in requests):
        _check_grammar_library()
    job_size = None
    if requests:
        engine_args, job_size = size_engine(
            engine_args,
            num_sequences=sum(r.params.n for r in requests),
            num_prompt_tokens=sum(len(r.prompt["prompt_token_ids"]) for r in requests),
            num_requests=len(requests),
        )
        EngineConfig(**engine_args)
    writes = job is None or job.process_id == 0
    from pallas_kernels.backend import check_backend

    check_backend(args.attention_backend)
    if not writes:
        summary_path = None
    output = JsonlStream(args.output) if args.output and writes else None
    if output is not None and output.moved_aside is not None:
        _say(
            args,
            f"{output.partial} (a previous run's records) was moved to {output.moved_aside}",
        )
    compile_cache: bool | str = True
    if args.no_compile_cache:
        compile_cache = False
    elif args.compile_cache_dir:
        compile_cache = args.compile_cache_dir
    return _Plan(
        engine_args,
        params,
        lines,
        requests,
        job_size,
        model_dir,
        output,
        summary_path,
        compile_cache,
        None if chat_template is None else chat_template.source,
        multiprocess=job is not None,
    )


def _check_grammar_library() -> None:
    """Constrained requests need llguidance: checked before the model loads."""
    import importlib.util

    if importlib.util.find_spec("llguidance") is None:
        raise ValueError(
            "structured outputs (--json-schema, --regex, --choice, a line's "
            '"structured_outputs") need the llguidance package: pip install '
            "'paged-jax[structured]'"
        )


def _say(args: argparse.Namespace, message: str, end: str = "\n") -> None:
    if not args.no_tqdm or end == "\n":
        print(message, file=sys.stderr, end=end, flush=True)


def _load(args: argparse.Namespace, plan: _Plan):
    """Builds the LLM with a progress line for loading and for each warm-up program."""
    from paged_jax.llm import LLM

    note = None if plan.job_size is None else plan.job_size.note()
    if note is not None:
        _say(args, note)
    t0 = time.perf_counter()
    _say(args, f"loading {plan.model_dir} ...")
    llm = LLM(
        str(plan.model_dir),
        warmup=False,
        compile_cache=plan.compile_cache,
        chat_template=plan.chat_template,
        **plan.engine_args,
    )
    load_s = time.perf_counter() - t0
    _check_interrupt(plan)
    cache = llm.compile_cache_dir or "off"
    _say(args, f"loaded in {load_s:.1f} s; warm-up (compile cache: {cache})")

    def progress(i: int, total: int, name: str, action: str) -> None:
        _check_interrupt(plan)
        if not args.no_tqdm:
            line = f"\r  warm-up {i + 1}/{total}: {action} {name}"
            print(line.ljust(64), file=sys.stderr, end="", flush=True)

    from paged_jax.compile_cache import cache_counts
    from paged_jax.entrypoints.replica import compile_cache_use

    t0, before = time.perf_counter(), cache_counts()
    llm.engine.warmup(progress)
    warmup_s = time.perf_counter() - t0
    _check_interrupt(plan)
    report = llm.engine.warmup_report
    plan.cache_use = compile_cache_use(before, report)
    if not args.no_tqdm:
        print(file=sys.stderr)
    _say(args, f"warm-up done in {warmup_s:.1f} s ({_warmup_line(report)})")
    return llm, load_s, warmup_s


def _check_interrupt(plan: _Plan) -> None:
    if plan.interrupt is not None:
        plan.interrupt.check()


def _warmup_line(report) -> str:
    """One line on how the programs came to be: "cold: 7 compiled (trace 1.2 s, ...)"."""
    phases = report.phase_seconds()
    parts = []
    if report.num_compiled:
        parts.append(
            f"{report.num_compiled} compiled (trace {phases['trace_s']:.1f} s, lower "
            f"{phases['lower_s']:.1f} s, compile {phases['compile_s']:.1f} s)"
        )
    if report.num_loaded:
        parts.append(f"{report.num_loaded} loaded from the cache in {phases['load_s']:.1f} s")
    return f"{report.start} start: " + ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI on `argv` (default: the command line); returns the exit status.

    Run as the program itself (argv None: the installed command, ``python -m``,
    scripts/generate.py), Ctrl-C ends the process at once with status 130, once the
    records so far are flushed to OUTPUT.partial: a step program being compiled when the
    interrupt lands goes on compiling on XLA's threads, and an interpreter shutting down
    under it crashed (SIGSEGV) instead of exiting. Called with an argv list (from
    Python), main returns 130 instead.
    """
    try:
        code = _main(argv)
    except KeyboardInterrupt:  # a second Ctrl-C while the first was handled
        code = 130
    if code == 130 and argv is None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    return code


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    with _Interrupt() as interrupt:
        try:
            plan = _prepare(args, interrupt)
            interrupt.check()
        except (ValueError, FileNotFoundError) as err:
            print(f"{PROG}: error: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
        except JoinError as err:  # a peer never came: jax's half-made job is left unshut
            print(f"{PROG}: error: {err}", file=sys.stderr)
            if argv is None:
                leave_job(1)
            return 1
        plan.interrupt = interrupt
        return _serve(args, plan)


def _serve(args: argparse.Namespace, plan: _Plan) -> int:
    """_run, and on an exception: the records so far kept in OUTPUT.partial."""
    try:
        return _run(args, plan)
    except BaseException as err:
        fatal = isinstance(err, ValueError | FileNotFoundError)
        kept = None if plan.output is None else plan.output.close_partial()
        # A fatal error before the first record (the model failed to load) stays one line.
        if plan.output is not None and (kept is not None or not fatal):
            where = (
                "no records were written"
                if kept is None
                else f"{plan.output.num_records} records are in {kept}"
            )
            print(
                f"{PROG}: error: the run stopped ({type(err).__name__}); {where}; "
                f"{plan.output.target} was not replaced",
                file=sys.stderr,
            )
        if isinstance(err, KeyboardInterrupt):
            return 130
        if plan.multiprocess and is_runtime_failure(err):
            _leave_after_peer_failure(err)
        if fatal:
            print(f"{PROG}: error: {err}", file=sys.stderr)
            return 2
        raise


class _Records:
    """Writes each record as it is made and keeps what the summary needs.

    Once the output file cannot be written (a full disk), `output_error` is set, the run
    stops, and every later record is kept for the summary only, as a failed request
    with no record.
    """

    def __init__(self, plan: _Plan):
        self.plan = plan
        self.failed: list[dict[str, Any]] = []
        self.results: list[Any] = []
        self.bar: Any = None
        self.output_error: OutputWriteError | None = None
        self.num_lost = 0  # records the output file could not take

    def emit(self, record: dict[str, Any]) -> bool:
        """Writes `record`; False when it is not in the output file (the file failed)."""
        output = self.plan.output
        written = True
        if output is not None:
            try:
                if self.output_error is not None:
                    raise self.output_error
                output.write(record)
            except OutputWriteError as err:
                self.output_error, written = err, False
                self.num_lost += 1
                line = record["line"]
                detail = record.get("error") or "its completion was lost"
                detail = detail.removeprefix(f"line {line}: ")
                record = {
                    **record,
                    "error": f"line {line}: no record in {output.partial.name}, which could "
                    f"not be written ({detail})",
                }
        if record.get("error") is not None:
            self.failed.append({k: record[k] for k in ("index", "id", "line", "error")})
        if self.bar is not None:
            self.bar.update(1)
        return written

    def bad_lines(self) -> None:
        for line in self.plan.lines:
            if line.error:
                self.emit(request_record(line, error=line.error))


def _run(args: argparse.Namespace, plan: _Plan) -> int:
    records = _Records(plan)
    if not plan.requests:  # decided before loading: nothing to warm up for
        records.bad_lines()
        print(
            f"{PROG}: error: no request can be served ({len(plan.lines)} error records); "
            "the model was not loaded",
            file=sys.stderr,
        )
        return _finish(args, plan, records, {"requests": len(plan.lines), "succeeded": 0})
    if args.data_parallel_size > 1:  # replicas on Ray Data (docs/scale_out.md)
        from paged_jax.entrypoints.data_parallel import run_data_parallel

        return _finish(args, plan, records, run_data_parallel(args, plan, records))
    llm, load_s, warmup_s = _load(args, plan)
    if not args.no_tqdm:
        from tqdm.auto import tqdm

        records.bar = tqdm(total=len(plan.lines), desc="requests", unit="req", dynamic_ncols=True)
    records.bad_lines()
    start = time.perf_counter()
    engine_error, unfinished = _generate(llm, plan, records, start)
    if engine_error is not None:
        what = f"{type(engine_error).__name__}: {engine_error}"
        frame = traceback.extract_tb(engine_error.__traceback__)[-1]
        print(
            f"{PROG}: error: the engine failed ({what.splitlines()[0]}) at "
            f"{pathlib.Path(frame.filename).name}:{frame.lineno}; the {len(unfinished)} "
            "unfinished requests get error records",
            file=sys.stderr,
        )
        for request in unfinished:
            line = request.line
            error = f"line {line.line}: the engine failed before this request finished ({what})"
            records.emit(request_record(line, error=error))
    else:  # stopped by the output file: _finish reports it
        for request in unfinished:
            records.emit(
                request_record(request.line, error=f"line {request.line.line}: {NOT_SERVED}")
            )
    wall = time.perf_counter() - start
    summary = _summary(llm, plan, records.results, records.failed, load_s, warmup_s, wall)
    summary["engine_error"] = (
        None if engine_error is None else f"{type(engine_error).__name__}: {engine_error}"
    )
    if records.bar is not None:
        # The bar's last rate is the summary's figure, from the same counter and clock.
        records.bar.set_postfix_str(f"out {summary['generated_tokens_per_s']} tok/s", refresh=True)
        records.bar.close()
    code = _finish(args, plan, records, summary)
    if plan.multiprocess and engine_error is not None and is_runtime_failure(engine_error):
        leave_job(code)  # outputs are written; see _leave_after_peer_failure
    return code


def _leave_after_peer_failure(err: BaseException) -> None:
    """Ends a process whose engine's collectives failed (a peer died): exit 1, one line.

    Such a process cannot go on using jax: at exit jax waits for every process in a
    shutdown barrier, and with a peer gone it aborts after the heartbeat timeout (SIGABRT,
    exit 134, a C++ stack dump). Outputs are written before this is called.
    """
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    print(f"{PROG}: error: the engine's processes lost each other ({first})", file=sys.stderr)
    leave_job(1)


def _generate(
    llm, plan: _Plan, records: _Records, start: float
) -> tuple[Exception | None, list[JobRequest]]:
    """Serves the requests, writing each record as its request finishes.

    Returns:
        (the exception the engine raised, or None; the requests it left unfinished).
    """
    unfinished = dict(enumerate(plan.requests))
    if records.output_error is not None:  # the bad lines' records already failed
        return None, list(unfinished.values())
    loras = [r.lora for r in plan.requests]
    stream = llm.generate_iter(
        [r.prompt for r in plan.requests],
        [r.params for r in plan.requests],
        **({"lora_request": loras} if any(loras) else {}),
    )
    num_generated = 0
    try:
        while True:
            try:
                i, out = next(stream)
            except StopIteration:
                return None, []
            except Exception as err:  # noqa: BLE001 - the engine's failure ends the run
                return err, list(unfinished.values())
            _check_interrupt(plan)
            line = unfinished.pop(i).line
            if out.error is not None:
                records.emit(request_record(line, error=rejected_error(line, i, out.error)))
            else:
                num_generated += out.metrics.num_generated_tokens
                if records.bar is not None:
                    rate = num_generated / max(time.perf_counter() - start, 1e-9)
                    records.bar.set_postfix_str(f"out {rate:.1f} tok/s", refresh=False)
                record = request_record(line, out)
                if plan.output is not None:
                    target = plan.output.target
                    record.update(write_hidden_state_files(target, line.index, out))
                if records.emit(record):
                    records.results.append(out)
            if records.output_error is not None:  # stop: no further record can be kept
                return None, list(unfinished.values())
    finally:
        stream.close()  # aborts what is left (an interrupt)


# Failed requests listed after the summary (all of them are in --output / --summary-json).
NUM_FAILED_SHOWN = 5


def _finish(args: argparse.Namespace, plan: _Plan, records: _Records, summary: dict) -> int:
    """Completes the output, writes and prints the summary; the exit status."""
    summary.setdefault("failed", len(records.failed))
    _check_interrupt(plan)
    code = 1 if records.failed else 0
    if plan.output is not None:
        if records.output_error is None:
            try:
                plan.output.commit()
            except OutputWriteError as err:
                records.output_error = err
        if records.output_error is not None:
            _output_failed(plan, records)
            code = 1
        summary["output_error"] = (
            None if records.output_error is None else str(records.output_error)
        )
    if plan.summary_path is not None:
        try:
            write_json_atomic(plan.summary_path, {**summary, "errors": records.failed})
        except OSError as err:
            print(
                f"{PROG}: error: --summary-json={str(plan.summary_path)!r} cannot be written: "
                f"{err.strerror or err}",
                file=sys.stderr,
            )
            code = 1
    print("\n== paged-jax generate summary ==")
    for key, value in summary.items():
        print(f"{key:>24}: {value}")
    shown = records.failed[:NUM_FAILED_SHOWN]
    for f in shown:
        print(f"  failed request {f['index']} (id {f['id']!r}): {one_line(f['error'])}")
    if len(records.failed) > len(shown):
        print(
            f"  ... and {len(records.failed) - len(shown)} more ({_where_errors_are(plan, records)})"
        )
    results = records.results
    if results and results[0].outputs:
        print(f"\nfirst completion: {results[0].outputs[0].text[:120]!r}")
    return code


def _where_errors_are(plan: _Plan, records: _Records) -> str:
    """Where the failed requests not listed can be read."""
    if plan.output is not None and records.output_error is None:
        return f"their error records are in {plan.output.target}"
    if plan.summary_path is not None:
        return f'every error is under "errors" in {plan.summary_path}'
    return "give --output or --summary-json to keep every error"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _output_failed(plan: _Plan, records: _Records) -> None:
    """The one line of a run whose output file could not be written (a full disk)."""
    output = plan.output
    kept = output.close_partial()
    where = (
        "no record was kept"
        if kept is None
        else f"{_count(output.num_records, 'whole record')} in {kept}"
    )
    print(
        f"{PROG}: error: {records.output_error}; the run stopped: {where}, "
        f"{_count(records.num_lost, 'request')} without a record (failed in the summary), "
        f"{output.target} was not replaced",
        file=sys.stderr,
    )


def _summary(llm, plan, results, failed, load_s, warmup_s, wall) -> dict[str, Any]:
    stats = llm.get_stats()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in results)
    gen_tokens = sum(o.metrics.num_generated_tokens for o in results)
    return {
        "requests": len(plan.lines),
        "succeeded": len(results),
        "failed": len(failed),
        "completions": sum(len(o.outputs) for o in results),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": gen_tokens,
        "load_s": round(load_s, 2),
        "warmup_s": round(warmup_s, 2),
        "load_and_warmup_s": round(load_s + warmup_s, 2),
        "wall_s": round(wall, 2),
        "generated_tokens_per_s": round(gen_tokens / max(wall, 1e-9), 1),
        "total_tokens_per_s": round((prompt_tokens + gen_tokens) / max(wall, 1e-9), 1),
        "kv_blocks": stats["num_kv_blocks"],
        "peak_kv_usage": round(stats["kv_cache_usage_peak"], 3),
        "prefix_cache_hit_rate": round(stats["prefix_cache_hit_rate"], 3),
        "max_num_seqs": llm.config.max_num_seqs,
        "max_num_batched_tokens": llm.config.max_num_batched_tokens,
        "preemptions": stats["num_preemptions"],
        **llm.engine.warmup_report.summary(),
        "warmup_compiles": stats["num_compiles"] - stats["num_compiles_after_warmup"],
        "compiles_after_warmup": stats["num_compiles_after_warmup"],
        "steps": stats["num_steps"],
        "median_step_ms": round(stats["step_time_ms"], 2),
        "compile_cache": str(llm.compile_cache_dir) if llm.compile_cache_dir else None,
        **(plan.cache_use if llm.compile_cache_dir else {}),
        **_spec_summary(stats),
    }


def _spec_summary(stats: dict[str, Any]) -> dict[str, Any]:
    """The summary lines of speculative decoding (none without it)."""
    if "spec_method" not in stats:
        return {}
    return {
        "spec_method": stats["spec_method"],
        "spec_draft_tokens": stats["spec_num_draft_tokens"],
        "spec_accepted_tokens": stats["spec_num_accepted_tokens"],
        "spec_acceptance_rate": round(stats["spec_acceptance_rate"], 3),
        "spec_accept_per_position": [
            round(x, 3) for x in stats["spec_acceptance_rate_per_position"]
        ],
    }


if __name__ == "__main__":
    sys.exit(main())
