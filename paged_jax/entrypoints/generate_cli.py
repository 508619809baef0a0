"""The main job: offline batched generation from the command line (`paged-jax-generate`).

paged-jax-generate                          # built-in demo model and prompts
paged-jax-generate --model DIR --prompts prompts.jsonl --output out.jsonl --summary-json s.json
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time
from typing import Any

from paged_jax.config import EngineConfig
from paged_jax.constants import PROMPT_BYTES_PER_TOKEN
from paged_jax.entrypoints.field_flags import Flag, add_field_flags, field_values
from paged_jax.entrypoints.output_file import (
    JsonlStream,
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
    params_for,
    read_prompt_lines,
)
from paged_jax.sampling_params import MAX_LOGPROBS, SamplingParams

PROG = "paged-jax-generate"
EPILOG = f"""\
prompts file: JSONL when its first non-blank line is a JSON object, else one prompt per
line. A JSONL line holds exactly one of "prompt" (text), "prompt_token_ids" (list of
ints) or "messages" (a chat, rendered with the checkpoint's chat template), an optional
"id" echoed in the output, and optional SamplingParams overrides such as "max_tokens",
"temperature", "top_p", "top_k", "seed", "stop", "n". "-" reads standard input.

output: one JSON line per request, written as each request finishes (so in finish
order; "index" is the position in the prompts file). A request that cannot be served
(bad line, empty or too long prompt, bad token id, no tokenizer) gets a record with
"error" and the others complete. The file is written as OUTPUT.partial and renamed
when the run completes; a leftover OUTPUT.partial is moved to OUTPUT.partial.N first.
A symlinked --output or --summary-json is refused.

limits: a prompts-file line past {6 * PROMPT_BYTES_PER_TOKEN} bytes per token of max_model_len \
+ {LINE_SLACK_BYTES >> 20} MiB is an
error record; a file over {MAX_PROMPTS_FILE_BYTES >> 30} GiB or {MAX_PROMPTS_FILE_LINES:,} \
lines is refused; a text prompt over {PROMPT_BYTES_PER_TOKEN}
characters per token of max_model_len is refused before it is tokenized.

defaults: the CLI samples greedily (--temperature 0) and generates up to 32 tokens;
the Python API's SamplingParams() defaults to temperature 1.0 and max_tokens 16, as
vLLM's does.

compile cache: on, under $PAGED_JAX_CACHE/jax_compile_cache (default
~/.cache/paged_jax/jax_compile_cache): JAX's persistent compilation cache, and in its
executables/ folder the compiled step programs, which a second run with the same model,
engine settings and package version loads instead of compiling (a "warm" start; the
summary gives each phase of the start). --no-compile-cache or PAGED_JAX_COMPILE_CACHE=0
turns both off.

exit status: 0 all requests succeeded, 1 some requests failed (see their records),
2 nothing was run (bad flag, unreadable or endless prompts, unwritable output, unusable
model, config.json, tokenizer.json or max_model_len).
{PROG} never prints a traceback for these.
"""


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
    "presence_penalty": Flag("[-2, 2]"),
    "frequency_penalty": Flag("[-2, 2]"),
    "repetition_penalty": Flag("> 0; 1 = off"),
    "include_stop_str_in_output": Flag("keep the stop string / stop token text in the output text"),
    "skip_special_tokens": Flag("keep special tokens in the output text"),
}
SAMPLING_ABSENT: dict[str, str] = {}

# EngineConfig fields on the command line, in --help order.
ENGINE_FLAGS = {
    "block_size": Flag("tokens per KV block"),
    "num_kv_blocks": Flag("None = sized from memory"),
    "kv_cache_memory": Flag("KV budget: bytes (> 1) or a fraction of free device memory (<= 1)"),
    "max_num_seqs": Flag("per step"),
    "max_num_batched_tokens": Flag("token budget per step"),
    "max_model_len": Flag("None = model's"),
    "tensor_parallel_size": Flag(
        "split weights and KV caches over the first N devices (docs/scale_out.md)"
    ),
    "preemption_mode": Flag("recompute (vLLM V1) or swap to host memory"),
    "attention_backend": Flag(
        "auto = Pallas on GPU, reference elsewhere; pallas needs a GPU; mosaic_gpu needs "
        "a Hopper GPU and jax >= 0.12 (mosaic_gpu_interpret: its CPU interpreter)"
    ),
    "dtype": Flag("auto = bf16 on GPU, else f32"),
    "kv_cache_dtype": Flag("auto (= --dtype) or fp8: 2x the bf16 KV blocks in the same memory"),
    "enable_prefix_caching": Flag("turn prefix caching off", name="no-prefix-caching"),
    "async_scheduling": Flag("read each step's tokens before scheduling the next (for debugging)"),
    "scan_layers": Flag(
        "run repeating layers as one scanned body (compile time independent of depth); "
        "auto = on accelerators, off on CPU"
    ),
    # --seed is the per-request SamplingParams.seed.
    "seed": Flag("seed for unseeded requests", name="engine-seed"),
}
ENGINE_ABSENT = {
    "scheduling_policy": "the prompts file carries no request priority",
    "hash_algo": "the prefix-cache hash changes no output",
    "validate": "a debugging switch of the tests (device-side range checks)",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Offline batched generation with paged-jax.",
        epilog=EPILOG,
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--model", help="Hugging Face model directory (default: the demo model)")
    p.add_argument(
        "--cache-dir", help="where the demo model is written (None = ~/.cache/paged_jax)"
    )
    p.add_argument(
        "--prompts", help="JSONL or text prompts file, '-' for stdin (None = built-in set)"
    )
    p.add_argument("--num-prompts", type=int, default=200, help="size of the built-in set")
    p.add_argument("--output", help="write one JSON line per request here")
    p.add_argument("--summary-json", help="write the run's summary as JSON here")
    s = p.add_argument_group("sampling (SamplingParams fields; JSONL lines may override)")
    add_field_flags(s, SamplingParams, SAMPLING_FLAGS, SAMPLING_ABSENT)
    e = p.add_argument_group("engine (EngineConfig fields)")
    add_field_flags(e, EngineConfig, ENGINE_FLAGS, ENGINE_ABSENT)
    e.add_argument(
        "--compile-cache-dir",
        default=None,
        help="JAX compilation cache directory (None = ~/.cache/paged_jax/jax_compile_cache)",
    )
    e.add_argument(
        "--no-compile-cache", action="store_true", help="compile every step program afresh"
    )
    p.add_argument("--no-tqdm", action="store_true", help="no progress bar or load progress")
    return p


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every default and keeps the epilog's line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # A switch (a flag without a value) is off unless given, whichever field value
        # it sets: --no-prefix-caching and --ignore-eos both show False.
        if action.option_strings and action.nargs == 0 and action.default is not argparse.SUPPRESS:
            return f"{action.help} (default: False)"
        return super()._get_help_string(action)


def engine_args_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig keyword arguments of the engine flags (the LLM's keywords too)."""
    engine_args = field_values(args, EngineConfig, ENGINE_FLAGS)
    memory = engine_args["kv_cache_memory"]
    if memory is not None and memory > 1:
        engine_args["kv_cache_memory"] = int(memory)  # bytes; <= 1 is a fraction
    return engine_args


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """The run-wide SamplingParams: one flag per field (ValueError names the field)."""
    return SamplingParams(**field_values(args, SamplingParams, SAMPLING_FLAGS))


@dataclasses.dataclass
class _Plan:
    """Everything checked before the model is loaded."""

    engine_args: dict
    params: SamplingParams
    lines: list[PromptLine]
    model_dir: pathlib.Path
    output: JsonlStream | None
    summary_path: pathlib.Path | None
    compile_cache: bool | str
    cache_use: dict[str, int] = dataclasses.field(default_factory=dict)  # warm-up hits/misses


def _prepare(args: argparse.Namespace) -> _Plan:
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
        {"--prompts": args.prompts, "--output": args.output, "--summary-json": args.summary_json}
    )
    engine_args = engine_args_from_args(args)
    EngineConfig(**engine_args)
    params = sampling_params_from_args(args)
    if args.prompts is not None:
        check_readable(args.prompts)
    elif args.num_prompts < 1:
        raise ValueError(f"--num-prompts={args.num_prompts!r} must be >= 1")
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
    from paged_jax.entrypoints.preflight import check_model

    facts = check_model(model_dir, engine_args)
    if args.prompts:
        # Read after the model check: the line limit derives from max_model_len.
        _, lines = read_prompt_lines(args.prompts, facts.max_model_len)
        if all(line.error for line in lines):
            raise ValueError(f"--prompts={args.prompts!r} holds no valid line: {lines[0].error}")
    else:
        from paged_jax.entrypoints.demo_prompts import builtin_prompts

        texts = builtin_prompts(args.num_prompts)
        lines = [PromptLine(i, i + 1, kind="prompt", value=t) for i, t in enumerate(texts)]
    from pallas_kernels.backend import check_backend

    check_backend(args.attention_backend)
    output = JsonlStream(args.output) if args.output else None
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
    return _Plan(engine_args, params, lines, model_dir, output, summary_path, compile_cache)


def _say(args: argparse.Namespace, message: str, end: str = "\n") -> None:
    if not args.no_tqdm or end == "\n":
        print(message, file=sys.stderr, end=end, flush=True)


def _load(args: argparse.Namespace, plan: _Plan):
    """Builds the LLM with a progress line for loading and for each warm-up program."""
    from paged_jax.llm import LLM

    t0 = time.perf_counter()
    _say(args, f"loading {plan.model_dir} ...")
    llm = LLM(
        str(plan.model_dir), warmup=False, compile_cache=plan.compile_cache, **plan.engine_args
    )
    load_s = time.perf_counter() - t0
    cache = llm.compile_cache_dir or "off"
    _say(args, f"loaded in {load_s:.1f} s; warm-up (compile cache: {cache})")

    def progress(i: int, total: int, name: str, action: str) -> None:
        if not args.no_tqdm:
            line = f"\r  warm-up {i + 1}/{total}: {action} {name}"
            print(line.ljust(64), file=sys.stderr, end="", flush=True)

    from paged_jax.compile_cache import cache_counts

    t0, before = time.perf_counter(), cache_counts()
    llm.engine.warmup(progress)
    warmup_s = time.perf_counter() - t0
    # The compile cache's hits and misses: its step programs loaded and compiled, and
    # JAX's persistent-cache events for whatever else warm-up compiled.
    report = llm.engine.warmup_report
    use = {k: v - before[k] for k, v in cache_counts().items()}
    if report.cache_dir is not None:
        use["hits"] += report.num_loaded
        use["misses"] += report.num_compiled
    plan.cache_use = {f"compile_cache_{k}": v for k, v in use.items()}
    if not args.no_tqdm:
        print(file=sys.stderr)
    _say(args, f"warm-up done in {warmup_s:.1f} s ({_warmup_line(report)})")
    return llm, load_s, warmup_s


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


def _build_requests(llm, plan: _Plan) -> tuple[list[Any], list[SamplingParams], list[PromptLine]]:
    """Prompts and params of the servable lines; bad lines get their .error set."""
    prompts, params, lines = [], [], []
    for line in plan.lines:
        if line.error:
            continue
        try:
            p = params_for(plan.params, line)
            if line.kind == "messages":
                prompt: Any = llm.render_chat(line.value)[0]
            elif line.kind == "prompt_token_ids":
                prompt = {"prompt_token_ids": line.value}
            else:
                prompt = line.value
        except ValueError as err:
            msg = str(err)
            line.error = msg if msg.startswith("line ") else f"line {line.line}: {msg}"
            continue
        prompts.append(prompt)
        params.append(p)
        lines.append(line)
    return prompts, params, lines


def _record(line: PromptLine, out=None, error: str | None = None) -> dict[str, Any]:
    record: dict[str, Any] = {"index": line.index, "id": line.id, "line": line.line}
    if error is not None:
        record["error"] = error
        return record
    record.update(
        request_id=out.request_id,
        prompt=out.prompt,
        prompt_token_ids=out.prompt_token_ids,
        outputs=[
            {
                "index": c.index,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **({"logprobs": c.logprobs} if c.logprobs is not None else {}),
            }
            for c in out.outputs
        ],
        time_to_first_token=out.metrics.time_to_first_token,
        num_cached_tokens=out.metrics.num_cached_tokens,
        error=None,
    )
    return record


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = _prepare(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
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
        if fatal:
            print(f"{PROG}: error: {err}", file=sys.stderr)
            return 2
        raise


def _run(args: argparse.Namespace, plan: _Plan) -> int:
    llm, load_s, warmup_s = _load(args, plan)
    prompts, params, lines = _build_requests(llm, plan)
    bar = None
    if not args.no_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(plan.lines), desc="requests", unit="req", dynamic_ncols=True)
    failed: list[dict[str, Any]] = []
    results = []

    def emit(record: dict[str, Any]) -> None:
        if record.get("error") is not None:
            failed.append({k: record[k] for k in ("index", "id", "line", "error")})
        if plan.output is not None:
            plan.output.write(record)
        if bar is not None:
            bar.update(1)

    start = time.perf_counter()
    num_generated = 0
    for line in plan.lines:
        if line.error:
            emit(_record(line, error=line.error))
    for i, out in llm.generate_iter(prompts, params):
        line = lines[i]
        if out.error is not None:
            error = out.error
            if error.startswith(f"prompts[{i}]: "):
                error = error[len(f"prompts[{i}]: ") :]
            emit(_record(line, error=f"line {line.line}: {error}"))
            continue
        results.append(out)
        num_generated += out.metrics.num_generated_tokens
        if bar is not None:
            rate = num_generated / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"out {rate:.1f} tok/s", refresh=False)
        emit(_record(line, out))
    wall = time.perf_counter() - start
    summary = _summary(llm, plan, results, failed, load_s, warmup_s, wall)
    if bar is not None:
        # The bar's last rate is the summary's figure, from the same counter and clock.
        bar.set_postfix_str(f"out {summary['generated_tokens_per_s']} tok/s", refresh=True)
        bar.close()
    if plan.output is not None:
        plan.output.commit()
    if plan.summary_path is not None:
        write_json_atomic(plan.summary_path, {**summary, "errors": failed})
    print("\n== paged-jax generate summary ==")
    for key, value in summary.items():
        print(f"{key:>24}: {value}")
    for f in failed[:5]:
        print(f"  failed request {f['index']} (id {f['id']!r}): {f['error']}")
    if results and results[0].outputs:
        print(f"\nfirst completion: {results[0].outputs[0].text[:120]!r}")
    return 1 if failed else 0


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
        "preemptions": stats["num_preemptions"],
        **llm.engine.warmup_report.summary(),
        "warmup_compiles": stats["num_compiles"] - stats["num_compiles_after_warmup"],
        "compiles_after_warmup": stats["num_compiles_after_warmup"],
        "steps": stats["num_steps"],
        "median_step_ms": round(stats["step_time_ms"], 2),
        "compile_cache": str(llm.compile_cache_dir) if llm.compile_cache_dir else None,
        **(plan.cache_use if llm.compile_cache_dir else {}),
    }


if __name__ == "__main__":
    sys.exit(main())
