"""Open a GGUF (or PowerInfer PWRI) file with gguf-py and validate it up front.

Everything that can be wrong with a file is checked here, so that callers get one clear
ModelFileError naming the file and the reason instead of a traceback from numpy later.
"""
from __future__ import annotations

import mmap
import os
import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES
from gguf.gguf_reader import ReaderField

from .errors import ModelFileError
from .gguf_check import check_layout, skip_metadata_value

GGUF_MAGIC = b"GGUF"
PWRI_MAGIC = b"PWRI"  # PowerInfer writes this magic; the layout after it is plain GGUF

# Types a run can take: every type gguf-py dequantizes (the float ones and every quantized block
# type it knows). Those without a native kernel are converted at load into one that has
# (sparsecore.tensors.conversion); the rest (I8..F64, Q1_0, ...) are refused up front in one line.
SUPPORTED_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16} | {
    t for t in GGMLQuantizationType if t.name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                                                   "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                                                   "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4",
                                                   "NVFP4")}


class _Truncated(Exception):
    def __init__(self, name: str, end: int, size: int):
        self.name, self.end, self.size = name, end, size


# What a process that turns no text into tokens never reads: the vocabulary arrays are most of
# a header (SmolLM2's 49152 tokens and 48900 merges: 70 MB of numpy views and 0.4 s to build in
# each process), so the workers open the file without them (open_gguf(vocabulary=False)).
VOCABULARY_KEYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                             "tokenizer.ggml.merges"})


# Arrays longer than this are decoded when read (_LazyArray), not when the header is parsed:
# gguf-py makes a numpy view per element (two per string), 0.55 s for a 49152-token
# vocabulary's four arrays, paid before anything else can start (time to first token).
LAZY_ARRAY = 256
_NUMERIC = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
            GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f",
            GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
            GGUFValueType.BOOL: "?"}


class _LazyArray(ReaderField):
    """A long array of strings or numbers, as gguf-py's field but with no parts: contents()
    decodes it from the file's bytes on the first call (UTF-8, strict, as gguf-py's), then
    keeps the list; `data` has an entry per element, as there."""

    def contents(self, index_or_slice: int | slice = slice(None)):
        values = self.__dict__.get("_values")
        if values is None:
            buf, pos, endian = self._where
            n, sub = len(self.data), self.types[-1]
            if sub == GGUFValueType.STRING:
                # through a memoryview: no ndarray slice and bytes copy per string (half the time)
                mv = memoryview(buf).cast("B")
                length = struct.Struct(endian + "Q").unpack_from
                values = []
                append = values.append
                for _ in range(n):
                    (k,) = length(mv, pos)
                    pos += 8
                    append(str(mv[pos:pos + k], "utf-8"))
                    pos += k
            else:
                values = list(struct.unpack_from(f"{endian}{n}{_NUMERIC[sub]}", buf, pos))
            self._values = values
        return values[index_or_slice]

    def forget(self) -> None:
        """Drops the decoded list (decoded again on the next contents())."""
        self.__dict__.pop("_values", None)


def release_header(reader: GGUFReader) -> None:
    """What a process holds of the file's header once it has read what it needs (the tokenizer
    built, the shards loaded) goes: the decoded vocabulary arrays (VOCABULARY_KEYS: Gemma 3's
    262144 tokens, scores and types as Python lists were 36 MB the tokenizer keeps in its own
    form), and the header's pages from this process's resident memory (11 MB of it; they stay in
    the page cache and fault back in if a field is read again)."""
    for key in VOCABULARY_KEYS:
        field = reader.fields.get(key)
        if isinstance(field, _LazyArray):
            field.forget()
    data = getattr(reader, "data", None)
    base = getattr(data, "_mmap", None)
    if isinstance(base, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED") and reader.tensors:
        end = min(int(t.data_offset) for t in reader.tensors) // mmap.PAGESIZE * mmap.PAGESIZE
        if end:
            base.madvise(mmap.MADV_DONTNEED, 0, end)


def _lazy_array(buf, key_offset: int, name: str, pos: int, endian: str) -> tuple[_LazyArray | None, int]:
    """At `pos`, a value's type: a long array of strings or numbers becomes a _LazyArray
    (with the offset after it), anything else (None, pos) for gguf-py to parse."""
    (vtype,) = struct.unpack_from(endian + "I", buf, pos)
    if vtype != GGUFValueType.ARRAY:
        return None, pos
    sub, n = struct.unpack_from(endian + "IQ", buf, pos + 4)
    if n <= LAZY_ARRAY or (sub != GGUFValueType.STRING and sub not in _NUMERIC):
        return None, pos
    field = _LazyArray(key_offset, name, [], range(n), [GGUFValueType.ARRAY, GGUFValueType(sub)])
    field._where = (buf, pos + 16, endian)
    return field, pos + 16


class _CheckedReader(GGUFReader):
    """Checks that every tensor lies inside the file before gguf-py builds views of it (it
    would fail with a reshape error that says nothing about truncation).

    It also reads the header through a plain ndarray view of the memory map: gguf-py slices
    its np.memmap once or twice per string, and a memmap slice costs ~2 us of bookkeeping, so a
    49152-token vocabulary took 2.2 s to parse in every process (the same bytes, 0.4 s here)."""

    _itemsize: dict = {}
    skip_keys: frozenset = frozenset()  # metadata stepped over, not parsed (VOCABULARY_KEYS)
    source = "GGUF file"  # its path, for the errors of that step

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)  # same buffer, no memmap subclass
        dt = np.dtype(dtype)
        count = int(count)
        arr = plain[offset:offset + dt.itemsize * count].view(dt)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _build_fields(self, offs, count):
        endian = "<" if (self.byte_order == "I") == (sys.byteorder == "little") else ">"
        plain = self.data.view(np.ndarray)
        for _ in range(count):
            klen, kdata = self._get_str(offs)
            key = bytes(kdata).decode("utf-8", "replace")
            value = offs + 8 + len(kdata)
            if key in self.skip_keys:
                offs = skip_metadata_value(self.source, self.data, value, endian, key)
                continue
            lazy, _ = _lazy_array(plain, offs, key, value, endian)
            if lazy is None:
                offs = super()._build_fields(offs, 1)
                continue
            # check_layout bounded every count and length in the header before this parse
            offs = skip_metadata_value(self.source, self.data, value, endian, key)
            self._push_field(lazy, skip_sum=True)
        return offs

    def _build_tensors(self, start_offs, fields):
        size = len(self.data)
        for f in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = f.parts
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
            except (ValueError, KeyError):
                continue  # unknown type: let gguf-py report it
            end = int(start_offs + offset_tensor[0]) + int(np.prod(dims)) * type_size // block
            if end > size:
                raise _Truncated(bytes(name_data).decode("utf-8", "replace"), end, size)
        return super()._build_tensors(start_offs, fields)


class _PWRIReader(_CheckedReader):
    """GGUFReader refuses PowerInfer's magic; report the GGUF magic for the first word only."""

    def _get(self, offset, dtype, count=1, override_order=None):
        if offset == 0 and override_order == "<":
            return np.frombuffer(GGUF_MAGIC, dtype=np.uint32)
        return super()._get(offset, dtype, count, override_order)


def read_magic(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


# The last files opened in this process, by identity (device, inode, size, mtime): the CLI's
# checks, its prompt count and the engine read the same header once instead of three times
# (half a second each for SmolLM2's; most of `generate -n 1`'s start-up beyond imports).
_OPENED: dict[tuple, GGUFReader] = {}
_KEEP = 2


def open_gguf(path: str | os.PathLike, vocabulary: bool = True) -> GGUFReader:
    """Return a GGUFReader for `path`, or raise ModelFileError saying what is wrong.
    vocabulary=False: without the VOCABULARY_KEYS fields (a process that tokenizes nothing),
    unless this process parsed the whole header already, which then serves."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory, expected a .gguf file")
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, vocabulary)
    if key in _OPENED:
        return _OPENED[key]
    if not vocabulary and key[:-1] + (True,) in _OPENED:  # the whole header serves too
        return _OPENED[key[:-1] + (True,)]
    reader = _open(path, vocabulary)
    _OPENED[key] = reader
    while len(_OPENED) > _KEEP:
        del _OPENED[next(iter(_OPENED))]
    return reader


def _open(path: Path, vocabulary: bool = True) -> GGUFReader:
    magic = read_magic(path)
    if magic not in (GGUF_MAGIC, PWRI_MAGIC):
        raise ModelFileError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    reader_cls = _PWRIReader if magic == PWRI_MAGIC else _CheckedReader
    if not vocabulary:
        reader_cls = type(reader_cls.__name__, (reader_cls,), {"skip_keys": VOCABULARY_KEYS, "source": str(path)})
    _check_layout(path)  # gguf-py trusts every count in the header: bound them first
    try:
        reader = reader_cls(path, "r")
    except _Truncated as t:
        raise ModelFileError(
            f"{path}: truncated: tensor {t.name} needs bytes up to {t.end} but the file has {t.size}") from None
    except Exception as e:  # gguf-py raises ValueError/IndexError/... on a malformed header
        size = path.stat().st_size
        raise ModelFileError(f"{path}: malformed or truncated GGUF header ({size} bytes): {e}") from None
    check_tensor_extents(path, reader)
    return reader


def _check_layout(path: Path) -> None:
    size = path.stat().st_size
    if size < 24:
        raise ModelFileError(f"{path}: truncated GGUF header ({size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        check_layout(path, buf)


def tensor_nbytes(t) -> int:
    block, type_size = GGML_QUANT_SIZES[t.tensor_type]
    n = int(np.prod([int(d) for d in t.shape]))
    return n // block * type_size


def check_tensor_extents(path: Path, reader: GGUFReader) -> None:
    """A truncated file still parses its header; catch tensors that run past the end."""
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + tensor_nbytes(t)
        if end > size:
            raise ModelFileError(
                f"{path}: truncated: tensor {t.name} needs bytes up to {end} but the file has {size}")


def check_supported_types(path: Path, reader: GGUFReader, names) -> None:
    by_name = {t.name: t for t in reader.tensors}
    for name in names:
        t = by_name[name]
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ModelFileError(
                f"{path}: tensor {name} has type {t.tensor_type.name}, which sparseinfer does not support "
                f"(supported: {', '.join(sorted(x.name for x in SUPPORTED_TYPES))})")


def field_value(reader: GGUFReader, key: str, default=None):
    """Decoded value of a metadata field (str, number, or list), or `default` when absent."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()
