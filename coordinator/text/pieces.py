"""A vocabulary's pieces held compactly, and the sentencepiece-kind encoder built on them.

`Pieces`: every piece's UTF-8 bytes in one buffer with an offset table, read as a sequence of
str. 262144 Python strings (Gemma 3's vocabulary) were 26 MB of the coordinator; this is 3.5.

`SentencePieceBPE`: GGUF's "llama" tokenizer (pieces spelled with "\u2581" for a space, bytes
as "<0xXX>" pieces, merges generated from scores or given), encoding and decoding as the
`tokenizers` pipeline transformers' GGUF loader builds for it does: the vocabulary's added
pieces (control and user-defined) cut out of the text first, leftmost and then longest; each
remaining stretch one word, spaces spelled "\u2581", the first stretch of the text (not one
after an added piece) given a "\u2581" in front; the word merged by coordinator/text/bpe_merge.c;
decoding the pieces' text with byte runs joined. The library's own BPE held Gemma 3's vocabulary
in 110 MB of hash maps; bpe_merge.c holds it in 3 (see its header). tests/test_tokenizer.py
holds the two against each other.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from . import _bpe

SPACE = "\u2581"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Pieces(Sequence):
    """The pieces of a vocabulary, by id, as str."""

    def __init__(self, strings: Iterable[str]):
        encoded = [s.encode() for s in strings]
        self.offsets = np.zeros(len(encoded) + 1, np.uint32)
        np.cumsum([len(e) for e in encoded], out=self.offsets[1:])
        self.blob = b"".join(encoded)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return self.utf8(i).decode()

    def __iter__(self) -> Iterator[str]:
        o, blob = self.offsets.tolist(), self.blob
        return (blob[a:b].decode() for a, b in zip(o, o[1:]))

    def utf8(self, i: int) -> bytes:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"token id {i} is outside the vocabulary of {n}")
        i %= n
        return self.blob[int(self.offsets[i]):int(self.offsets[i + 1])]

    def longest_utf8(self) -> int:
        return int(np.diff(self.offsets).max()) if len(self) else 0


class SentencePieceBPE:
    """encode / decode / token_id for a sentencepiece-kind vocabulary (module docstring).
    `merges`: the file's merges, int32 (m, 2) piece-id pairs, first merged first; or `scores`
    (float32, one per piece): the merges transformers generates from them, in its order, found
    by bpe_merge.c as pairs are met (no table: Gemma 3's would be 514847 merges). `added`: the
    pieces cut out of text whole, text -> id; `special`: the added ids decode may skip."""

    def __init__(self, pieces: Pieces, added: dict[str, int], special: Iterable[int], add_prefix: bool,
                 unk_id: int | None, merges: np.ndarray | None = None, scores: np.ndarray | None = None):
        self.pieces = pieces
        byte_ids = np.full(256, -1, np.int32)
        for b in range(256):
            byte_ids[b] = self._find(pieces, f"<0x{b:02X}>")
        unk = -1 if unk_id is None else unk_id
        if merges is not None:
            self._model = _bpe.bpe_new(pieces.blob, pieces.offsets, byte_ids, unk, True,
                                       np.ascontiguousarray(merges, np.int32))
        else:
            self.scores = np.ascontiguousarray(scores, np.float32)  # held by the model, kept alive here too
            self._model = _bpe.bpe_new_scored(pieces.blob, pieces.offsets, byte_ids, unk, True, self.scores)
        self.added = added
        self.special_ids = frozenset(special)
        self.add_prefix = add_prefix
        # where an added piece may start: by its first two characters (one for a one-character
        # piece), the lengths to try, longest first. Gemma 3's added pieces include runs of 2 to
        # 31 spaces, newlines and tabs: tried at every space, text took 5x the library's time.
        lengths: dict[str, set[int]] = {}
        for text in added:
            lengths.setdefault(text[:2], set()).add(len(text))
        self._lengths = {p: sorted(ls, reverse=True) for p, ls in lengths.items()}
        prefixes = "|".join(map(re.escape, sorted(lengths, key=len, reverse=True)))
        self._starts = re.compile(f"(?=(?:{prefixes}))", re.S) if lengths else None

    @staticmethod
    def _find(pieces: Pieces, text: str) -> int:
        # only at build (256 byte pieces): a scan of the buffer, no table yet
        needle = text.encode()
        at = pieces.blob.find(needle)
        while at >= 0:
            i = int(np.searchsorted(pieces.offsets, at, side="right")) - 1
            if pieces.offsets[i] == at and pieces.offsets[i + 1] == at + len(needle):
                return i
            at = pieces.blob.find(needle, at + 1)
        return -1

    def token_id(self, text: str) -> int | None:
        i = _bpe.bpe_piece(self._model, text.encode("utf-8", "replace"))
        return None if i < 0 else i

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        for start, end, piece in self._added_spans(text):
            if start > pos:
                ids += self._word(text[pos:start], pos == 0)
            ids.append(piece)
            pos = end
        if pos < len(text):
            ids += self._word(text[pos:], pos == 0)
        return ids

    def _added_spans(self, text: str):
        if self._starts is None:
            return
        done = 0
        for m in self._starts.finditer(text):
            s = m.start()
            if s < done:
                continue
            for n in self._lengths.get(text[s:s + 2], []) + self._lengths.get(text[s], []):
                piece = self.added.get(text[s:s + n])
                if piece is not None:
                    yield s, s + n, piece
                    done = s + n
                    break

    def _word(self, text: str, first: bool) -> list[int]:
        text = text.replace(" ", SPACE)
        if first and self.add_prefix and not text.startswith(SPACE):
            text = SPACE + text
        return _bpe.bpe_encode(self._model, text.encode("utf-8", "replace"))

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The pieces' text, "\u2581" as a space, each run of byte pieces one UTF-8 string (a
        run that is not valid UTF-8: one U+FFFD per byte, as the library's ByteFallback)."""
        out: list[str] = []
        run = bytearray()
        for i in ids:
            if skip_special and i in self.special_ids:
                continue
            piece = self.pieces.utf8(i)
            m = _BYTE_PIECE.fullmatch(piece.decode()) if piece[:3] == b"<0x" else None
            if m:
                run.append(int(m.group(1), 16))
                continue
            if run:
                out.append(_utf8_run(run))
                run.clear()
            out.append(piece.decode().replace(SPACE, " "))
        if run:
            out.append(_utf8_run(run))
        return "".join(out)


def _utf8_run(run: bytearray) -> str:
    try:
        return run.decode()
    except UnicodeDecodeError:
        return "\ufffd" * len(run)
