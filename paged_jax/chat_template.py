"""Chat templates: a checkpoint's Jinja template rendered the way transformers renders it.

    template = ChatTemplate.from_model_dir("path/to/hf_model")    # None when it has none
    text = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)

The template comes from chat_template.jinja, else tokenizer_config.json's
"chat_template" (a string, or a list of named templates: "default" is used). It is
rendered with jinja2's immutable sandbox, trim_blocks and lstrip_blocks, the loop
controls extension, a `tojson` filter and the `raise_exception` / `strftime_now`
helpers, with the checkpoint's special tokens (bos_token, eos_token, ...) as
variables; a template given for a checkpoint sees them too
(`ChatTemplate.with_model_special_tokens`), as transformers renders it. A template is untrusted code, so each render also runs under a size and a
time budget (see `RenderBudget`). Host module: no jax.
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
import functools
import inspect
import json
import math
import pathlib
import re
import string
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from paged_jax.constants import is_int, is_number

# transformers' named special tokens: the variables every template sees.
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# A rendered prompt longer than this is not a prompt (about a million tokens of text).
DEFAULT_MAX_OUTPUT_CHARS = 4 * 2**20
# Real templates render in milliseconds; a template still running after this never ends.
DEFAULT_TIME_LIMIT_S = 5.0
# Larger ints than this (about 20,000 digits) are never needed by a template.
MAX_INT_BITS = 1 << 16
# tojson's indent (an int or a string): wider indents only multiply the output.
MAX_TOJSON_INDENT = 64
# A tokenizer_config.json or chat_template.jinja larger than this is not one.
MAX_TEMPLATE_FILE_BYTES = 64 * 2**20
# Text a render may produce in all (output, set blocks, macros), as a multiple of the
# output limit: captured text is counted again when it is emitted.
_WORK_FACTOR = 4

# Filters inserted around every for-loop iterable and every `~` concatenation.
_ITER_FILTER = "paged_jax_budget_iter"
_VALUE_FILTER = "paged_jax_budget_value"
# tojson's keyword arguments, as transformers' chat-template tojson accepts them.
TOJSON_ARGUMENTS = ("ensure_ascii", "indent", "separators", "sort_keys")


class ChatTemplateLimitError(ValueError):
    """A template exceeded its render budget (output size, operand size or time)."""


class RenderBudget:
    """The limits of one render, checked by the sandbox while the template runs.

    Jinja cannot be interrupted from outside, so the sandbox checks from inside: every
    attribute or item access, call, filter, intercepted operator (``*``, ``**``, ``+``,
    ``%``) and for-loop item checks the clock, and every operation that can multiply
    text (repetition, padding, format widths, joins, replaces) is sized before it runs.

    Args:
        max_chars: the longest string or container (estimated as text) a render may
            build, and the longest output.
        time_limit_s: wall time a render may take; None: no limit.
    """

    def __init__(self, max_chars: int, time_limit_s: float | None):
        self.max_chars = max_chars
        self.time_limit_s = time_limit_s
        self.deadline = math.inf if time_limit_s is None else time.monotonic() + time_limit_s
        self.produced = 0

    def tick(self) -> None:
        """Raises ChatTemplateLimitError once the time limit has passed."""
        if time.monotonic() > self.deadline:
            raise ChatTemplateLimitError(
                f"rendering took longer than its time limit of {self.time_limit_s} s "
                "(an endless or huge loop?)"
            )

    def check_size(self, size: int, what: str) -> None:
        """Raises ChatTemplateLimitError when `what` would be longer than max_chars."""
        if size > self.max_chars:
            raise ChatTemplateLimitError(
                f"{what} would be about {size} characters, over the limit of {self.max_chars}"
            )

    def check_value(self, value: Any, what: str) -> Any:
        """Checks the estimated text size of `value` and returns it unchanged."""
        self.check_size(estimated_size(value, self.max_chars), what)
        return value

    def count_output(self, value: Any) -> Any:
        """Counts one emitted value toward the render's total and returns it unchanged."""
        size = estimated_size(value, self.max_chars)
        self.check_size(size, "an output value")
        self.produced += size
        if self.produced > _WORK_FACTOR * self.max_chars:
            raise ChatTemplateLimitError(
                f"the template produced over {self.produced} characters of text (set blocks "
                f"and macros included), over {_WORK_FACTOR} x the limit of {self.max_chars}"
            )
        return value


_ACTIVE_BUDGET: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar(
    "paged_jax_chat_template_budget", default=None
)


def active_budget() -> RenderBudget:
    """The budget of the render running in this context.

    Outside a render (jinja folding a constant at compile time) a fresh untimed budget
    still checks sizes.
    """
    return _ACTIVE_BUDGET.get() or RenderBudget(DEFAULT_MAX_OUTPUT_CHARS, None)


def estimated_size(value: Any, limit: int) -> int:
    """Roughly len(str(value)), walking containers; stops counting once past `limit`."""
    total = 0
    stack = [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str | bytes | bytearray):
            total += len(item)
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 1
        elif isinstance(item, float):
            total += 24
        elif isinstance(item, Mapping):
            total += 2 + 4 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset | range):
            total += 2 + 2 * len(item)
            if not isinstance(item, range):
                stack.extend(item)
        else:
            total += 16
    return total


def _token_text(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def check_messages(messages: Any, where: str = "messages") -> list[dict[str, Any]]:
    """Validates one conversation: a non-empty list of {"role": str, "content": ...} dicts.

    Raises:
        ValueError: naming the message index and what is wrong with it.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"{where}={messages!r} must be a non-empty list of message dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"{where}[{i}]={m!r} must be a dict with 'role' and 'content'")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"{where}[{i}].role={m.get('role')!r} must be a non-empty string")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ValueError(
                f"{where}[{i}].content={content!r} must be a string or a list of content parts"
            )
        out.append(dict(m))
    return out


def _read_template_file(file: pathlib.Path) -> str:
    size = file.stat().st_size
    if size > MAX_TEMPLATE_FILE_BYTES:
        raise ValueError(f"{file} is {size} bytes, over the {MAX_TEMPLATE_FILE_BYTES} limit")
    return file.read_text(encoding="utf-8")


def _read_json_object(file: pathlib.Path) -> dict[str, Any]:
    """The JSON object in `file`; {} when there is no such file.

    Raises:
        ValueError: the file is not a JSON object (naming it).
    """
    if not file.is_file():
        return {}
    try:
        value = json.loads(_read_template_file(file))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from err
    except RecursionError as err:
        raise ValueError(f"{file} is not valid: its JSON is nested too deeply") from err
    if not isinstance(value, dict):
        raise ValueError(f"{file} must hold a JSON object")
    return value


def model_special_tokens(
    path: str | pathlib.Path, config: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """The special tokens a chat template sees as variables, read as transformers reads them.

    tokenizer_config.json's bos_token, eos_token, ... (a string or {"content": ...}),
    and for the ones it lacks, special_tokens_map.json's. A checkpoint with neither
    file has none (a template's {{ bos_token }} then renders "", as in transformers).

    Args:
        path: the checkpoint directory.
        config: tokenizer_config.json's object when the caller has read it already.

    Raises:
        ValueError: one of the files is not a JSON object (naming it).
    """
    path = pathlib.Path(path)
    if config is None:
        config = _read_json_object(path / "tokenizer_config.json")
    legacy = _read_json_object(path / "special_tokens_map.json")
    tokens = {}
    for key in _SPECIAL_TOKEN_KEYS:
        text = _token_text(config.get(key)) or _token_text(legacy.get(key))
        if text:
            tokens[key] = text
    return tokens


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to.

    Args:
        source: the Jinja template text.
        special_tokens: variables such as bos_token / eos_token passed to the template.
        origin: where the template came from (for error messages).
        max_output_chars: the longest prompt, and the longest string or container
            the template may build while rendering it.
        time_limit_s: wall time one render may take.
    """

    source: str
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
    origin: str = "<string>"
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS
    time_limit_s: float = DEFAULT_TIME_LIMIT_S

    def __post_init__(self):
        if not is_int(self.max_output_chars) or self.max_output_chars < 1:
            raise ValueError(
                f"ChatTemplate.max_output_chars={self.max_output_chars!r} must be an int >= 1"
            )
        if not is_number(self.time_limit_s) or not self.time_limit_s > 0:
            raise ValueError(f"ChatTemplate.time_limit_s={self.time_limit_s!r} must be > 0")

    @classmethod
    def from_model_dir(cls, path: str | pathlib.Path) -> ChatTemplate | None:
        """The checkpoint's template, or None when it has none.

        Raises:
            ValueError: tokenizer_config.json is not valid JSON (naming the file).
        """
        path = pathlib.Path(path)
        config_file = path / "tokenizer_config.json"
        config = _read_json_object(config_file)
        special = model_special_tokens(path, config)
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(_read_template_file(jinja_file), special, str(jinja_file))
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str) and template:
            return cls(template, special, f"{config_file} (chat_template)")
        return None

    def with_model_special_tokens(self, path: str | pathlib.Path) -> ChatTemplate:
        """This template rendering the special tokens of the checkpoint at `path`.

        A template given for a checkpoint (LLM's chat_template=, the CLI's
        --chat-template FILE) renders {{ bos_token }} as the checkpoint's BOS, as
        transformers' apply_chat_template(chat_template=...) and vLLM do; tokens this
        template already holds win.

        Raises:
            ValueError: the checkpoint's tokenizer_config.json or special_tokens_map.json
                is not a JSON object (naming it).
        """
        tokens = {**model_special_tokens(path), **self.special_tokens}
        return dataclasses.replace(self, special_tokens=tokens)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """The prompt text of one conversation.

        Raises:
            ValueError: bad messages, a template syntax error, the template's own
                raise_exception (for example a role it does not accept), any error the
                template runs into, or a ChatTemplateLimitError when it builds text
                past max_output_chars or runs past time_limit_s.
        """
        messages = check_messages(messages)
        budget = RenderBudget(self.max_output_chars, self.time_limit_s)
        token = _ACTIVE_BUDGET.set(budget)
        try:
            template = _compile(self.source)
            pieces = []
            length = 0
            for piece in template.generate(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **extra},
            ):
                length += len(piece)
                budget.check_size(length, "the rendered prompt")
                budget.tick()
                pieces.append(piece)
            text = "".join(pieces)
        except ChatTemplateLimitError as err:
            raise ChatTemplateLimitError(f"chat template from {self.origin}: {err}") from err
        except RecursionError as err:
            raise ValueError(
                f"chat template from {self.origin} failed: it recursed too deeply"
            ) from err
        except Exception as err:  # a template is code: any error it hits is bad input
            raise ValueError(f"chat template from {self.origin} failed: {_describe(err)}") from err
        finally:
            _ACTIVE_BUDGET.reset(token)
        if continue_final_message:
            # Cut everything the template appended after the last message's content,
            # so generation continues that message.
            last = messages[-1].get("content")
            if isinstance(last, str) and last and last in text:
                text = text[: text.rindex(last) + len(last)]
        return text


def _describe(err: Exception) -> str:
    import jinja2

    if isinstance(err, jinja2.TemplateError) and not isinstance(err, jinja2.UndefinedError):
        return str(err)
    return f"{type(err).__name__}: {err}"


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(value: Any, *args: Any, **kwargs: Any) -> str:
    """transformers' tojson: json.dumps with ensure_ascii=False and Python's key order.

    Only transformers' keyword arguments pass (ensure_ascii, indent, separators,
    sort_keys), each checked, so a template cannot reach json.dumps' others (cls, default).
    """
    if args:
        raise TypeError(f"tojson takes keyword arguments only ({', '.join(TOJSON_ARGUMENTS)})")
    unknown = sorted(set(kwargs) - set(TOJSON_ARGUMENTS))
    if unknown:
        raise TypeError(
            f"tojson got {', '.join(map(repr, unknown))}; it accepts only "
            f"{', '.join(TOJSON_ARGUMENTS)} (as transformers' tojson)"
        )
    ensure_ascii = kwargs.get("ensure_ascii", False)
    indent = kwargs.get("indent")
    separators = kwargs.get("separators")
    sort_keys = kwargs.get("sort_keys", False)
    for name, flag in (("ensure_ascii", ensure_ascii), ("sort_keys", sort_keys)):
        if not isinstance(flag, bool):
            raise TypeError(f"tojson {name}={flag!r} must be true or false")
    width = len(indent) if isinstance(indent, str) else indent
    if indent is not None and not (is_int(width) and 0 <= width <= MAX_TOJSON_INDENT):
        raise TypeError(
            f"tojson indent={indent!r} must be None, an int or a string of 0..{MAX_TOJSON_INDENT}"
        )
    if separators is not None and not (
        isinstance(separators, list | tuple)
        and len(separators) == 2
        and all(isinstance(s, str) and len(s) <= MAX_TOJSON_INDENT for s in separators)
    ):
        raise TypeError(f"tojson separators={separators!r} must be two short strings")
    budget = active_budget()
    budget.check_value(value, "tojson's input")
    text = json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=None if separators is None else tuple(separators),
        sort_keys=sort_keys,
    )
    budget.check_size(len(text), "tojson's output")
    return text


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


# ----------------------------------------------------------------------------- sizing

_SEQUENCE_TYPES = (str, bytes, list, tuple)
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


def _check_number_text(text: str, what: str, budget: RenderBudget) -> None:
    if len(text) > 9 or int(text) > budget.max_chars:
        raise ChatTemplateLimitError(f"{what} {text[:20]} is over the limit of {budget.max_chars}")


def _check_percent_format(fmt: str, args: Any, budget: RenderBudget) -> None:
    """Sizes ``fmt % args``: field widths and precisions, then the arguments' text."""
    for match in _PERCENT_SPEC.finditer(fmt):
        for part in match.groups():
            if part == "*":
                raise ChatTemplateLimitError("a '%*' width taken from the arguments is refused")
            if part is not None:
                _check_number_text(part, "a % format width", budget)
    budget.check_size(len(fmt) + estimated_size(args, budget.max_chars), "a % format result")


def _check_format_method(fmt: str, args: Any, kwargs: Any, budget: RenderBudget) -> None:
    """Sizes ``fmt.format(*args, **kwargs)``: every width in every field spec."""
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is None or not spec:
            continue
        if "{" in spec:
            raise ChatTemplateLimitError("a format spec with nested fields is refused")
        for digits in _DIGITS.findall(spec):
            _check_number_text(digits, "a format width", budget)
    size = len(fmt) + estimated_size(args, budget.max_chars)
    budget.check_size(size + estimated_size(kwargs, budget.max_chars), "a format result")


def _check_binop(operator: str, left: Any, right: Any, budget: RenderBudget) -> None:
    limit = budget.max_chars
    if operator == "*":
        if isinstance(left, _SEQUENCE_TYPES) and is_int(right):
            budget.check_size(estimated_size(left, limit) * max(right, 0), "a repetition")
        elif isinstance(right, _SEQUENCE_TYPES) and is_int(left):
            budget.check_size(estimated_size(right, limit) * max(left, 0), "a repetition")
        elif (
            is_int(left) and is_int(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS
        ):
            raise ChatTemplateLimitError(f"a product of ints over {MAX_INT_BITS} bits is refused")
    elif operator == "**":
        big = is_int(left) and is_int(right) and abs(left) > 1
        if big and right > 0 and abs(left).bit_length() * right > MAX_INT_BITS:
            raise ChatTemplateLimitError(f"a power over {MAX_INT_BITS} bits is refused")
    elif operator == "+":
        if isinstance(left, _SEQUENCE_TYPES) and isinstance(right, _SEQUENCE_TYPES):
            size = estimated_size(left, limit) + estimated_size(right, limit)
            budget.check_size(size, "a concatenation")
    elif operator == "%" and isinstance(left, str):
        _check_percent_format(left, right, budget)


# The str methods whose result can be much longer than the string and their arguments.
_GROWING_STR_METHODS = frozenset(
    ("center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join")
)


def _check_str_method(method: Any, args: tuple, kwargs: dict, budget: RenderBudget) -> tuple:
    """Sizes the str methods that can grow text; returns args (a join's iterable listed)."""
    text = method.__self__
    name = method.__name__
    if name not in _GROWING_STR_METHODS:
        return args
    call = inspect.signature(getattr(str, name)).bind(text, *args, **kwargs).arguments
    if name in ("center", "ljust", "rjust", "zfill"):
        width = call.get("width")
        if is_int(width):
            budget.check_size(width, f"str.{name}'s width")
    elif name == "expandtabs":
        tabsize = call.get("tabsize", 8)
        if is_int(tabsize):
            budget.check_size(len(text) + text.count("\t") * tabsize, "str.expandtabs' result")
    elif name == "replace":
        _check_replace(text, call.get("old"), call.get("new"), call.get("count", -1), budget)
    elif name == "join":
        items = list(call.get("iterable", ()))
        _check_join(items, text, budget)
        return (items,)
    return args


def _check_replace(text: Any, old: Any, new: Any, count: Any, budget: RenderBudget) -> None:
    if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str)):
        return
    hits = text.count(old) if old else len(text) + 1
    if is_int(count) and count >= 0:
        hits = min(hits, count)
    budget.check_size(len(text) + hits * max(len(new) - len(old), 0), "a replace's result")


def _check_join(items: Sequence[Any], sep: Any, budget: RenderBudget) -> None:
    size = estimated_size(list(items), budget.max_chars)
    budget.check_size(size + len(str(sep)) * len(items), "a join's result")


def _iterate_with_budget(iterable: Iterable[Any]) -> Iterator[Any]:
    """A for loop's items, checking the clock at each (nested loops over ranges)."""
    budget = active_budget()
    for item in iterable:
        budget.tick()
        yield item


def _bind_filter_arguments(fn: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """(leading argument jinja passes, the filter's own arguments by name).

    jinja's async-capable filters (join, slice, ...) take an eval context their
    signature does not show; it is split off here.
    """
    signature = inspect.signature(fn)
    first = next(iter(signature.parameters), None)
    hidden = getattr(fn, "jinja_pass_arg", None) is not None and first not in (
        "eval_ctx",
        "context",
        "environment",
    )
    lead = args[:1] if hidden else ()
    return lead, dict(signature.bind(*args[len(lead) :], **kwargs).arguments)


def _check_filter_call(name: str, fn: Callable, args: tuple, kwargs: dict) -> tuple:
    """Sizes the filters whose output can outgrow their input; returns the arguments."""
    budget = active_budget()
    lead, call = _bind_filter_arguments(fn, args, kwargs)
    value = call.get("value", call.get("s"))
    if name == "center" and is_int(call.get("width")):
        budget.check_size(call["width"], "center's width")
    elif name == "indent":
        width = call.get("width", 4)
        width = len(width) if isinstance(width, str) else width if is_int(width) else 0
        text = budget.check_value(value, "indent's input")
        lines = str(text).count("\n") + 1
        budget.check_size(estimated_size(text, budget.max_chars) + lines * width, "indent's result")
    elif name == "wordwrap":
        width = call.get("width", 79)
        wrap = call.get("wrapstring") or "\n"
        size = estimated_size(value, budget.max_chars)
        if is_int(width) and width > 0:
            budget.check_size(size + (size // width + 1) * len(str(wrap)), "wordwrap's result")
    elif name == "replace":
        _check_replace(value, call.get("old"), call.get("new"), call.get("count"), budget)
    elif name == "format" and isinstance(value, str):
        _check_percent_format(value, (call.get("args"), call.get("kwargs")), budget)
    elif name == "join":
        items = list(value) if value is not None else []
        _check_join(items, call.get("d", ""), budget)
        call["value"] = items
        return (*lead, *call.values()), {}
    elif name in ("batch", "slice"):
        count = call.get("linecount", call.get("slices"))
        if is_int(count):
            budget.check_size(count, f"{name}'s count")
    return args, kwargs


def _limited_filter(name: str, fn: Callable) -> Callable:
    """`fn` with the budget's clock and size checks around it (jinja markers kept)."""
    sized = name in ("center", "indent", "wordwrap", "replace", "format", "join", "batch", "slice")

    @functools.wraps(fn)
    def limited(*args: Any, **kwargs: Any) -> Any:
        budget = active_budget()
        budget.tick()
        if sized:
            args, kwargs = _check_filter_call(name, fn, args, kwargs)
        result = fn(*args, **kwargs)
        if isinstance(result, str | list | tuple | dict):
            budget.check_value(result, f"the {name} filter's result")
        return result

    return limited


# ---------------------------------------------------------------------------- sandbox


@functools.cache
def _environment() -> Any:
    """The shared sandbox: jinja2's immutable sandbox, limited by the active RenderBudget."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class LimitedSandbox(ImmutableSandboxedEnvironment):
        """The immutable sandbox with every growth and every step charged to the budget."""

        intercepted_binops = frozenset(("*", "**", "+", "%"))

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            budget = active_budget()
            budget.tick()
            _check_binop(operator, left, right, budget)
            return budget.check_value(
                super().call_binop(context, operator, left, right), f"a {operator!r} result"
            )

        def getattr(self, obj: Any, attribute: str) -> Any:
            active_budget().tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            active_budget().tick()
            return super().getitem(obj, argument)

        def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            fmt = value.__self__

            @functools.wraps(wrapped)
            def limited_format(*args: Any, **kwargs: Any) -> str:
                budget = active_budget()
                mapping = args[0] if value.__name__ == "format_map" and args else kwargs
                _check_format_method(fmt, args, mapping, budget)
                return budget.check_value(wrapped(*args, **kwargs), "a format result")

            return limited_format

        def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
            budget = active_budget()
            budget.tick()
            if isinstance(getattr(obj, "__self__", None), str) and callable(obj):
                args = _check_str_method(obj, args, kwargs, budget)
            result = super().call(context, obj, *args, **kwargs)
            if isinstance(result, str | list | tuple | dict):
                budget.check_value(result, "a call's result")
            return result

    env = LimitedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
        finalize=lambda value: active_budget().count_output(value),
        optimized=False,  # nothing a template computes runs at compile time, unbudgeted
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _limited_filter(name, fn) for name, fn in env.filters.items()}
    env.filters[_ITER_FILTER] = _iterate_with_budget
    env.filters[_VALUE_FILTER] = lambda value: active_budget().check_value(value, "a '~' operand")
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    # lorem ipsum of any length, on request: of no use to a chat template.
    env.globals.pop("lipsum", None)
    return env


def _budget_nodes(tree: Any) -> Any:
    """Wraps every for-loop iterable and every `~` (and its operands) in budget filters.

    A loop body that only loops makes no call the sandbox sees, and `~` builds text
    without an operator hook; the filters give both a clock and a size check.
    """
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    def budget_filter(node: Any, name: str) -> Any:
        return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)

    class Budgeted(NodeTransformer):
        def visit_For(self, node: Any) -> Any:
            self.generic_visit(node)
            node.iter = budget_filter(node.iter, _ITER_FILTER)
            return node

        def visit_Concat(self, node: Any) -> Any:
            self.generic_visit(node)
            node.nodes = [budget_filter(part, _VALUE_FILTER) for part in node.nodes]
            return budget_filter(node, _VALUE_FILTER)

    return Budgeted().visit(tree)


@functools.lru_cache(maxsize=64)
def _compile(source: str) -> Any:
    env = _environment()
    return env.from_string(_budget_nodes(env.parse(source)))
