"""Tokenizer built from a GGUF file's own vocabulary.

A GGUF carries no tokenizer.json, only llama.cpp's `tokenizer.ggml.*` metadata. We rebuild the
`tokenizers` pipeline transformers' GGUF loader builds
(transformers/integrations/gguf/gguf_tokenizer_mapping.py), so ids match
`AutoTokenizer.from_pretrained(dir, gguf_file=name)` without importing transformers:

- "gpt2": byte-level BPE from tokens + merges, split regex chosen by `tokenizer.ggml.pre`, in the
  HF `tokenizers` library.
- "llama": sentencepiece-style BPE with byte fallback; merges come from the file or are derived
  from the token scores the way transformers' `generate_merges` does. The same pipeline, in
  coordinator/text/pieces.py and its merge loop in C: the library held Gemma 3's 262144 pieces
  and 514847 merges in 110 MB, more than a third of the 270M model's weights.

transformers' GGUF loader is the exact oracle, so "smollm" is split like plain GPT-2 as it does
(llama.cpp isolates digits first, which changes ids where whitespace meets digits: "   8").
StarCoder-style `pre` values do isolate digits. One deliberate difference, following llama.cpp:
`add_space_prefix = false` is honoured (transformers always prepends "▁").

Also here: `chat_template_from_reader`, the file's chat template string (its rendering:
coordinator/text/chat_template.py, which imports jinja2 only for a run that renders one).
"""

from __future__ import annotations

import codecs
import logging
import re
from collections.abc import Iterable
from itertools import chain, repeat

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from sparsecore.gguf_file import release_header

from .pieces import Pieces, SentencePieceBPE

log = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType)
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> split regex, as in transformers' GGUF_PRE_TOKENIZER_SPLITS.
_PRE_SPLITS = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}
# GPT-2 splitting after a first pass that isolates each digit (llama.cpp's "\p{N}").
# "smollm" is left out on purpose: transformers' GGUF loader (our exact oracle) splits it
# like plain GPT-2, which differs from llama.cpp only where whitespace meets digits.
_DIGIT_SPLIT_PRES = {"starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}

# Texts llama.cpp treats as end of generation when the vocabulary has them.
_END_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
               "<|eom_id|>", "<EOT>", "<|end_of_text|>")

# harmony's ends of a reply: the final answer's, and a tool call's (the caller runs it and comes back)
_HARMONY_ENDS = ("<|return|>", "<|call|>")

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level vocabularies are spelled in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Merges a scored vocabulary implies: every split of a token into two known tokens, best
    score first. Same order as transformers' `generate_merges`, which its ids depend on."""
    merges = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


class _Fields:
    """Typed access to `tokenizer.ggml.*` values, with errors that name the field."""

    def __init__(self, reader: gguf.GGUFReader):
        self.reader = reader

    def get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as e:
            raise ValueError(f"{key} is unreadable: {e}") from e

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ValueError(f"{key} missing")
        return value

    def string_list(self, key: str, required: bool = True) -> list[str] | None:
        value = self.require(key) if required else self.get(key)
        if value is None:
            return None
        # by the elements' types (a few), not element by element: 0.03 s for a 49152-token vocabulary
        if not isinstance(value, list) or not all(issubclass(t, str) for t in set(map(type, value))):
            raise ValueError(f"{key} must be an array of strings")
        return value

    def number_list(self, key: str, n: int) -> list | None:
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or len(value) != n or (n and isinstance(value[0], str)):
            raise ValueError(f"{key} must be an array of {n} numbers, one per token")
        return value

    def token_id(self, key: str, n: int) -> int | None:
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, int) or not 0 <= value < n:
            raise ValueError(f"{key} = {value!r} is not a token id below {n}")
        return value


CHAT_TEMPLATE_KEY = "tokenizer.chat_template"


def chat_template_from_reader(reader: gguf.GGUFReader) -> str | None:
    """The file's chat template, or None where it has none; ValueError where it is not a string."""
    field = reader.fields.get(CHAT_TEMPLATE_KEY)
    if field is None:
        return None
    value = field.contents()
    if not isinstance(value, str):
        raise ValueError(f"{CHAT_TEMPLATE_KEY} must be a string")
    return value or None


class _Library:
    """A `tokenizers` Tokenizer behind the encoder interface SentencePieceBPE has."""

    def __init__(self, tk: Tokenizer):
        self.tk = tk
        self.special_ids = frozenset(i for i, t in tk.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special)

    def token_id(self, text: str) -> int | None:
        return self.tk.token_to_id(text)


class GGUFTokenizer:
    def __init__(self, encoder: _Library | SentencePieceBPE, tokens: Pieces, model: str, *, bos_id, eos_id,
                 eos_ids: Iterable[int], add_bos: bool, add_eos: bool, strip_space: bool):
        self._enc = encoder
        self.tokens = tokens  # as the GGUF spells them
        self.model = model
        self.bos_id: int | None = bos_id
        self.eos_id: int | None = eos_id
        self.eos_ids: frozenset[int] = frozenset(eos_ids)
        self.add_bos = add_bos
        self.add_eos = add_eos
        self._strip_space = strip_space  # decode drops the prefix space sentencepiece added
        self._special_ids = encoder.special_ids
        self._byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
        self._piece_bytes: dict[int, bytes] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def longest_token_chars(self) -> int:
        """An upper bound on the characters one token decodes to (its spelling's UTF-8 bytes,
        plus a space a SentencePiece marker may stand for): a text of n characters needs at
        least n / this many tokens, which bounds a prompt's length before tokenizing it."""
        if not hasattr(self, "_longest"):
            self._longest = max(1, self.tokens.longest_utf8()) + 1
        return self._longest

    @property
    def bos_token(self) -> str:
        return "" if self.bos_id is None else self.tokens[self.bos_id]

    @property
    def eos_token(self) -> str:
        return "" if self.eos_id is None else self.tokens[self.eos_id]

    @classmethod
    def from_reader(cls, reader: gguf.GGUFReader) -> GGUFTokenizer:
        """Raises ValueError (one line) for any defect of the file's tokenizer metadata: the
        tokenizers library and odd value types raise other exceptions, which callers (the
        engine, the CLI) would otherwise show as a traceback."""
        cached = getattr(reader, "_sparseinfer_tokenizer", None)  # one reader, one tokenizer (open_gguf shares readers)
        if cached is not None:
            return cached
        try:
            tok = cls._from_reader(reader)
            release_header(reader)
            try:
                reader._sparseinfer_tokenizer = tok
            except AttributeError:
                pass
            return tok
        except ValueError as e:
            raise ValueError(" ".join(str(e).split())) from None
        except Exception as e:
            raise ValueError(f"{type(e).__name__}: {' '.join(str(e).split())}"[:500]) from None

    @classmethod
    def _from_reader(cls, reader: gguf.GGUFReader) -> GGUFTokenizer:
        fields = _Fields(reader)
        model = fields.require("tokenizer.ggml.model")
        tokens = fields.string_list("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("tokenizer.ggml.tokens is empty")
        n = len(tokens)
        token_type = fields.number_list("tokenizer.ggml.token_type", n) or [1] * n

        bos_id = fields.token_id("tokenizer.ggml.bos_token_id", n)
        eos_id = fields.token_id("tokenizer.ggml.eos_token_id", n)
        named = [fields.token_id(f"tokenizer.ggml.{k}_token_id", n) for k in ("unknown", "padding")]
        if model == "gpt2":
            tk, control_ok = _byte_level(fields, tokens)
            add_bos_default, strip_space = False, False
        elif model == "llama":
            add_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
            control_ok = lambda t: True  # noqa: E731
            add_bos_default, strip_space = True, add_prefix
        else:
            raise ValueError(f"tokenizer.ggml.model {model!r} is not supported (supported: 'gpt2', 'llama')")

        # Control tokens become special (matched whole in text, skippable on decode); so do the
        # bos/eos/unk/pad tokens, as transformers registers those as special tokens too.
        special = {tokens[i]: i for i, ty in enumerate(token_type) if ty == _CONTROL and control_ok(tokens[i])}
        special.update((tokens[i], i) for i in (bos_id, eos_id, *named) if i is not None and tokens[i] not in special)
        user = {tokens[i]: i for i, ty in enumerate(token_type) if ty == _USER_DEFINED}
        if model == "gpt2":
            tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
            tk.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
            encoder = _Library(tk)
        else:
            encoder = _sentencepiece(fields, tokens, add_prefix, {**user, **special}, special.values())

        ends = {eos_id} if eos_id is not None else set()
        for key in ("eot", "eom"):
            if (i := fields.token_id(f"tokenizer.ggml.{key}_token_id", n)) is not None:
                ends.add(i)
        ends.update(i for i, t in enumerate(tokens) if t in _END_TOKENS)
        if "<|channel|>" in special:  # gpt-oss's harmony: <|end|> closes one message of several in a reply
            ends = {i for i in ends if tokens[i] != "<|end|>"} | {special[t] for t in _HARMONY_ENDS if t in special}

        pieces = encoder.pieces if isinstance(encoder, SentencePieceBPE) else Pieces(tokens)
        return cls(encoder, pieces, model, bos_id=bos_id, eos_id=eos_id, eos_ids=ends,
                   add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                   add_eos=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
                   strip_space=strip_space)

    def encode(self, text: str, add_bos: bool | None = None, add_eos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in it (e.g. "<|im_start|>") stay whole.
        BOS/EOS are added as the GGUF says unless given."""
        ids = self._enc.encode(text)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        text = self._enc.decode(ids, skip_special)
        if self._strip_space and text.startswith(" "):
            text = text[1:]  # the space sentencepiece put before the first word (the library's Strip)
        return text

    def token_id(self, text: str) -> int | None:
        """The id of the token spelled `text` (as the GGUF spells it), or None."""
        return self._enc.token_id(text)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def piece_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, as the decoder would produce them."""
        cached = self._piece_bytes.get(token_id)
        if cached is not None:
            return cached
        if not 0 <= token_id < len(self.tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary")
        piece = self.tokens[token_id]
        if self.model == "gpt2":
            try:
                out = bytes(self._byte_decoder[c] for c in piece)
            except KeyError:  # not byte-level spelled: the decoder keeps its UTF-8 bytes
                out = piece.encode()
        else:
            piece = piece.replace("\u2581", " ")
            m = _BYTE_TOKEN.fullmatch(piece)
            out = bytes([int(m.group(1), 16)]) if m else piece.encode()
        self._piece_bytes[token_id] = out
        return out


def _byte_level(fields: _Fields, tokens: list[str]):
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens stored as raw text (not byte-level spelled) get respelled, as transformers does;
    # when every character of the vocabulary is in the alphabet (one check), none is.
    if set("".join(tokens)) <= alphabet:
        vocab = dict(zip(tokens, range(len(tokens))))
    else:
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
                 for i, t in enumerate(tokens)}
    merges = _merges(fields, vocab, required=True)
    tk = _bpe(vocab, merges, fuse_unk=False, continuing_subword_prefix="", end_of_word_suffix="")
    pre = fields.get("tokenizer.ggml.pre")
    split = _PRE_SPLITS.get(pre)
    if split is not None:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _DIGIT_SPLIT_PRES:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ])
    else:
        if pre not in (None, "default", "gpt2"):
            log.info("tokenizer.ggml.pre %r has no known split; using GPT-2's", pre)
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel; transformers skips it.
    return tk, lambda t: set(t) <= alphabet


def _sentencepiece(fields: _Fields, tokens: list[str], add_prefix: bool, added: dict[str, int],
                   special: Iterable[int]) -> SentencePieceBPE:
    """The "llama" pipeline (coordinator/text/pieces.py): no unknown piece, as transformers'
    GGUF loader builds it (a character with neither a piece nor byte pieces is dropped). The
    file's merges where it has them; else the scores, whose merges transformers generates
    (generate_merges) and the merge loop finds as it goes: Gemma 3's 514847 took 2.6 s to
    generate and 12 MB to hold. A vocabulary the loop cannot take that way (a piece over 512
    bytes) has them generated."""
    pieces, options = Pieces(tokens), dict(added=added, special=special, add_prefix=add_prefix, unk_id=None)
    if "tokenizer.ggml.merges" in fields.reader.fields:
        vocab = {t: i for i, t in enumerate(tokens)}
        return SentencePieceBPE(pieces, merges=_pair_ids(vocab, _merges(fields, vocab, required=True)), **options)
    scores = fields.number_list("tokenizer.ggml.scores", len(tokens))
    if scores is None:
        raise ValueError("tokenizer.ggml.scores missing (needed when tokenizer.ggml.merges is absent)")
    if pieces.longest_utf8() <= MAX_SCORED_PIECE:
        return SentencePieceBPE(pieces, scores=np.array(scores, np.float32), **options)
    vocab = {t: i for i, t in enumerate(tokens)}
    return SentencePieceBPE(pieces, merges=_pair_ids(vocab, generate_merges(vocab, dict(zip(tokens, scores)))),
                            **options)


MAX_SCORED_PIECE = 512  # bpe_merge.c MAX_PIECE


def _pair_ids(vocab: dict[str, int], merges: list[tuple[str, str]]) -> np.ndarray:
    return np.array([(vocab[a], vocab[b]) for a, b in merges], np.int32).reshape(-1, 2)


def _merges(fields: _Fields, vocab: dict[str, int], required: bool) -> list[tuple[str, str]] | None:
    key = "tokenizer.ggml.merges"
    raw = fields.string_list(key, required=required)
    if raw is None:
        return None
    # split and checked a list at a time (0.04 s for 48900 merges, a loop took 0.14 s); the loop
    # below only finds the first bad merge to name it
    merges = list(map(tuple, map(str.split, raw, repeat(" "))))
    if set(map(len, merges)) <= {2} and vocab.keys() >= set(chain.from_iterable(merges)):
        return merges
    for i, (m, pair) in enumerate(zip(raw, merges)):
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab:
            raise ValueError(f"{key}[{i}] = {m!r} is not two vocabulary tokens separated by one space")
    raise AssertionError("unreachable: a merge failed the check above")


def _bpe(vocab, merges, **options) -> Tokenizer:
    return Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, **options))


class StreamDecoder:
    """Turns generated ids into text as they come, emitting only complete UTF-8 characters.

    The concatenated output equals `tokenizer.decode(all_ids, skip_special)` for valid UTF-8."""

    def __init__(self, tokenizer: GGUFTokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip_space = tokenizer._strip_space  # only the very first character of the output

    def push(self, token_id: int) -> str:
        if self._skip_special and self._tok.is_special(token_id):
            return ""
        return self._emit(self._utf8.decode(self._tok.piece_bytes(token_id)))

    def flush(self) -> str:
        return self._emit(self._utf8.decode(b"", final=True))

    def _emit(self, text: str) -> str:
        if text and self._strip_space:
            self._strip_space = False
            if text[0] == " ":
                text = text[1:]
        return text
