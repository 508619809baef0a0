"""Chat templates: a checkpoint's Jinja template rendered the way transformers renders it.

    template = ChatTemplate.from_model_dir("path/to/hf_model")    # None when it has none
    text = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)

The template comes from chat_template.jinja, else tokenizer_config.json's
"chat_template" (a string, or a list of named templates: "default" is used). It is
rendered with jinja2's immutable sandbox, trim_blocks and lstrip_blocks, the loop
controls extension, a `tojson` filter and the `raise_exception` / `strftime_now`
helpers, with the tokenizer config's special tokens (bos_token, eos_token, ...) as
variables. Host module: no jax.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


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


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to.

    Args:
        source: the Jinja template text.
        special_tokens: variables such as bos_token / eos_token passed to the template.
        origin: where the template came from (for error messages).
    """

    source: str
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
    origin: str = "<string>"

    @classmethod
    def from_model_dir(cls, path: str | pathlib.Path) -> ChatTemplate | None:
        """The checkpoint's template, or None when it has none.

        Raises:
            ValueError: tokenizer_config.json is not valid JSON (naming the file).
        """
        path = pathlib.Path(path)
        config_file = path / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{config_file} is not valid JSON: {err}") from err
        special = {k: t for k in _SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k)))}
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), special, str(jinja_file))
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str) and template:
            return cls(template, special, f"{config_file} (chat_template)")
        return None

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
            ValueError: bad messages, a template syntax error, or the template's own
                raise_exception (for example a role it does not accept).
        """
        import jinja2

        messages = check_messages(messages)
        try:
            template = _compile(self.source)
            text = template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **extra},
            )
        except jinja2.TemplateError as err:
            raise ValueError(f"chat template from {self.origin} failed: {err}") from err
        if continue_final_message:
            # Cut everything the template appended after the last message's content,
            # so generation continues that message.
            last = messages[-1].get("content")
            if isinstance(last, str) and last and last in text:
                text = text[: text.rindex(last) + len(last)]
        return text


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    # Templates expect unescaped non-ASCII text and Python's key order.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


_COMPILED: dict[str, Any] = {}


def _compile(source: str):
    if source not in _COMPILED:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _COMPILED[source] = env.from_string(source)
    return _COMPILED[source]
