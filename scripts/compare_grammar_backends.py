"""Grammar libraries side by side (llguidance, xgrammar): what importing them loads, vocabulary
set-up, nested-JSON-schema compile time and per-token mask fill on one byte-level BPE.

Run once per library, each from a venv holding it (xgrammar needs torch, so it is not a
project dependency; see docs/structured_outputs.md). The same schemas, document and
tokenizer (trained on the Python standard library) go to both. Example:

    python scripts/compare_grammar_backends.py --backend llguidance --output a.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import pathlib
import statistics
import sys
import time

import numpy as np

from paged_jax.testing.bpe_tokenizer import EOS_TOKEN_ID, stdlib_corpus, train_byte_level_bpe
from paged_jax.testing.structured_cases import nested_document, nested_schema


class Llguidance:
    """Compile, match and fill through llguidance's own API."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance

        self.llg = llguidance
        self.version = importlib.metadata.version("llguidance")
        self.tok = llguidance.LLTokenizer(
            tokenizer.to_str(), n_vocab=vocab_size, eos_token=EOS_TOKEN_ID
        )
        self.row = np.zeros((vocab_size + 31) // 32, np.int32)

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        # The first mask builds the lexer's start states: part of compiling.
        matcher.unsafe_compute_mask_ptr(self.row.ctypes.data, self.row.nbytes)
        assert not matcher.get_error(), matcher.get_error()
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tok, grammar, log_level=0)

    def fill(self, matcher) -> None:
        matcher.unsafe_compute_mask_ptr(self.row.ctypes.data, self.row.nbytes)

    def accept(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class Xgrammar:
    """Compile, match and fill through xgrammar's API (its bitmask is a torch tensor)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        self.version = importlib.metadata.version("xgrammar")
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>")
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=[EOS_TOKEN_ID]
        )
        # No cache: every schema below is distinct anyway; this keeps the timing honest.
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.row = xgrammar.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self.row, 0)

    def accept(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["llguidance", "xgrammar"], required=True)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--num-schemas", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5, help="passes over the document (>= 2)")
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = train_byte_level_bpe(
        stdlib_corpus(max(8_000_000, 320 * args.vocab_size)), vocab_size=args.vocab_size
    )
    vocab_size = tokenizer.get_vocab_size()
    before = set(sys.modules)
    t0 = time.perf_counter()
    backend = (Llguidance if args.backend == "llguidance" else Xgrammar)(tokenizer, vocab_size)
    init_s = time.perf_counter() - t0
    loaded = set(sys.modules) - before
    heavy = sorted(m for m in ("torch", "transformers", "jax") if m in loaded)

    grammars, compile_s = [], []
    for i in range(args.num_schemas):
        t0 = time.perf_counter()
        grammars.append(backend.compile(nested_schema(i)))
        compile_s.append(time.perf_counter() - t0)
    tokens = tokenizer.encode(json.dumps(nested_document(0))).ids + [EOS_TOKEN_ID]
    # The first pass meets every parser state for the first time (lazily built lexer
    # states are paid there); later passes over the same document reuse them.
    first_pass_s, later_s, accept_s = [], [], []
    for rep in range(args.repeats):
        matcher = backend.matcher(grammars[0])
        for token in tokens:
            t0 = time.perf_counter()
            backend.fill(matcher)
            (first_pass_s if rep == 0 else later_s).append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            backend.accept(matcher, token)
            accept_s.append(time.perf_counter() - t0)

    def us(samples: list[float]) -> dict:
        s = sorted(1e6 * x for x in samples)
        return {
            "mean": round(statistics.fmean(s), 2),
            "median": round(statistics.median(s), 2),
            "p90": round(s[int(0.9 * (len(s) - 1))], 2),
        }

    # Per document position, the best of the later passes: the state's own cost, without
    # the descheduling a busy machine adds to single samples.
    later = np.asarray(later_s).reshape(args.repeats - 1, len(tokens))
    best_us = 1e6 * later.min(axis=0)
    report = {
        "command": "python scripts/compare_grammar_backends.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "backend": args.backend,
        "version": backend.version,
        "heavy_modules_loaded": heavy,
        "vocab_size": vocab_size,
        "tokenizer_init_s": round(init_s, 3),
        "compile_ms": [round(1e3 * s, 3) for s in compile_s],
        "compile_ms_median": round(1e3 * statistics.median(compile_s), 3),
        "document_tokens": len(tokens),
        "fill_us_first_pass": us(first_pass_s),
        "fill_us_later_passes": us(later_s),
        "fill_us_best_of_passes": {
            "mean": round(float(best_us.mean()), 2),
            "median": round(float(np.median(best_us)), 2),
            "max": round(float(best_us.max()), 2),
        },
        "accept_us": us(accept_s),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        pathlib.Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
