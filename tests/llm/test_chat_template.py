"""Chat templates render exactly as transformers' apply_chat_template renders them."""

from __future__ import annotations

import json

import pytest

from paged_jax.chat_template import ChatTemplate
from paged_jax.entrypoints.demo import build_byte_tokenizer

# A ChatML-style template using what real templates use: loop controls, lstrip/trim of
# block tags, raise_exception, tojson and a special-token variable.
TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {%- if message['role'] == 'system' and loop.index0 > 0 %}{% continue %}{% endif %}
    <|{{ message['role'] }}|>
    {{ message['content'] }}
    {%- if message.get('meta') %} {{ message['meta'] | tojson }}{% endif %}
</s>
{% endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Grüße", "meta": {"k": "ü", "n": [1, 2]}},
        {"role": "assistant", "content": "Hallo"},
        {"role": "system", "content": "skipped by continue"},
        {"role": "user", "content": "Again"},
    ],
]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("chat_tok")
    build_byte_tokenizer().save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path, transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(hf_tokenizer, conversation, add_generation_prompt):
    path, tok = hf_tokenizer
    template = ChatTemplate.from_model_dir(path)
    assert template is not None and template.special_tokens["bos_token"] == "<s>"
    want = tok.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert template.render(conversation, add_generation_prompt=add_generation_prompt) == want


def test_chat_template_jinja_file_wins_and_named_lists_use_default(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "default", "template": "D{{ messages | length }}"}]})
    )
    assert ChatTemplate.from_model_dir(tmp_path).render([{"role": "user", "content": "x"}]) == "D1"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert ChatTemplate.from_model_dir(tmp_path).render([{"role": "user", "content": "x"}]) == "J"
    assert ChatTemplate.from_model_dir(tmp_path / "missing") is None


def test_bad_messages_and_template_errors_are_value_errors():
    template = ChatTemplate(TEMPLATE, {"bos_token": "<s>"})
    with pytest.raises(ValueError, match=r"messages\[0\].role=None must be a non-empty string"):
        template.render([{"content": "no role"}])
    with pytest.raises(ValueError, match=r"messages=\[\] must be a non-empty list"):
        template.render([])
    with pytest.raises(ValueError, match="unknown role tool"):
        template.render([{"role": "tool", "content": "x"}])
