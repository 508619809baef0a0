"""Structured outputs on the host: a constraint's grammar compiled once per tokenizer, the
per-request matcher that writes each step's allowed-token bitmask, and the engine's
component holding the matchers. Never imports jax.

The constraint itself, ``StructuredOutputsParams``, lives in ``paged_jax.structured_params``
(re-exported here) and checks its fields without the grammar library. That library is
llguidance (the optional extra ``paged-jax[structured]``), imported only when a
``GrammarCompiler`` is built. docs/structured_outputs.md has the API, the backend choice and
the numbers.

Bitmask layout: one int32 row of ``W = cdiv(V, 32)`` words per sequence, bit ``t % 32`` of
word ``t // 32`` set when token ``t`` is allowed (V = the model's vocabulary, which may be
wider than the tokenizer's: those extra ids, and the last word's spare bits, stay clear).
An all-ones row (-1 in every word) constrains nothing. A live matcher always allows at
least EOS: EOS is allowed when the grammar can end, and a terminated matcher allows only
EOS.

The device side (``paged_jax.worker.sampling.apply_bitmask``; ``apply_bitmask_reference``
is its numpy reference):

- The jitted sampler takes one more fixed-shape input, ``bitmask i32[S, W]`` over the
  step's sequence bucket S; unconstrained and padding rows are all ones, so the program
  never changes shape and compiles once per bucket at warm-up.
- In ``sample``, after the non-finite check on the raw logits (the mask adds -inf on
  purpose) and before everything else (bans, penalties, greedy, temperature, top-k/p,
  min-p, and the logprobs, which then describe the masked distribution)::

      col = jnp.arange(V)                                   # i32[V], a constant
      bits = (bitmask[:, col // 32] >> (col % 32)) & 1      # i32[S, V]
      logits = jnp.where(bits != 0, logits, -jnp.inf)

- Steps with no constrained row copy nothing: the runner keeps one device-resident
  all-ones ``i32[S, W]`` per sequence bucket (made at warm-up) and passes it; a step with
  one fills a host buffer with ``GrammarCompiler.fill_bitmasks`` and transfers it.

Engine wiring (``paged_jax.engine``; the calls, in order): build one ``GrammarCompiler(tokenizer,
vocab_size=V, eos_token_ids=...)`` per engine (lazily, on the first constrained request);
at submission ``compiler.matcher(params)`` (a ValueError names the bad field: reject that
request only); per step ``compiler.fill_bitmasks(matchers_by_row, bitmask)`` for the rows
that sample; after the step ``matcher.accept(token)`` per constrained row (False: finish
that request with an error); forks take ``matcher.copy()``; a request whose matcher was
dropped (preemption) gets ``compiler.matcher(params)`` then ``replay(output_token_ids)``.
With async scheduling the mask of step N+1 needs step N's token, so a step with a
constrained row waits for the previous step's tokens before it is packed.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import dataclasses
import os
import re
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from paged_jax.constants import cdiv, is_int
from paged_jax.structured_params import (
    MAX_GRAMMAR_RULES,
    MAX_SCHEMA_DEPTH,
    ConstraintKind,
    StructuredOutputsParams,
    field_error,
    short_repr,
)

# ConstraintKind, MAX_GRAMMAR_RULES, MAX_SCHEMA_DEPTH and StructuredOutputsParams are
# re-exported from their home, paged_jax.structured_params.
__all__ = [
    "BITS_PER_WORD",
    "CACHE_BYTES_ENV",
    "CacheInfo",
    "CompiledGrammar",
    "ConstraintKind",
    "GrammarCompiler",
    "MAX_GRAMMAR_RULES",
    "MAX_SCHEMA_DEPTH",
    "Matcher",
    "StructuredOutputsParams",
    "allocate_bitmask",
    "apply_bitmask_reference",
    "bitmask_width",
]

BITS_PER_WORD = 32
DEFAULT_CACHE_SIZE = 256
# The grammar cache's byte budget: this environment variable, else 1 GiB.
CACHE_BYTES_ENV = "PAGED_JAX_GRAMMAR_CACHE_BYTES"
DEFAULT_CACHE_BYTES = 2**30
# Compiles run on a thread with this much stack (address space; pages are committed only
# as they are touched). The backend recurses along chains of $refs too (~10 KiB per
# level, 1,000 chained objects overflow 8 MiB); its own schema size limit stops a chain
# well before this stack runs out (20,000 chained objects: "schema too large").
_COMPILE_STACK_BYTES = 512 * 2**20
# The backend's reason, made one line, is cut to this many characters.
_MAX_BACKEND_MESSAGE_CHARS = 200
# Allowed first tokens tried on a copy of the start state at compile time: the parser's row
# limit bites when a token leaves too many alternatives alive, most often a short one (a
# byte-level BPE numbers its single bytes first), so the lowest ids go first.
_PROBE_LOWEST_TOKENS = 16
_PROBE_SPREAD_TOKENS = 16
# Without glibc's allocator statistics, an entry is counted as this multiple of its text
# (the key's and the grammar's): the ratio measured for a large schema with few
# alternatives. Grammars of many alternatives build lexers several times larger.
_FALLBACK_BYTES_PER_TEXT_BYTE = 4

_EXPECTED_BY_BACKEND = {
    "json": "a JSON schema the grammar backend (llguidance) accepts",
    "json_object": "true",
    "regex": "a regular expression the grammar backend (llguidance, Rust regex syntax: no "
    "look-around or back-references) accepts",
    "choice": "strings the grammar backend accepts",
    "grammar": "a Lark or GBNF grammar the grammar backend (llguidance) accepts",
}


# Lines of a backend message that only point at its source: carets, and "   1 | start: ...".
_POINTER_LINE = re.compile(r"\s*[\^~]+\s*")
_SOURCE_LINE = re.compile(r"\s*\d+ \| ")
# Where the backend's message turns into a parser-state dump or a backtrace.
_DUMP_MARKERS = ("<state>", "<non-verbose/>", "<backtrace>", "<grammar>")
# Stop reasons the backend gives as its whole message, in words.
_STOP_REASONS = {
    "NoExtensionBias": "the grammar allows no output (no token can start or continue it)",
    "NoExtension": "the grammar allows no output (no token can start or continue it)",
}


def _one_line(message: str) -> str:
    """The backend's error as one line: the reason, without its caret diagrams (and the
    source lines they point at), parser-state dumps or backtraces, cut to ~200 chars."""
    for marker in _DUMP_MARKERS:
        cut = message.find(marker)
        if cut >= 0:
            message = message[:cut]
    lines = message.splitlines()
    kept = []
    for i, line in enumerate(lines):
        pointed_at = i + 1 < len(lines) and _POINTER_LINE.fullmatch(lines[i + 1])
        if (
            not line.strip()
            or _POINTER_LINE.fullmatch(line)
            or _SOURCE_LINE.match(line)
            or pointed_at
        ):
            continue
        kept.append(" ".join(line.split()))
    text = " ".join(kept).strip()
    text = _STOP_REASONS.get(text, text) or "the grammar backend refused it (no reason given)"
    if len(text) > _MAX_BACKEND_MESSAGE_CHARS:
        text = text[:_MAX_BACKEND_MESSAGE_CHARS] + "..."
    return text


def bitmask_width(vocab_size: int) -> int:
    """Words per bitmask row: ``cdiv(vocab_size, 32)``."""
    return cdiv(vocab_size, BITS_PER_WORD)


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """An all-ones (nothing constrained) bitmask, i32[num_rows, cdiv(vocab_size, 32)]."""
    return np.full((num_rows, bitmask_width(vocab_size)), -1, dtype=np.int32)


def apply_bitmask_reference(logits: np.ndarray, words: np.ndarray) -> np.ndarray:
    """Logits with -inf where the bitmask disallows the token (numpy; the sampler's reference).

    Args:
        logits: f32[S, V].
        words: i32[S, W]; bit t % 32 of word t // 32 allows token t. Columns past 32 * W
            (logits wider than the mask) are disallowed.

    Returns:
        f32[S, V], a new array.
    """
    logits = np.asarray(logits)
    words = np.asarray(words)
    if words.dtype != np.int32:
        raise ValueError(f"words.dtype={words.dtype} must be int32")
    if logits.ndim != 2 or words.ndim != 2 or words.shape[0] != logits.shape[0]:
        raise ValueError(
            f"words.shape={words.shape} must be (S, W) with S={logits.shape[0]} "
            f"(logits.shape={logits.shape})"
        )
    vocab = logits.shape[1]
    col = np.arange(vocab)
    inside = col < words.shape[1] * BITS_PER_WORD
    col = np.where(inside, col, 0)
    # Shift as unsigned so bit 31 (the sign bit) reads like the others.
    bits = (words.view(np.uint32)[:, col // BITS_PER_WORD] >> (col % BITS_PER_WORD)) & 1
    allowed = (bits != 0) & inside
    return np.where(allowed, logits, np.float32(-np.inf)).astype(logits.dtype, copy=False)


def _load_backend():
    try:
        import llguidance
    except ImportError as e:
        raise ImportError(
            "structured outputs need the llguidance package: pip install 'paged-jax[structured]'"
        ) from e
    return llguidance


class CacheInfo(NamedTuple):
    """Grammar cache counters of one GrammarCompiler."""

    hits: int
    misses: int
    size: int
    max_size: int
    bytes: int
    max_bytes: int


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """One constraint compiled against one tokenizer; matchers start from ``initial``.

    Attributes:
        key: the constraint's ``StructuredOutputsParams.key``.
        grammar: the backend's serialized grammar.
        initial: the backend matcher in its start state (copied, never advanced).
        vocab_size: the model's vocabulary size V.
        eos_token_ids: the ids that end the output.
        compile_s: seconds the compile took, the first mask included.
        num_bytes: the memory the grammar cache counts for it: the key's text plus what
            the compile allocated and kept (the grammar's text, the backend's grammar,
            lexer and start state), measured with glibc's allocator statistics, at least
            the grammar's text; without glibc, 4x the key's and the grammar's text. States
            the backend's lexer adds later, as matchers advance, are not counted.
    """

    key: tuple
    grammar: str
    initial: Any
    vocab_size: int
    eos_token_ids: frozenset[int]
    compile_s: float
    num_bytes: int = 0

    @property
    def num_words(self) -> int:
        return bitmask_width(self.vocab_size)


class Matcher:
    """One sequence's position in its grammar: fills its bitmask row, accepts its tokens.

    Built by ``GrammarCompiler.matcher``. A refused token (not allowed by the grammar,
    or outside [0, V)) changes nothing, so a mask applied by the sampler never leaves a
    matcher in a state its tokens do not explain.
    """

    def __init__(self, grammar: CompiledGrammar, backend_matcher: Any, tokens: list[int]):
        self.grammar = grammar
        self._ll = backend_matcher
        self._tokens = tokens
        self._refusal: str | None = None

    @property
    def num_accepted(self) -> int:
        """Tokens accepted since the grammar's start (what rollback and replay count)."""
        return len(self._tokens)

    @property
    def accepted_token_ids(self) -> tuple[int, ...]:
        """The accepted tokens, in order."""
        return tuple(self._tokens)

    @property
    def error(self) -> str | None:
        """The backend's error in one line (a grammar that hit a parser limit), or None:
        also the reason the last token was refused, when the backend gave one."""
        message = self._ll.get_error()
        return _one_line(message) if message else self._refusal

    def fill_bitmask(self, words_row: np.ndarray) -> None:
        """Writes the allowed next tokens into ``words_row``, i32[W] (C-contiguous).

        A terminated matcher allows only the EOS ids.
        """
        num_words = self.grammar.num_words
        if (
            words_row.dtype != np.int32
            or words_row.shape != (num_words,)
            or not words_row.flags.c_contiguous
        ):
            raise ValueError(
                f"words_row (shape={words_row.shape}, dtype={words_row.dtype}) must be a "
                f"C-contiguous int32 array of shape ({num_words},)"
            )
        self._ll.unsafe_compute_mask_ptr(words_row.ctypes.data, words_row.nbytes)

    def accept(self, token_id: int) -> bool:
        """Advances past ``token_id``; False (and nothing changed) when it is not allowed."""
        token = int(token_id)
        if not 0 <= token < self.grammar.vocab_size:
            return False
        ll = self._ll
        # The backend's validate_tokens refuses EOS once the grammar is complete, though
        # EOS is then the one allowed token: EOS is allowed exactly when it can end.
        if token in self.grammar.eos_token_ids:
            if not ll.is_accepting():
                return False
        elif ll.validate_tokens([token]) != 1:
            return False
        if not ll.consume_token(token):  # validated above; only a backend limit gets here
            message = ll.get_error()
            self._refusal = _one_line(message) if message else None
            self._ll = self._rebuilt(self._tokens)
            return False
        self._refusal = None
        self._tokens.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens (speculative or async steps)."""
        if not is_int(num_tokens) or not 0 <= num_tokens <= len(self._tokens):
            raise ValueError(
                f"Matcher.rollback num_tokens={num_tokens!r} must be an int in "
                f"[0, num_accepted={len(self._tokens)}]"
            )
        if num_tokens == 0:
            return
        if not self._ll.rollback(num_tokens):
            self._ll = self._rebuilt(self._tokens[:-num_tokens])
        del self._tokens[-num_tokens:]

    def is_terminated(self) -> bool:
        """True when nothing but EOS can follow (the grammar is complete, or EOS came)."""
        return self._ll.is_stopped()

    def copy(self) -> Matcher:
        """An independent matcher in the same state (a fork: n > 1, beams)."""
        return Matcher(self.grammar, self._ll.deep_copy(), list(self._tokens))

    @property
    def backend_matcher(self) -> Any:
        """The llguidance matcher behind this one (for batched mask fills)."""
        return self._ll

    def replay(self, tokens: Sequence[int]) -> bool:
        """Restarts from the grammar's start and accepts ``tokens`` (rebuild after preemption).

        Returns:
            True when every token was accepted; otherwise the matcher holds the longest
            accepted prefix and returns False.
        """
        tokens = [int(t) for t in tokens]
        vocab = self.grammar.vocab_size
        valid = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab), len(tokens))
        ll = self.grammar.initial.deep_copy()
        done = ll.try_consume_tokens(tokens[:valid]) if valid else 0
        self._ll = ll
        self._tokens = tokens[:done]
        return done == len(tokens)

    def _rebuilt(self, tokens: list[int]) -> Any:
        ll = self.grammar.initial.deep_copy()
        ok = ll.consume_tokens(tokens) if tokens else True
        assert ok, "tokens the matcher accepted once must be accepted again (backend bug)"
        return ll


def _default_num_threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(32, int(0.8 * cpus)))


def _as_tokenizer(tokenizer: Any):
    """A copy of ``tokenizer`` as a ``tokenizers.Tokenizer`` (from itself or a tokenizer.json path)."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, str | os.PathLike):
        try:
            tok = Tokenizer.from_file(os.fspath(tokenizer))
        except Exception as e:
            raise field_error(
                "GrammarCompiler", "tokenizer", tokenizer, f"a readable tokenizer.json: {e}"
            ) from None
    elif isinstance(tokenizer, Tokenizer):
        tok = Tokenizer.from_str(tokenizer.to_str())
    else:
        raise field_error(
            "GrammarCompiler",
            "tokenizer",
            tokenizer,
            "a tokenizers.Tokenizer or the path of a tokenizer.json",
        )
    # Padding or truncation settings would change what the backend reads as a token.
    tok.no_padding()
    tok.no_truncation()
    return tok


class GrammarCompiler:
    """Compiles constraints for one tokenizer and model vocabulary; hands out matchers.

    Built once per engine (reading the vocabulary takes ~0.4 s for 32k tokens). Each
    distinct constraint (``StructuredOutputsParams.key``) compiles once; the cache keeps
    the most recently used, at most ``cache_size`` of them and at most ``cache_bytes``
    bytes (each entry counted as ``CompiledGrammar.num_bytes``; one larger than the whole
    budget is compiled but not kept). The backend's parser limits are its defaults (a row
    of at most 2000 items, among others); a constraint over them is refused at compile
    time when its start state or a first token shows it, and otherwise refuses the token
    that reaches the limit (``Matcher.error`` says why).

    Args:
        tokenizer: the checkpoint's ``tokenizers.Tokenizer``, or its tokenizer.json path.
        eos_token_ids: the ids that end a request (the model's EOS); the grammar allows
            them when it can end.
        vocab_size: the model's vocabulary V (logits width), >= the tokenizer's ids;
            default the tokenizer's.
        cache_size: most compiled grammars kept.
        cache_bytes: most bytes of compiled grammars kept; None reads the
            ``PAGED_JAX_GRAMMAR_CACHE_BYTES`` environment variable, default 1 GiB.
        num_threads: threads ``fill_bitmasks`` spreads a step's rows over (None: 80% of
            this process's CPUs, at most 32). With one, rows are filled in turn: the
            backend's thread pool costs more than it saves on a machine that small.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_token_ids: Sequence[int],
        vocab_size: int | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
        cache_bytes: int | None = None,
        num_threads: int | None = None,
    ) -> None:
        owner = type(self).__name__
        tok = _as_tokenizer(tokenizer)
        ids = tok.get_vocab(with_added_tokens=True).values()
        self.tokenizer_vocab_size = max(ids) + 1 if ids else 0
        if vocab_size is None:
            vocab_size = self.tokenizer_vocab_size
        if not is_int(vocab_size) or vocab_size < self.tokenizer_vocab_size:
            raise field_error(
                owner,
                "vocab_size",
                vocab_size,
                f"an int >= {self.tokenizer_vocab_size} (the tokenizer's ids)",
            )
        eos = tuple(eos_token_ids) if isinstance(eos_token_ids, Sequence) else eos_token_ids
        if (
            not isinstance(eos, tuple)
            or not eos
            or not all(is_int(t) and 0 <= t < vocab_size for t in eos)
        ):
            raise field_error(
                owner,
                "eos_token_ids",
                eos,
                f"a non-empty list of ids in [0, vocab_size={vocab_size}) "
                "(a constrained output ends with EOS)",
            )
        if not is_int(cache_size) or cache_size < 1:
            raise field_error(owner, "cache_size", cache_size, "an int >= 1")
        if cache_bytes is None:
            cache_bytes = _cache_bytes_from_env()
        elif not is_int(cache_bytes) or cache_bytes < 1:
            raise field_error(owner, "cache_bytes", cache_bytes, "None or an int >= 1")
        if num_threads is not None and (not is_int(num_threads) or num_threads < 1):
            raise field_error(owner, "num_threads", num_threads, "None or an int >= 1")
        llg = _load_backend()
        try:
            self._ll_tokenizer = llg.LLTokenizer(
                tok.to_str(), n_vocab=vocab_size, eos_token=list(eos)
            )
        except Exception as e:
            raise field_error(
                owner, "tokenizer", tokenizer, f"a tokenizer the grammar backend reads: {e}"
            ) from None
        self._llg = llg
        # Errors without the parser-state dump and grammar echo (other limits: defaults).
        self._limits = llg.LLParserLimits(verbose_errors=False)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos
        self.num_words = bitmask_width(vocab_size)
        self._cache: collections.OrderedDict[tuple, CompiledGrammar] = collections.OrderedDict()
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self.num_threads = _default_num_threads() if num_threads is None else num_threads
        self._executor = None

    def cache_info(self) -> CacheInfo:
        """Hits, misses, entries and bytes of the grammar cache."""
        return CacheInfo(
            self._hits,
            self._misses,
            len(self._cache),
            self._cache_size,
            self._bytes,
            self._cache_bytes,
        )

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The constraint's compiled grammar, from the cache when its key was seen.

        Raises:
            ValueError: the backend cannot compile it; the message names the field
                (``StructuredOutputsParams.regex='a(b' must be a regular expression ...``).
        """
        if not isinstance(params, StructuredOutputsParams):
            raise ValueError(f"params={short_repr(params)} must be a StructuredOutputsParams")
        key = params.key
        cached = self._cache.get(key)
        if cached is not None:
            self._hits += 1
            self._cache.move_to_end(key)
            return cached
        self._misses += 1
        compiled = self._compile_uncached(params)
        self._cache[key] = compiled
        self._bytes += compiled.num_bytes
        while len(self._cache) > self._cache_size or self._bytes > self._cache_bytes:
            _, evicted = self._cache.popitem(last=False)  # least recently used first
            self._bytes -= evicted.num_bytes
        return compiled

    def matcher(self, params: StructuredOutputsParams) -> Matcher:
        """A new matcher at the start of the constraint's grammar (compiled or cached)."""
        compiled = self.compile(params)
        return Matcher(compiled, compiled.initial.deep_copy(), [])

    def fill_bitmasks(self, matchers: Sequence[Matcher | None], words: np.ndarray) -> None:
        """Fills row i of ``words`` from ``matchers[i]``; rows without one get all ones.

        Args:
            matchers: one entry per row of the step (None: unconstrained), at most S.
            words: i32[S, W] C-contiguous; overwritten.
        """
        if (
            words.dtype != np.int32
            or words.ndim != 2
            or words.shape[1] != self.num_words
            or not words.flags.c_contiguous
        ):
            raise ValueError(
                f"words (shape={words.shape}, dtype={words.dtype}) must be a C-contiguous "
                f"int32 array of shape (S, {self.num_words})"
            )
        if len(matchers) > words.shape[0]:
            raise ValueError(
                f"matchers has {len(matchers)} entries: must be at most the {words.shape[0]} "
                "rows of words"
            )
        pairs = [(m.backend_matcher, i) for i, m in enumerate(matchers) if m is not None]
        if len(pairs) < words.shape[0]:
            free = np.ones(words.shape[0], bool)
            free[[i for _, i in pairs]] = False
            words[free] = -1
        if not pairs:
            return
        row_bytes = self.num_words * 4
        if len(pairs) == 1 or self.num_threads == 1:
            base = words.ctypes.data
            for ll, i in pairs:
                ll.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
            return
        if self._executor is None:
            self._executor = self._llg.LLExecutor(self.num_threads)
        self._executor.unsafe_compute_mask_ptr(pairs, words.ctypes.data, row_bytes, words.shape[0])

    def _backend_grammar(self, params: StructuredOutputsParams) -> str:
        llg = self._llg
        kind, text = params.key[0], params.key[1]
        if kind in ("json", "json_object"):
            options: dict[str, Any] = {}
            if params.disable_any_whitespace:
                options["whitespace_flexible"] = False
            if params.whitespace_pattern is not None:
                options["whitespace_pattern"] = params.whitespace_pattern
            return llg.LLMatcher.grammar_from_json_schema(text, overrides=options or None)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            return llg.grammar_from("choice", text)
        return llg.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark

    def _compile_uncached(self, params: StructuredOutputsParams) -> CompiledGrammar:
        kind = params.kind
        field = "json" if kind == "json_object" else kind
        before = _allocated_bytes()
        start = time.perf_counter()

        def build() -> tuple[str, Any, str]:
            grammar = self._backend_grammar(params)
            initial = self._llg.LLMatcher(
                self._ll_tokenizer, grammar, log_level=0, limits=self._limits
            )
            return grammar, initial, initial.get_error() or self._first_token_error(initial)

        try:
            grammar, initial, message = _on_big_stack(build)
        except BaseException as e:
            # ValueError (or RuntimeError) from the backend; RecursionError or a Rust panic
            # not caught inside it (pyo3's PanicException derives from BaseException) from
            # a hostile constraint. Anything else is a bug here, not in the constraint.
            is_panic = type(e).__name__ == "PanicException"
            if not is_panic and not isinstance(e, ValueError | RuntimeError | RecursionError):
                raise
            message = str(e) or type(e).__name__
        if message:
            reason = _one_line(message)
            if kind == "choice" and "Current row has" in reason:
                reason += (
                    " (more alternatives than its parser holds: the same strings as "
                    'json={"enum": [...]} are not limited this way)'
                )
            raise field_error(
                "StructuredOutputsParams",
                field,
                getattr(params, kind),
                f"{_EXPECTED_BY_BACKEND[kind]}: {reason}",
            )
        compile_s = time.perf_counter() - start
        after = _allocated_bytes()
        key_bytes = sys.getsizeof(params.key[1])
        grammar_bytes = sys.getsizeof(grammar)
        if before is None or after is None:
            num_bytes = _FALLBACK_BYTES_PER_TEXT_BYTE * (key_bytes + grammar_bytes)
        else:
            num_bytes = key_bytes + max(after - before, grammar_bytes)
        return CompiledGrammar(
            key=params.key,
            grammar=grammar,
            initial=initial,
            vocab_size=self.vocab_size,
            eos_token_ids=frozenset(self.eos_token_ids),
            compile_s=compile_s,
            num_bytes=num_bytes,
        )

    def _first_token_error(self, initial: Any) -> str:
        """The backend's error from the first mask, or from consuming one of the first
        allowed tokens on a copy; "" when none.

        The first mask builds the lexer's start states (counted as compile time). A
        grammar over the parser's row limit (more than 2000 alternatives alive) passes it
        and fails at the first token, so some first tokens are tried here: a request that
        could never take a token is refused at submission with the backend's reason.
        """
        words = np.empty(self.num_words, np.int32)
        initial.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        message = initial.get_error()
        if message:
            return message
        little = words.astype("<i4", copy=False).view(np.uint8)  # bit t%8 of byte t//8
        bits = np.unpackbits(little, bitorder="little")[: self.vocab_size]
        allowed = np.setdiff1d(np.flatnonzero(bits), list(self.eos_token_ids))
        if allowed.size == 0:
            return ""
        spread = np.linspace(0, allowed.size - 1, _PROBE_SPREAD_TOKENS).astype(np.int64)
        picks = np.union1d(allowed[:_PROBE_LOWEST_TOKENS], allowed[spread])
        for token in picks.tolist():
            probe = initial.deep_copy()
            if not probe.consume_token(token):
                message = probe.get_error()
                if message:
                    return message
        return ""


def _on_big_stack(fn: Any) -> Any:
    """``fn()`` on a new thread with ``_COMPILE_STACK_BYTES`` of stack (the backend's
    recursion must not overflow the caller's); its exception is raised here. Where the
    platform cannot size a thread's stack, ``fn()`` runs on this one."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as e:  # re-raised on the caller's thread
            outcome["error"] = e

    with _STACK_SIZE_LOCK:
        try:
            previous = threading.stack_size(_COMPILE_STACK_BYTES)
        except (ValueError, RuntimeError):
            return fn()
        try:
            thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# threading.stack_size is process-wide: held while the compile thread is made.
_STACK_SIZE_LOCK = threading.Lock()


def _cache_bytes_from_env() -> int:
    value = os.environ.get(CACHE_BYTES_ENV, "")
    if not value.strip():
        return DEFAULT_CACHE_BYTES
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(
            f"${CACHE_BYTES_ENV}={value!r} must be an int >= 1: the grammar cache's most "
            f"bytes (unset: {DEFAULT_CACHE_BYTES}, 1 GiB)"
        )
    return number


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _load_mallinfo2() -> Any:
    """glibc's ``mallinfo2`` (2.33+), or None (another C library or platform)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


_MALLINFO2: Any = None
_MALLINFO2_LOADED = False


def _allocated_bytes() -> int | None:
    """Bytes this process holds from malloc (the backend's Rust code allocates there too),
    or None where glibc's statistics are not available."""
    global _MALLINFO2, _MALLINFO2_LOADED
    if not _MALLINFO2_LOADED:
        _MALLINFO2, _MALLINFO2_LOADED = _load_mallinfo2(), True
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks) + int(info.hblkhd)


class StructuredOutputs:
    """The engine's structured-outputs component: one matcher per live constrained request.

    The engine calls it at four points: a constrained request arrives or is forked
    (``add_request``, ``fork_matcher``), a step is packed (``bitmask``: the constrained
    rows' allowed tokens), a step's tokens are read (``accept``), and a failed step is
    rolled back (``replay``).

    Args:
        tokenizer: the checkpoint's ``tokenizers.Tokenizer`` (or its tokenizer.json path);
            None refuses constrained requests with a ValueError.
        vocab_size: the model's vocabulary size.

    Attributes:
        matchers: request id -> the Matcher of every live constrained request.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.compiler: GrammarCompiler | None = None
        self.matchers: dict[str, Matcher] = {}

    def grammars(self, eos_token_ids: Sequence[int]) -> GrammarCompiler:
        """The GrammarCompiler, built on first use; ValueError without a tokenizer."""
        if self.compiler is None:
            if self.tokenizer is None:
                raise ValueError(
                    "SamplingParams.structured_outputs needs the checkpoint's tokenizer: "
                    "pass Engine(tokenizer=...) (LLM does when it has one)"
                )
            self.compiler = GrammarCompiler(
                self.tokenizer, eos_token_ids=tuple(eos_token_ids), vocab_size=self.vocab_size
            )
        return self.compiler

    def new_matcher(
        self,
        params: Any,
        eos_token_ids: Sequence[int],
        output_token_ids: Sequence[int] = (),
    ) -> Matcher:
        """A matcher for ``params.structured_outputs`` (a SamplingParams) past
        ``output_token_ids``.

        Raises:
            ValueError: the constraint does not compile (naming the field), or the grammar
                refuses one of the tokens.
        """
        matcher = self.grammars(eos_token_ids).matcher(params.structured_outputs)
        if output_token_ids and not matcher.replay(output_token_ids):
            raise ValueError(
                f"output_token_ids={list(output_token_ids)!r} must be allowed by "
                "SamplingParams.structured_outputs: its grammar refuses token "
                f"{int(output_token_ids[matcher.num_accepted])}"
            )
        return matcher

    def add_request(
        self,
        request_id: str,
        params: Any,
        eos_token_ids: Sequence[int],
        matcher: Matcher | None = None,
    ) -> None:
        """Gives a constrained request ``matcher`` or a new one at its grammar's start
        (nothing for an unconstrained one)."""
        if params.structured_outputs is not None:
            self.matchers[request_id] = matcher or self.new_matcher(params, eos_token_ids)

    def remove_request(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def fork_matcher(
        self, parent: Any, child: Any, params: Any, eos_token_ids: Sequence[int]
    ) -> Matcher | None:
        """The matcher of a child Request forked from ``parent`` with ``params``: a copy
        of the parent's when the child has its constraint and outputs, else a replay of
        the child's outputs (None for an unconstrained child)."""
        if params.structured_outputs is None:
            return None
        source = self.matchers.get(parent.request_id)
        same = (
            source is not None
            and parent.sampling_params.structured_outputs == params.structured_outputs
            and source.accepted_token_ids == tuple(child.output_token_ids)
        )
        return (
            source.copy()
            if same
            else self.new_matcher(params, eos_token_ids, child.output_token_ids)
        )

    def bitmask(self, step: Any, scheduled: Sequence[Any], width: int) -> Any:
        """The StepInput ``step`` with its constrained rows' allowed-token bitmask
        (unchanged when no row that samples is constrained: the runner then passes its
        resident all-ones one). ``scheduled``: the step's ScheduledSeqs, in row order."""
        matchers = self.matchers
        rows = [matchers.get(seq.req_id) if seq.samples else None for seq in scheduled]
        if not any(rows):
            return step
        words = np.empty((step.bucket[1], width), np.int32)
        self.compiler.fill_bitmasks(rows, words)
        return dataclasses.replace(step, sampling=step.sampling._replace(bitmask=words))

    def accept(
        self, sampled: dict[str, Any], requests: Mapping[str, Any], eos_token_ids: Sequence[int]
    ) -> tuple[list[tuple[Any, int]], list[str]]:
        """Advances each constrained request's matcher past its sampled token.

        A refused token is taken out of ``sampled`` and its Request returned with it (it
        ends with an error); also returns the ids of requests whose grammar EOS ended
        though they ignore EOS.
        """
        refused, ended = [], []
        for req_id, token in list(sampled.items()):
            matcher = self.matchers.get(req_id)
            if matcher is None:
                continue
            if type(token) is list:  # speculative engine: a constrained row has no drafts
                token = token[0]
            if not matcher.accept(token):
                del sampled[req_id]
                refused.append((requests[req_id], token))
            elif token in eos_token_ids and requests[req_id].sampling_params.ignore_eos:
                ended.append(req_id)
        return refused, ended

    def refusal_reason(self, request_id: str) -> str | None:
        """Why the grammar of ``request_id`` refused its last token, in one line, when the
        backend said (a parser limit reached); None for a plain refusal (the token is not
        in the grammar) or an unconstrained request. Read it before the request ends."""
        matcher = self.matchers.get(request_id)
        return None if matcher is None else matcher.error

    def replay(self, requests: Sequence[Any]) -> None:
        """After a rolled-back step: a grammar past tokens that were dropped starts over
        from its request's outputs."""
        for req in requests:
            m = self.matchers.get(req.request_id)
            if m is not None and m.accepted_token_ids != tuple(req.output_token_ids):
                m.replay(req.output_token_ids)
