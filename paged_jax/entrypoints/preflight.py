"""The CLI's model preflight: everything about a checkpoint that would doom the run, found
before the model loads, each as one ValueError naming the file (and the field).

config.json (via models.loader.check_model_dir: fields, architecture, weight headers),
tokenizer.json, the chat template (the checkpoint's, or a --chat-template file),
max_model_len against max_position_embeddings, the host memory the buffers sized by
max_model_len need, and a run-wide structured-outputs constraint (compiled with the
checkpoint's tokenizer, as the engine will compile it). Host module: imports no jax itself (the loader, imported when a
check runs, does).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

from paged_jax.chat_template import MAX_TEMPLATE_FILE_BYTES, ChatTemplate
from paged_jax.config import EngineConfig
from pallas_kernels.roofline import INT32_BYTES  # jax-free, as this module must stay

# The engine keeps up to two block tables per sequence (full and sliding-window groups).
MAX_KV_CACHE_GROUPS = 2


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the preflight learnt about the checkpoint.

    Attributes:
        max_model_len: the run's context length (the flag, or the model's
            max_position_embeddings).
        max_position_embeddings: the model's limit, from config.json.
        tokenizer: the parsed tokenizer.json (a ``tokenizers.Tokenizer``), or None.
        chat_template: the chat template the run uses (given, else the checkpoint's), or
            None.
        vocab_size: the model's vocabulary (its logits' width), from config.json.
        eos_token_ids: the model's end-of-sequence ids (config.json and
            generation_config.json).
    """

    max_model_len: int
    max_position_embeddings: int
    tokenizer: Any = None
    chat_template: ChatTemplate | None = None
    vocab_size: int | None = None
    eos_token_ids: tuple[int, ...] = ()


def check_model(
    model_dir: pathlib.Path,
    engine_args: dict[str, Any],
    *,
    chat_template: ChatTemplate | None = None,
) -> ModelFacts:
    """Checks that `model_dir` can be loaded and run with `engine_args`, without loading it.

    Args:
        model_dir: a Hugging Face model directory holding config.json.
        engine_args: the EngineConfig keyword arguments of the run.
        chat_template: a template given for the run (then the checkpoint's is not read,
            as LLM(chat_template=...) does not read it).

    Raises:
        ValueError: one line naming the file (and the field) that dooms the run.
    """
    config_file = model_dir / "config.json"
    config = _model_config(
        model_dir,
        config_file,
        engine_args.get("quantization"),
        bool(engine_args.get("quantize_embeddings", False)),
    )
    tokenizer = _check_tokenizer(model_dir)
    if chat_template is None:
        chat_template = _check_chat_template(model_dir)
    else:  # {{ bos_token }} is the checkpoint's, as transformers renders a given template
        chat_template = chat_template.with_model_special_tokens(model_dir)
    limit = int(config.max_position_embeddings)
    requested = engine_args.get("max_model_len")
    if requested is not None and requested > limit:
        raise ValueError(
            f"--max-model-len={requested} must be <= max_position_embeddings={limit} "
            f"({config_file})"
        )
    max_model_len = limit if requested is None else requested
    engine = dataclasses.replace(EngineConfig(**engine_args), max_model_len=max_model_len)
    need, free = max_model_len_bytes(engine), available_host_memory()
    if free is not None and need > free:
        where = (
            f"max_position_embeddings={limit} in {config_file} makes max_model_len={limit}"
            if requested is None
            else f"--max-model-len={requested}"
        )
        raise ValueError(
            f"{where}: the buffers sized by it (token ids, penalty history and block tables "
            f"of max_num_seqs={engine.max_num_seqs} sequences) need {_gib(need)}, more than "
            f"the {_gib(free)} of free host memory; set --max-model-len to a smaller value "
            "(or lower --max-num-seqs)"
        )
    return ModelFacts(
        max_model_len,
        limit,
        tokenizer,
        chat_template,
        vocab_size=int(config.vocab_size),
        eos_token_ids=tuple(int(t) for t in (config.eos_token_ids or ())),
    )


def check_constraint(constraint: Any, facts: ModelFacts, flag: str) -> None:
    """Compiles the run's constraint as the engine will, without the model.

    The engine compiles a request's constraint when the request is submitted, after the
    model has loaded and warmed up; a run-wide one that cannot compile would fail every
    line then. Compiled here with the checkpoint's tokenizer, vocabulary and EOS ids, it
    fails the run before loading. (The engine compiles it again: the grammar cache is
    the engine's.)

    Args:
        constraint: the run's StructuredOutputsParams.
        facts: check_model's findings (the tokenizer, vocab_size, eos_token_ids).
        flag: the flag and its value, as errors name it (``--regex='a(b'``).

    Raises:
        ValueError: one line naming `flag`: no tokenizer.json, or the grammar library's
            reason.
    """
    if facts.tokenizer is None:
        raise ValueError(
            f"{flag} needs the checkpoint's tokenizer.json (structured outputs are "
            "compiled against its vocabulary); the model directory has none"
        )
    from paged_jax.structured_outputs import GrammarCompiler

    try:
        compiler = GrammarCompiler(
            facts.tokenizer,
            eos_token_ids=facts.eos_token_ids,
            vocab_size=facts.vocab_size,
            num_threads=1,
        )
        compiler.compile(constraint)
    except ValueError as err:
        raise ValueError(f"{flag}: {' '.join(str(err).split())}") from None
    except RecursionError:
        raise ValueError(f"{flag}: the constraint is nested too deeply to compile") from None


def _model_config(
    model_dir: pathlib.Path,
    config_file: pathlib.Path,
    quantization: str | None = None,
    quantize_embeddings: bool = False,
) -> Any:
    """The checkpoint's ModelConfig after the loader's checks (weight headers included;
    a quantization_config and --quantization checked together)."""
    from paged_jax.models.loader import check_model_dir

    try:
        return check_model_dir(
            model_dir, quantization=quantization, quantize_embeddings=quantize_embeddings
        )
    except (ValueError, FileNotFoundError) as err:
        if str(model_dir) in str(err):
            raise
        raise ValueError(f"{config_file}: {err}") from err
    except RecursionError as err:
        raise ValueError(f"{config_file} is nested too deeply to parse") from err
    except Exception as err:  # a value the family's parser did not expect
        raise ValueError(f"{config_file} cannot be used: {type(err).__name__}: {err}") from err


def _check_tokenizer(model_dir: pathlib.Path) -> Any:
    """The parsed tokenizer.json, or None without one (LLM loads it when present; a broken
    one would fail there)."""
    file = model_dir / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"{file} is not a usable tokenizer: {err}") from err


def _check_chat_template(model_dir: pathlib.Path) -> ChatTemplate | None:
    """The checkpoint's template, once tokenizer_config.json / chat_template.jinja parse
    (LLM reads them when it loads)."""
    try:
        return ChatTemplate.from_model_dir(model_dir)
    except ValueError:
        raise
    except Exception as err:  # a template that does not compile, an unreadable file
        raise ValueError(
            f"the chat template of {model_dir} cannot be used: {type(err).__name__}: {err}"
        ) from err


def read_chat_template(path: str) -> ChatTemplate:
    """The --chat-template file as a template, checked for syntax by rendering one message.

    Raises:
        ValueError: the file cannot be read, is empty or too large, or does not parse
            (naming the flag). Errors of the template's own logic (a role it refuses)
            are left to each "messages" line.
    """
    flag = f"--chat-template={path!r}"
    try:
        size = os.stat(path).st_size
        if size > MAX_TEMPLATE_FILE_BYTES:
            raise ValueError(f"{flag} is {size} bytes, over the {MAX_TEMPLATE_FILE_BYTES} limit")
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{flag} cannot be read: {err}") from err
    if not source.strip():
        raise ValueError(f"{flag} is empty; expected a Jinja chat template")
    template = ChatTemplate(source, origin=path)
    import jinja2

    try:
        template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    except ValueError as err:
        if isinstance(err.__cause__, jinja2.TemplateSyntaxError):
            raise ValueError(f"{flag}: the template has a syntax error: {err}") from err
    return template


def max_model_len_bytes(config: EngineConfig) -> int:
    """Bytes of the buffers whose size grows with max_model_len (config resolved).

    The input batch's token ids (one row per sequence), the runner's zero penalty history
    (one per sequence bucket) and the block tables; the KV cache is sized separately.
    """
    rows = config.max_num_seqs + sum(config.seq_buckets)
    tables = MAX_KV_CACHE_GROUPS * config.max_num_seqs * config.max_blocks_per_seq
    return INT32_BYTES * (rows * config.max_model_len + tables)


def available_host_memory() -> int | None:
    """Bytes of host memory available to a new allocation (Linux MemAvailable), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"
