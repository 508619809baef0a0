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


# ------------------------------------------------- a given template keeps special tokens
# Issue 38 item 8: a template passed as chat_template= or --chat-template FILE rendered
# {{ bos_token }} as "" (the prompt silently lost BOS). transformers and vLLM render a
# given template with the tokenizer's special tokens, and tokenize the result without
# adding them again (one BOS, not two).

# Another template using the special tokens, passed instead of the checkpoint's.
OTHER_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
LLM_ENGINE = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256)
CLI_ENGINE = ["--block-size", "4", "--max-num-seqs", "8", "--max-num-batched-tokens", "16"]
CLI_ENGINE += ["--max-model-len", "256", "--no-compile-cache", "--no-tqdm"]
BOS_ID = 1  # "<s>" in the byte tokenizer


@pytest.fixture(scope="module")
def bos_model(model_dir, tmp_path_factory):
    """The tiny Llama with a tokenizer that adds BOS to plain text (as Llama's does) and
    TEMPLATE (which renders {{ bos_token }}) in its tokenizer_config.json; and the
    transformers tokenizer of that directory."""
    import shutil

    transformers = pytest.importorskip("transformers")
    from tokenizers import processors

    path = tmp_path_factory.mktemp("bos_model")
    shutil.copytree(model_dir, path, dirs_exist_ok=True)
    tokenizer = build_byte_tokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path, transformers.AutoTokenizer.from_pretrained(path)


def _hf_prompt(tok, conversation, template):
    """transformers' text and token ids of one conversation rendered with `template`."""
    kwargs = dict(chat_template=template, add_generation_prompt=True)
    text = tok.apply_chat_template(conversation, tokenize=False, **kwargs)
    ids = tok.apply_chat_template(conversation, tokenize=True, return_dict=False, **kwargs)
    return text, list(ids)


def test_transformers_renders_one_bos_for_these_templates(bos_model):
    # The reference the tests below compare with: BOS from the template, none added.
    _, tok = bos_model
    assert tok("x")["input_ids"][0] == BOS_ID  # plain text gets BOS from the tokenizer
    for template in (TEMPLATE, OTHER_TEMPLATE):
        text, ids = _hf_prompt(tok, CONVERSATIONS[0], template)
        assert text.startswith("<s>") and ids.count(BOS_ID) == 1 and ids[0] == BOS_ID


@pytest.mark.parametrize("template", [TEMPLATE, OTHER_TEMPLATE], ids=["own", "other"])
def test_llm_chat_template_argument_renders_special_tokens_as_transformers(bos_model, template):
    from paged_jax.llm import LLM

    path, tok = bos_model
    given = LLM(str(path), warmup=False, chat_template=template, **LLM_ENGINE)
    per_call = LLM(str(path), warmup=False, **LLM_ENGINE)
    for conversation in CONVERSATIONS:
        text, ids = _hf_prompt(tok, conversation, template)
        for prompt in (
            given.render_chat(conversation)[0],
            per_call.render_chat(conversation, chat_template=template)[0],
        ):
            assert prompt["prompt"] == text
            assert prompt["prompt_token_ids"] == ids  # one BOS: the template's


def test_llm_checkpoint_template_renders_one_bos_as_transformers(bos_model):
    from paged_jax.llm import LLM

    path, tok = bos_model
    llm = LLM(str(path), warmup=False, **LLM_ENGINE)
    for conversation in CONVERSATIONS:
        text, ids = _hf_prompt(tok, conversation, TEMPLATE)
        prompt = llm.render_chat(conversation)[0]
        assert (prompt["prompt"], prompt["prompt_token_ids"]) == (text, ids)
        assert prompt["prompt_token_ids"].count(BOS_ID) == 1
    # Plain text still gets the tokenizer's BOS (generate's prompts).
    assert llm.encode("Hi")[0] == BOS_ID


def test_special_tokens_map_json_fills_what_tokenizer_config_lacks(tmp_path):
    # transformers reads special_tokens_map.json too; tokenizer_config.json wins.
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<eos>", "chat_template": "{{ bos_token }}|{{ eos_token }}"})
    )
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": {"content": "<bos>"}, "eos_token": "<other>"})
    )
    template = ChatTemplate.from_model_dir(tmp_path)
    assert template.render([{"role": "user", "content": "x"}]) == "<bos>|<eos>"
    given = ChatTemplate("{{ bos_token }}!").with_model_special_tokens(tmp_path)
    assert given.render([{"role": "user", "content": "x"}]) == "<bos>!"


def test_cli_chat_template_file_renders_special_tokens_as_transformers(bos_model, tmp_path):
    # The checkpoint's own template passed as a file (the LLM tests above cover another
    # template; one CLI run keeps this test to one warm-up).
    from paged_jax.entrypoints.generate_cli import main as generate_main

    path, tok = bos_model
    file = tmp_path / "own.jinja"
    file.write_text(TEMPLATE)
    prompts = tmp_path / "p.jsonl"
    rows = [{"messages": c, "max_tokens": 1} for c in CONVERSATIONS]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    args = ["--model", str(path), "--prompts", str(prompts), "--output", str(out)]
    assert generate_main([*args, "--chat-template", str(file), *CLI_ENGINE]) == 0
    records = sorted(map(json.loads, out.read_text().splitlines()), key=lambda r: r["index"])
    for record, conversation in zip(records, CONVERSATIONS, strict=True):
        text, ids = _hf_prompt(tok, conversation, TEMPLATE)
        assert (record["prompt"], record["prompt_token_ids"]) == (text, ids)
