"""A chat template is untrusted code: rendering runs under output-size and time limits.

Hostile templates render in a subprocess with a timeout and a 2 GiB address-space limit,
so a template that escapes the limits fails its test instead of hanging the run or
exhausting the machine's memory.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from paged_jax.chat_template import ChatTemplate, ChatTemplateLimitError

TIME_LIMIT_S = 1.0
# A hang guard, not a speed check: generous for a loaded 2-core machine (the match on the
# error says which limit stopped the render).
SUBPROCESS_TIMEOUT_S = 600.0

_RENDER = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from paged_jax.chat_template import ChatTemplate
template = ChatTemplate(sys.argv[1], time_limit_s=float(sys.argv[2]))
start = time.monotonic()
try:
    text = template.render([{"role": "user", "content": "hi"}])
    out = {"error": None, "length": len(text)}
except Exception as err:
    out = {"error": f"{type(err).__name__}: {err}"}
out["seconds"] = time.monotonic() - start
print(json.dumps(out))
"""


def render_in_subprocess(source: str) -> dict:
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _RENDER, source, str(TIME_LIMIT_S)],
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"rendering did not end within {SUBPROCESS_TIMEOUT_S} s")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


RANGE_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}BODY{% endfor %}{% endfor %}"
BIG = "{% set s = 'a' * 4000000 %}"


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("{{ 'a' * 10**10 }}", r"a repetition would be about 10000000000 characters"),
        ("{{ [1] * 10**10 }}", r"a repetition would be about 50000000000 characters"),
        (RANGE_LOOPS.replace("BODY", ""), r"longer than its time limit of 1.0 s"),
        (RANGE_LOOPS.replace("BODY", "{{ i }}"), r"time limit|over the limit"),
        (RANGE_LOOPS.replace("BODY", "xxxxxxxxxxxxxxxx"), r"time limit|over the limit"),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
            r"over the limit of 4194304",
        ),
        ("{{ 2 ** 10000000 }}", r"a power over 65536 bits is refused"),
        ("{{ 'x'.center(10**10) }}", r"str.center's width would be about 10000000000"),
        ("{{ 'x'.ljust(10**10) }}", r"str.ljust's width"),
        ("{{ '{:>10000000000}'.format(1) }}", r"a format width 10000000000 is over the limit"),
        ("{{ '{:{w}}'.format(1, w=10**10) }}", r"a format spec with nested fields is refused"),
        ("{{ '%10000000000d' % 1 }}", r"a % format width 10000000000 is over the limit"),
        ("{{ '%*d' % (10**10, 1) }}", r"'%\*' width taken from the arguments is refused"),
        ("{{ '%10000000000d'|format(1) }}", r"a % format width"),
        ("{{ 'a'|center(10**10) }}", r"center's width would be about 10000000000"),
        ("{{ ('a\\n' * 1000000)|indent(100) }}", r"indent's result would be about"),
        (BIG + "{{ [s] * 1000 }}", r"a repetition would be about"),
        (BIG + "{{ [s, s, s, s, s]|join }}", r"a join's result would be about"),
        (BIG + "{{ [s, s, s, s, s]|join(attribute='x') }}", r"a join's result would be about"),
        (BIG + "{{ ''.join([s, s, s, s, s]) }}", r"a join's result would be about"),
        (BIG + "{{ s.replace('a', 'aa') }}", r"a replace's result would be about 8000000"),
        (BIG + "{{ s|replace('a', 'aa') }}", r"a replace's result would be about 8000000"),
        (BIG + "{{ (s ~ s) }}", r"over the limit"),
        (BIG + "{{ s + s }}", r"a concatenation would be about 8000000"),
        (BIG + "{{ [s] + [s] }}", r"a concatenation would be about"),
        (
            "{% set x %}{% for i in range(100000) %}{{ 'a' * 1000 }}{% endfor %}{% endset %}",
            r"the template produced over \d+ characters of text",
        ),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", r"recursed too deeply"),
        ("{{ lipsum(10**9) }}", r"UndefinedError: 'lipsum' is undefined"),
        ("{{ range(10)|slice(10**10)|list }}", r"slice's count would be about 10000000000"),
        ("{{ 1 / 0 }}", r"ZeroDivisionError"),
    ],
)
def test_hostile_template_is_stopped_with_a_clear_error(source, match):
    out = render_in_subprocess(source)
    assert out["error"] is not None, out
    assert out["error"].startswith(("ValueError: chat template", "ChatTemplateLimitError")), out
    assert re.search(match, out["error"]), out


def test_limits_leave_real_templates_and_long_prompts_alone():
    long_text = "word " * 500_000  # 2.5 M characters: a long but legitimate prompt
    template = ChatTemplate(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% for i in range(1000) %}{% for j in range(100) %}{% endfor %}{% endfor %}"
        "{{ ('-' * 80) }}{{ messages|length }}{{ '%5d' % 3 }}{{ '{:>8}'.format('x') }}"
    )
    text = template.render([{"role": "user", "content": long_text}])
    assert text.startswith("<|user|>word ") and text.endswith("-" * 80 + "1    3       x")


def test_output_limit_is_per_template():
    template = ChatTemplate("{{ messages[0]['content'] }}", max_output_chars=100)
    assert template.render([{"role": "user", "content": "x" * 100}]) == "x" * 100
    with pytest.raises(ChatTemplateLimitError, match=r"over the limit of 100"):
        template.render([{"role": "user", "content": "x" * 101}])


def test_time_limit_is_per_template():
    template = ChatTemplate(RANGE_LOOPS.replace("BODY", ""), time_limit_s=0.2)
    with pytest.raises(ChatTemplateLimitError, match=r"longer than its time limit of 0.2 s"):
        template.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"max_output_chars": 0}, r"ChatTemplate.max_output_chars=0 must be an int >= 1"),
        ({"time_limit_s": 0}, r"ChatTemplate.time_limit_s=0 must be > 0"),
        ({"time_limit_s": float("nan")}, r"ChatTemplate.time_limit_s=nan must be > 0"),
    ],
)
def test_limits_are_validated(fields, match):
    with pytest.raises(ValueError, match=match):
        ChatTemplate("x", **fields)


MESSAGES = [{"role": "user", "content": "Grüße", "meta": {"b": 1, "a": [1, 2]}}]


@pytest.mark.parametrize(
    ("jinja_kwargs", "python_kwargs"),
    [
        ("", {}),
        ("indent=2", {"indent": 2}),
        ("indent='\\t'", {"indent": "\t"}),
        ("separators=[',', ':']", {"separators": (",", ":")}),
        ("sort_keys=true", {"sort_keys": True}),
        ("ensure_ascii=true", {"ensure_ascii": True}),
        (
            "indent=4, separators=(',', ': '), sort_keys=true, ensure_ascii=false",
            {"indent": 4, "separators": (",", ": "), "sort_keys": True},
        ),
    ],
)
def test_tojson_takes_transformers_keyword_arguments(jinja_kwargs, python_kwargs):
    template = ChatTemplate("{{ messages[0]['meta'] | tojson(" + jinja_kwargs + ") }}")
    expected = json.dumps(MESSAGES[0]["meta"], **{"ensure_ascii": False, **python_kwargs})
    assert template.render(MESSAGES) == expected
    assert ChatTemplate("{{ messages[0]['content'] | tojson }}").render(MESSAGES) == '"Grüße"'


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ("default=1", r"tojson got 'default'; it accepts only ensure_ascii, indent, separators"),
        ("cls=1", r"tojson got 'cls'"),
        ("check_circular=false, allow_nan=false", r"tojson got 'allow_nan', 'check_circular'"),
        ("indent=10**9", r"tojson indent=1000000000 must be None, an int or a string of 0..64"),
        ("indent='x' * 100", r"tojson indent='x+' must be"),
        ("separators=[1, 2]", r"tojson separators=\[1, 2\] must be two short strings"),
        ("sort_keys='yes'", r"tojson sort_keys='yes' must be true or false"),
    ],
)
def test_tojson_refuses_other_arguments_clearly(kwargs, match):
    template = ChatTemplate("{{ messages[0]['meta'] | tojson(" + kwargs + ") }}")
    with pytest.raises(ValueError, match=match):
        template.render(MESSAGES)


def test_deeply_nested_tokenizer_config_names_the_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not valid: its JSON is nested"):
        ChatTemplate.from_model_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"tokenizer_config.json must hold a JSON object"):
        ChatTemplate.from_model_dir(tmp_path)
