"""Grammar compiler and matchers on a trained byte-level BPE (tokens span several characters).

Decoding is simulated with no model: each step picks a random token the matcher's bitmask
allows (seeded numpy), so only the constraint can make the output valid. The pick takes
EOS with probability 1/2 whenever the mask allows it (a model that likes to stop), else a
uniform allowed token.
"""

from __future__ import annotations

import ast
import json
import re

import numpy as np
import pytest

from paged_jax.structured_outputs import (
    GrammarCompiler,
    StructuredOutputsParams,
    allocate_bitmask,
    apply_bitmask_reference,
)
from paged_jax.testing.bpe_tokenizer import EOS_TOKEN_ID, structured_corpus, train_byte_level_bpe

pytest.importorskip("llguidance", reason="needs the grammar library (pip install '.[structured]')")

EOS = EOS_TOKEN_ID
# The model's vocabulary is wider than the tokenizer's (padded embeddings), and not a
# multiple of 32: the extra ids and the last word's spare bits must never be allowed.
EXTRA_IDS = 37

NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "score": {"type": "number"},
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 4},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "pets": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "kind": {"enum": ["cat", "dog"]},
                            "age": {"type": "integer", "minimum": 0},
                        },
                        "required": ["kind"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "kind", "owner"],
    "additionalProperties": False,
}

ARITHMETIC_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /0|[1-9][0-9]{0,3}/
"""

ARITHMETIC_GBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")"
num ::= "0" | [1-9] [0-9]?
"""


@pytest.fixture(scope="module")
def tokenizer():
    tok = train_byte_level_bpe(structured_corpus(), vocab_size=400)
    assert 300 <= tok.get_vocab_size() <= 500
    return tok


@pytest.fixture(scope="module")
def vocab_size(tokenizer):
    return tokenizer.get_vocab_size() + EXTRA_IDS


@pytest.fixture(scope="module")
def compiler(tokenizer, vocab_size):
    return GrammarCompiler(tokenizer, vocab_size=vocab_size, eos_token_ids=(EOS,))


def allowed_ids(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set in an i32[W] row (bit t % 32 of word t // 32)."""
    bits = (words[:, None].astype(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    ids = np.flatnonzero(bits.reshape(-1))
    return ids[ids < vocab_size]


def decode_randomly(matcher, rng, vocab_size, max_steps=300):
    """Random allowed tokens until EOS or max_steps; returns (tokens without EOS, ended)."""
    words = allocate_bitmask(1, vocab_size)[0]
    tokens: list[int] = []
    for _ in range(max_steps):
        matcher.fill_bitmask(words)
        allowed = allowed_ids(words, vocab_size)
        assert allowed.size > 0, "a live matcher must allow at least EOS"
        if EOS in allowed and (allowed.size == 1 or rng.random() < 0.5):
            token = EOS
        else:
            token = int(rng.choice(allowed[allowed != EOS]))
        assert matcher.accept(token)
        if token == EOS:
            assert matcher.is_terminated()
            return tokens, True
        tokens.append(token)
    return tokens, False


def run_many(compiler, tokenizer, vocab_size, params, num, seed, max_steps=300, min_ended=0.8):
    rng = np.random.default_rng(seed)
    texts, token_lists = [], []
    for _ in range(num):
        tokens, ended = decode_randomly(compiler.matcher(params), rng, vocab_size, max_steps)
        if ended:
            token_lists.append(tokens)
            texts.append(tokenizer.decode(tokens, skip_special_tokens=False))
    # Most runs must end, or the test would check little.
    assert len(texts) >= min_ended * num, f"only {len(texts)} of {num} runs reached EOS"
    return texts, token_lists


def assert_multi_char_tokens(tokenizer, token_lists):
    lengths = [len(tokenizer.decode([t])) for tokens in token_lists for t in tokens]
    assert max(lengths) >= 3, "the outputs should use multi-character tokens"


def test_nested_json_schema_outputs_parse_and_validate(compiler, tokenizer, vocab_size):
    jsonschema = pytest.importorskip("jsonschema")
    params = StructuredOutputsParams(json=NESTED_SCHEMA)
    texts, token_lists = run_many(compiler, tokenizer, vocab_size, params, num=30, seed=0)
    validator = jsonschema.Draft202012Validator(NESTED_SCHEMA)
    for text in texts:
        validator.validate(json.loads(text))
    assert_multi_char_tokens(tokenizer, token_lists)


def test_json_object_outputs_are_objects(compiler, tokenizer, vocab_size):
    params = StructuredOutputsParams(json_object=True)
    # Free-form keys are random strings, which end only when a quote is drawn.
    texts, _ = run_many(
        compiler, tokenizer, vocab_size, params, num=20, seed=1, max_steps=1000, min_ended=0.6
    )
    for text in texts:
        assert isinstance(json.loads(text), dict)


def test_compact_json_has_no_free_whitespace(compiler, tokenizer, vocab_size):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    texts, _ = run_many(compiler, tokenizer, vocab_size, params, num=10, seed=2)
    for text in texts:
        assert json.loads(text)["b"] in ("x", "y")
        assert "\n" not in text and "  " not in text


def test_choice_outputs_are_one_of_the_choices(compiler, tokenizer, vocab_size):
    choices = ["positive", "negative", "neutral", "pos", "café au lait"]
    params = StructuredOutputsParams(choice=choices)
    texts, _ = run_many(compiler, tokenizer, vocab_size, params, num=30, seed=3)
    assert set(texts) <= set(choices)
    assert len(set(texts)) >= 3


@pytest.mark.parametrize(
    # [0-9], not \d: the backend's \d is every Unicode digit, and its Unicode tables are
    # newer than Python's, so re would not match some of them.
    "pattern",
    [r"[a-z]{2,6}@[a-z]{2,8}\.(com|org)", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", r"(ab|cd)+e?"],
)
def test_regex_outputs_fullmatch(compiler, tokenizer, vocab_size, pattern):
    params = StructuredOutputsParams(regex=pattern)
    texts, _ = run_many(compiler, tokenizer, vocab_size, params, num=20, seed=4)
    for text in texts:
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("grammar", [ARITHMETIC_LARK, ARITHMETIC_GBNF], ids=["lark", "gbnf"])
def test_arithmetic_grammar_outputs_parse(compiler, tokenizer, vocab_size, grammar):
    params = StructuredOutputsParams(grammar=grammar)
    texts, _ = run_many(compiler, tokenizer, vocab_size, params, num=30, seed=5)
    for text in texts:
        assert re.fullmatch(r"[0-9+\-*/()]+", text), text
        ast.parse(text, mode="eval")  # a SyntaxError fails the test
        try:
            value = eval(text, {"__builtins__": {}})  # only digits, operators and brackets
        except ZeroDivisionError:
            continue
        assert isinstance(value, int | float)


def test_eos_is_allowed_exactly_when_the_grammar_can_end(compiler, tokenizer, vocab_size):
    matcher = compiler.matcher(StructuredOutputsParams(regex="ab+"))
    words = allocate_bitmask(1, vocab_size)[0]
    matcher.fill_bitmask(words)
    assert EOS not in allowed_ids(words, vocab_size)
    assert matcher.accept(tokenizer.token_to_id("a")) and matcher.accept(tokenizer.token_to_id("b"))
    matcher.fill_bitmask(words)
    allowed = allowed_ids(words, vocab_size)
    assert EOS in allowed and tokenizer.token_to_id("b") in allowed
    assert not matcher.is_terminated()


def test_a_terminated_matcher_allows_only_eos(tokenizer, vocab_size):
    compiler = GrammarCompiler(tokenizer, vocab_size=vocab_size, eos_token_ids=(EOS, 1))
    matcher = compiler.matcher(StructuredOutputsParams(regex="ab"))
    for token in tokenizer.encode("ab").ids:
        assert matcher.accept(token)
    assert matcher.is_terminated()
    words = allocate_bitmask(1, vocab_size)[0]
    matcher.fill_bitmask(words)
    assert allowed_ids(words, vocab_size).tolist() == [1, EOS]
    assert not matcher.accept(tokenizer.token_to_id("a"))
    assert matcher.accept(EOS) and matcher.is_terminated()
    assert matcher.accept(EOS)  # repeated EOS (ignore_eos) stays accepted


def test_extra_vocab_ids_and_special_tokens_are_never_allowed(compiler, tokenizer, vocab_size):
    matcher = compiler.matcher(StructuredOutputsParams(json_object=True))
    words = allocate_bitmask(1, vocab_size)[0]
    rng = np.random.default_rng(6)
    num_tok = tokenizer.get_vocab_size()
    for _ in range(40):
        matcher.fill_bitmask(words)
        bits = (words[:, None].astype(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        bits = bits.reshape(-1)
        assert not bits[num_tok:].any(), "ids past the tokenizer (and past V) must stay clear"
        assert not bits[0] and not bits[1], "pad and BOS are special, never allowed"
        allowed = allowed_ids(words, vocab_size)
        token = int(rng.choice(allowed[allowed != EOS]))
        assert matcher.accept(token)


def test_a_refused_token_changes_nothing(compiler, tokenizer, vocab_size):
    matcher = compiler.matcher(StructuredOutputsParams(regex="ab+c"))
    assert matcher.accept(tokenizer.token_to_id("a"))
    before = allocate_bitmask(1, vocab_size)[0]
    matcher.fill_bitmask(before)
    for bad in (tokenizer.token_to_id("z"), EOS, -1, vocab_size, vocab_size - 1):
        assert not matcher.accept(bad)
    assert matcher.error is None
    after = allocate_bitmask(1, vocab_size)[0]
    matcher.fill_bitmask(after)
    np.testing.assert_array_equal(before, after)
    assert matcher.num_accepted == 1
    assert matcher.accept(tokenizer.token_to_id("b"))


def test_forks_are_independent(compiler, tokenizer, vocab_size):
    parent = compiler.matcher(StructuredOutputsParams(json=NESTED_SCHEMA))
    prefix = tokenizer.encode('{"id": 12, "kind": "').ids
    for token in prefix:
        assert parent.accept(token)
    child = parent.copy()
    assert child.num_accepted == parent.num_accepted == len(prefix)
    words_parent, words_child = allocate_bitmask(2, vocab_size)
    parent.fill_bitmask(words_parent)
    child.fill_bitmask(words_child)
    np.testing.assert_array_equal(words_parent, words_child)
    for token in tokenizer.encode('dog"').ids:
        assert child.accept(token)
    for token in tokenizer.encode('cat"').ids:
        assert parent.accept(token)
    # Each follows its own tokens: compare against fresh replays.
    for matcher, text in ((parent, 'cat"'), (child, 'dog"')):
        fresh = compiler.matcher(StructuredOutputsParams(json=NESTED_SCHEMA))
        assert fresh.replay(prefix + tokenizer.encode(text).ids)
        a, b = allocate_bitmask(2, vocab_size)
        matcher.fill_bitmask(a)
        fresh.fill_bitmask(b)
        np.testing.assert_array_equal(a, b)


def test_replay_after_preemption_gives_the_same_mask(compiler, tokenizer, vocab_size):
    params = StructuredOutputsParams(json=NESTED_SCHEMA)
    matcher = compiler.matcher(params)
    rng = np.random.default_rng(7)
    tokens, _ = decode_randomly(matcher, rng, vocab_size, max_steps=25)
    tokens = [t for t in tokens if t != EOS]
    if matcher.is_terminated():  # keep the test about a live state
        tokens = tokens[:-1]
    # Preempted: the engine keeps only the request's output tokens, then rebuilds.
    rebuilt = compiler.matcher(params)
    assert rebuilt.replay(tokens)
    assert rebuilt.num_accepted == len(tokens)
    expected = compiler.matcher(params)
    for token in tokens:
        assert expected.accept(token)
    a, b = allocate_bitmask(2, vocab_size)
    rebuilt.fill_bitmask(a)
    expected.fill_bitmask(b)
    np.testing.assert_array_equal(a, b)
    # Replay on a used matcher starts over from the grammar's start.
    assert matcher.replay(tokens[:5])
    assert matcher.num_accepted == 5
    assert not rebuilt.replay(tokens + [tokenizer.token_to_id("<pad>")])
    assert rebuilt.num_accepted == len(tokens)  # a refused replay keeps the accepted prefix


def test_rollback_restores_earlier_masks(compiler, tokenizer, vocab_size):
    matcher = compiler.matcher(StructuredOutputsParams(json=NESTED_SCHEMA))
    masks = []
    words = allocate_bitmask(1, vocab_size)[0]
    for token in tokenizer.encode('{"id": 7, "kind": "bird", "owner": {').ids:
        matcher.fill_bitmask(words)
        masks.append(words.copy())
        assert matcher.accept(token)
    matcher.rollback(3)
    matcher.fill_bitmask(words)
    np.testing.assert_array_equal(words, masks[-3])
    assert matcher.num_accepted == len(masks) - 3
    with pytest.raises(ValueError, match=r"rollback.*num_tokens=99"):
        matcher.rollback(99)


@pytest.mark.parametrize("num_threads", [1, 2], ids=["in-turn", "thread-pool"])
def test_fill_bitmasks_batch_equals_per_row_fills(tokenizer, vocab_size, num_threads):
    compiler = GrammarCompiler(
        tokenizer, vocab_size=vocab_size, eos_token_ids=(EOS,), num_threads=num_threads
    )
    a = compiler.matcher(StructuredOutputsParams(regex="ab+c"))
    b = compiler.matcher(StructuredOutputsParams(json=NESTED_SCHEMA))
    assert b.accept(tokenizer.encode("{").ids[0])
    words = np.zeros((4, compiler.num_words), np.int32)
    compiler.fill_bitmasks([a, None, b], words)
    expected = allocate_bitmask(4, vocab_size)
    a.fill_bitmask(expected[0])
    b.fill_bitmask(expected[2])
    np.testing.assert_array_equal(words, expected)  # rows 1 and 3 (no matcher): all ones
    with pytest.raises(ValueError, match=r"words.*shape"):
        compiler.fill_bitmasks([a], np.zeros((1, compiler.num_words + 1), np.int32))
    with pytest.raises(ValueError, match=r"matchers.*5.*4 rows"):
        compiler.fill_bitmasks([a] * 5, words)


def test_the_mask_applied_to_logits_leaves_only_allowed_tokens(compiler, tokenizer, vocab_size):
    matcher = compiler.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    words = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(words[0])
    logits = np.random.default_rng(8).standard_normal((1, vocab_size)).astype(np.float32)
    masked = apply_bitmask_reference(logits, words)
    finite = np.flatnonzero(np.isfinite(masked[0]))
    np.testing.assert_array_equal(finite, allowed_ids(words[0], vocab_size))
    first = {tokenizer.decode([t]) for t in finite}
    assert first and all("yes".startswith(s) or "no".startswith(s) for s in first)


def test_compile_is_cached_per_distinct_constraint(tokenizer, vocab_size):
    compiler = GrammarCompiler(tokenizer, vocab_size=vocab_size, eos_token_ids=(EOS,), cache_size=2)
    one = compiler.compile(StructuredOutputsParams(json=NESTED_SCHEMA))
    again = compiler.compile(StructuredOutputsParams(json=json.dumps(NESTED_SCHEMA)))
    assert one is again
    info = compiler.cache_info()
    assert (info.hits, info.misses, info.size) == (1, 1, 1)
    compiler.compile(StructuredOutputsParams(regex="a+"))
    compiler.compile(StructuredOutputsParams(regex="b+"))  # evicts the least recently used
    assert compiler.cache_info().size == 2
    assert compiler.compile(StructuredOutputsParams(json=NESTED_SCHEMA)) is not one
    assert compiler.cache_info().misses == 4


@pytest.mark.parametrize(
    ("params", "pattern"),
    [
        (
            StructuredOutputsParams(json={"type": "foo"}),
            r"StructuredOutputsParams\.json=\{'type': 'foo'\} must be a JSON schema .*Invalid type",
        ),
        (
            StructuredOutputsParams(json={"type": "string", "pattern": "a(b"}),
            r"(?s)StructuredOutputsParams\.json=.* must be a JSON schema .*unclosed group",
        ),
        (
            StructuredOutputsParams(regex="a(b"),
            r"(?s)StructuredOutputsParams\.regex='a\(b' must be a regular expression .*unclosed group",
        ),
        (
            StructuredOutputsParams(regex="(?=a)b"),
            r"StructuredOutputsParams\.regex='\(\?=a\)b' must be a regular expression",
        ),
        (
            StructuredOutputsParams(grammar="start: foo"),
            r"StructuredOutputsParams\.grammar='start: foo' must be a Lark or GBNF grammar .*foo",
        ),
        (
            StructuredOutputsParams(grammar="%%%"),
            r"StructuredOutputsParams\.grammar='%%%' must be a Lark or GBNF grammar",
        ),
    ],
)
def test_an_invalid_constraint_raises_at_compile_naming_the_field(compiler, params, pattern):
    with pytest.raises(ValueError, match=pattern):
        compiler.compile(params)
    with pytest.raises(ValueError, match=pattern):
        compiler.matcher(params)


def test_compiler_arguments_are_checked(tokenizer):
    size = tokenizer.get_vocab_size()
    with pytest.raises(ValueError, match=rf"GrammarCompiler\.vocab_size=10 must be .*>= {size}"):
        GrammarCompiler(tokenizer, vocab_size=10, eos_token_ids=(EOS,))
    with pytest.raises(ValueError, match=r"GrammarCompiler\.eos_token_ids=\(\) must be"):
        GrammarCompiler(tokenizer, vocab_size=size, eos_token_ids=())
    with pytest.raises(ValueError, match=rf"GrammarCompiler\.eos_token_ids=\({size},\) must be"):
        GrammarCompiler(tokenizer, vocab_size=size, eos_token_ids=(size,))
    with pytest.raises(ValueError, match=r"GrammarCompiler\.tokenizer=3 must be"):
        GrammarCompiler(3, vocab_size=size, eos_token_ids=(EOS,))
    with pytest.raises(ValueError, match=r"GrammarCompiler\.cache_size=0 must be"):
        GrammarCompiler(tokenizer, vocab_size=size, eos_token_ids=(EOS,), cache_size=0)


def test_compiler_reads_a_tokenizer_json_path_and_the_demo_byte_tokenizer(tmp_path, tokenizer):
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    size = tokenizer.get_vocab_size()
    by_path = GrammarCompiler(path, eos_token_ids=(EOS,))
    assert by_path.vocab_size == size  # defaults to the tokenizer's
    from paged_jax.entrypoints.demo import build_byte_tokenizer

    byte_tok = build_byte_tokenizer()
    byte_compiler = GrammarCompiler(byte_tok, eos_token_ids=(EOS,))
    matcher = byte_compiler.matcher(StructuredOutputsParams(regex="hi+!"))
    assert matcher.replay(byte_tok.encode("hiii!", add_special_tokens=False).ids)
    assert matcher.is_terminated()


def test_a_metaspace_byte_fallback_tokenizer_is_read_as_bytes():
    """SentencePiece-style (Llama 2): "▁" for spaces and <0xNN> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "a", "b", "c", "▁a", "ab", "bc", "▁ab"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("a", "b"), ("b", "c"), ("▁a", "b")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    compiler = GrammarCompiler(tok, eos_token_ids=(2,))
    matcher = compiler.matcher(StructuredOutputsParams(regex="ab+c z"))
    vocab_size = compiler.vocab_size
    words = allocate_bitmask(1, vocab_size)[0]
    matcher.fill_bitmask(words)
    first = {tok.id_to_token(int(t)) for t in allowed_ids(words, vocab_size)}
    assert first == {"a", "ab", "<0x61>"}  # "▁a" starts with a space: not allowed
    ids = tok.encode("abbc z").ids
    assert "<0x7A>" in {tok.id_to_token(t) for t in ids}  # "z" only as a byte token
    assert matcher.replay(ids) and matcher.is_terminated()
