"""Structured output: decoding constrained by a grammar, so a reply always parses.

A request's `response_format` (JSON object, JSON schema), or llama.cpp's `json_schema`,
`grammar` (GBNF or Lark) and a `regex`, becomes one llguidance grammar (`grammar_for`). Each
constrained sequence holds a `Constraint`: before sampling, the tokens its grammar cannot take
next get -inf logits; after sampling, the token moves it on. llguidance was chosen by
measurement (scripts/bench_structured_output.py, docs/SERVING.md): about 55 µs a token on
SmolLM2's 49k vocabulary, with grammars compiled in about 1 ms; xgrammar took 235 µs a token
and 21 ms to compile, outlines-core 1.3 ms a token on average and 90 ms to compile. It is also
what llama.cpp uses, and takes GBNF as well as Lark, regexes and JSON schemas.

The end-of-sequence tokens are allowed only where the grammar may end, and once it can take
nothing more the sequence ends there (`complete`): a reply cut by max_tokens is never closed
by us, so it ends with finish_reason "length" and a client can tell it is unfinished.
"""
from __future__ import annotations

import json
import threading

import numpy as np

from .tokenizer import GGUFTokenizer

# Bound the work a hostile grammar can cause: llguidance's own limits on lexer and parser fuel
# hold per token; this bounds what a request may ask to be compiled.
MAX_GRAMMAR_CHARS = 200_000
# JSON's whitespace between tokens, bounded: a model may indent its reply, but cannot spend the
# whole of max_tokens on blanks (llama.cpp's JSON grammars bound it likewise)
JSON_WHITESPACE = r"[\n\t ]{0,20}"


class GrammarError(ValueError):
    """A grammar or schema that cannot be used; the message names the problem."""


def _ll():
    import llguidance  # imported on first use: `serve` without structured output never pays for it
    return llguidance


class TokenTable:
    """The vocabulary as llguidance sees it: each token's bytes, control tokens marked (so a
    grammar never spells them), and the end-of-sequence tokens. Built once per tokenizer
    (about 0.1 s for 49k tokens) and shared by every constraint."""

    _lock = threading.Lock()

    def __init__(self, tokenizer: GGUFTokenizer, n_vocab: int):
        ll = _ll()
        special = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]
        marked = set(special)
        tokens = [b"\xff" + tokenizer.tokens[i].encode() if i in marked else tokenizer.piece_bytes(i)
                  for i in range(tokenizer.vocab_size)]
        tokens += [b""] * (n_vocab - len(tokens))  # a head padded past the tokenizer's vocabulary

        class _Vocab:  # what llguidance's TokenizerWrapper reads
            eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eos_ids, default=0)
            bos_token_id = tokenizer.bos_id
            special_token_ids = special

            def __init__(self):
                self.tokens = tokens

            def __call__(self, s):
                text = s.decode("utf-8", "replace") if isinstance(s, bytes) else s
                return tokenizer.encode(text, add_bos=False, add_eos=False)

        ends = sorted(tokenizer.eos_ids) or [_Vocab.eos_token_id]
        self.n_vocab = n_vocab
        self.lt = ll.LLTokenizer(ll.TokenizerWrapper(_Vocab()), n_vocab=n_vocab, eos_token=ends)

    @classmethod
    def of(cls, tokenizer: GGUFTokenizer, n_vocab: int) -> "TokenTable":
        with cls._lock:
            cached = getattr(tokenizer, "_token_table", None)
            if cached is None or cached.n_vocab != n_vocab:
                cached = tokenizer._token_table = cls(tokenizer, n_vocab)
            return cached


def grammar_for(*, response_format: dict | None = None, json_schema=None, grammar: str | None = None,
                regex: str | None = None) -> str | None:
    """One llguidance grammar from a request's fields (at most one of them), or None when the
    request is not constrained. Raises GrammarError naming the field and the problem."""
    ll = _ll()
    given = [(name, v) for name, v in (("response_format", response_format), ("json_schema", json_schema),
                                       ("grammar", grammar), ("regex", regex)) if v is not None]
    if response_format is not None and response_format.get("type") == "text":
        given = [(n, v) for n, v in given if n != "response_format"]
    if not given:
        return None
    if len(given) > 1:
        raise GrammarError(f"{given[0][0]} and {given[1][0]}: give one constraint, not several")
    name, value = given[0]
    if name == "response_format":
        kind = value.get("type")
        if kind == "json_object":
            schema = {"type": "object"}
        elif kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise GrammarError("response_format.json_schema: give {\"name\": ..., \"schema\": {...}}")
            schema, name = spec["schema"], "response_format.json_schema.schema"
        else:
            raise GrammarError(f"response_format.type: {kind!r} is not one of 'text', 'json_object', 'json_schema'")
        return _from_schema(ll, schema, name)
    if name == "json_schema":
        return _from_schema(ll, value, name)
    if not isinstance(value, str) or not value:
        raise GrammarError(f"{name}: give a non-empty string")
    if len(value) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{name}: {len(value)} characters, more than {MAX_GRAMMAR_CHARS}")
    if name == "regex":
        return _checked(ll, ll.LLMatcher.grammar_from_regex(value), name)
    try:  # GBNF as llama.cpp takes it, or Lark
        return _checked(ll, ll.grammar_from("gbnf", value), name)
    except GrammarError:
        raise
    except Exception as e:  # the GBNF converter's own parse errors
        raise GrammarError(f"{name}: {' '.join(str(e).split())}") from None


def _from_schema(ll, schema, name: str) -> str:
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{name}: a JSON schema is an object, not {type(schema).__name__}")
    if len(json.dumps(schema)) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{name}: more than {MAX_GRAMMAR_CHARS} characters")
    try:
        g = ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": JSON_WHITESPACE})
    except ValueError as e:
        raise GrammarError(f"{name}: {' '.join(str(e).split())}") from None
    return _checked(ll, g, name)


def _checked(ll, g: str, name: str) -> str:
    failed, messages = ll.LLMatcher.validate_grammar_with_warnings(g)
    if failed:
        raise GrammarError(f"{name}: {' '.join((messages or ['invalid'])[0].split())}"[:500])
    return g


class Constraint:
    """One sequence's grammar state: which tokens may come next, and the tokens taken so far."""

    def __init__(self, table: TokenTable, grammar: str):
        ll = _ll()
        self.n = table.n_vocab
        self.m = ll.LLMatcher(table.lt, grammar, log_level=0)
        if self.m.is_error():
            raise GrammarError(" ".join(self.m.get_error().split())[:500])
        self.bits = np.full((self.n + 31) // 32, -1, dtype=np.int32)

    def restrict(self, logits: np.ndarray) -> np.ndarray:
        """The logits with every token the grammar forbids next set to -inf."""
        self.m.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)  # releases the GIL
        if not self.bits.any():
            raise GrammarError(f"no token can continue the grammar: {self.m.get_error() or 'dead end'}")
        k = min(self.n, len(logits))
        ok = np.unpackbits(self.bits.view(np.uint8), bitorder="little", count=k).view(bool)
        out = np.full(len(logits), -np.inf, dtype=np.float32)
        np.copyto(out[:k], logits[:k], where=ok)  # 10x quicker than indexing by ok on a 262k vocabulary
        return out

    def accept(self, token: int) -> None:
        if not self.m.consume_token(token):
            raise GrammarError(f"token {token} does not continue the grammar: {self.m.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar can take nothing more than the end of the sequence."""
        return self.m.is_stopped()
