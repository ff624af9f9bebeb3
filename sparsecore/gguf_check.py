"""Validate a GGUF file from its header, before anything is allocated or looped over by a size
the file declares.

Two passes, each raising one ModelFileError that names the file, the field or tensor and the
value:

- check_layout(path, buf): a plain walk of the header bytes (struct, no gguf-py) run before
  gguf-py parses it. gguf-py loops over every declared array element and string without
  bounds, so a 4-byte change to a count would make it loop (and allocate) for hours; here every
  count is first compared with the bytes left in the file. It also checks the tensor table:
  known types, 1-4 positive dims, rows a whole number of blocks, offsets aligned, inside the
  file, non-overlapping, and each tensor's declared type filling exactly its slot up to the
  next tensor (a wrong type id changes the size, which no reshape would notice otherwise).
- check_model_metadata(path, reader, arch): the hyper-parameters against bounds and against
  the tensors' shapes, before read_config's values size anything (KV cache, rope tables,
  per-layer name lists).
"""
from __future__ import annotations

import math
import re
import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from .arch import ARCHS, EXPERT_GATING_FUNCS
from .errors import ModelFileError
from .kernels import _kernels

# GGUF value type id -> size of one scalar (the spec's fixed sizes)
_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MIN_KV = 8 + 4 + 1          # empty key, type, smallest value
_MIN_TENSOR = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one dim, type, offset
MAX_DIMS = 4                 # GGML_MAX_DIMS
MAX_NAME = 256               # ggml's is 64; be lenient, but never megabytes
MAX_KEY = 1 << 16
MAX_ALIGNMENT = 1 << 16

# Bounds on hyper-parameters: far above any released model, far below what would exhaust
# memory when something is sized by them (per-layer lists, rope tables, KV cache).
MAX_LAYERS = 4096
MAX_HIDDEN = 1 << 17
MAX_FF = 1 << 20
MAX_EXPERTS = 1 << 12
MAX_HEADS = 1 << 12
MAX_CONTEXT = 1 << 24

_INT_TYPES = {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
              GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64}
_FLOAT_TYPES = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}


def _fail(path, msg: str):
    raise ModelFileError(f"{path}: {msg}")


def skip_strings(buf, pos: int, size: int, count: int, big_endian: bool) -> int:
    """Where `count` GGUF strings starting at buf[pos] end, or -1 - (the offset of the first
    that does not fit in `size` bytes). buf: the header's bytes (a map, an array, bytes)."""
    a = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    return _kernels.skip_strings(a.__array_interface__["data"][0], pos, size, count, int(big_endian))


class _Walker:
    """Bounds-checked reads of the header; every failure names what was being read."""

    def __init__(self, path, buf, endian: str):
        self.path, self.buf, self.size, self.e = path, buf, len(buf), endian
        self.pos = 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            _fail(self.path, f"truncated or malformed GGUF header: {what} needs {n} bytes at offset "
                             f"{self.pos} but the file has {self.size}")

    def u32(self, what: str) -> int:
        self.need(4, what)
        v = struct.unpack_from(self.e + "I", self.buf, self.pos)[0]
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        v = struct.unpack_from(self.e + "Q", self.buf, self.pos)[0]
        self.pos += 8
        return v

    def string(self, what: str, limit: int) -> str:
        n = self.u64(what + " length")
        if n > limit:
            _fail(self.path, f"{what} has length {n} (limit {limit})")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            _fail(self.path, f"{what} is not UTF-8: {raw[:40]!r}")

    def skip_string(self, what: str) -> None:
        n = self.u64(what + " length")
        self.need(n, what)
        self.pos += n

    def skip_value(self, vtype: int, key: str, nested: bool = False) -> int | None:
        """Skip one value; return an unsigned scalar's value (for general.alignment)."""
        if vtype in _SCALAR_SIZE:
            size = _SCALAR_SIZE[vtype]
            self.need(size, f"metadata {key}")
            v = int.from_bytes(self.buf[self.pos:self.pos + size], "little" if self.e == "<" else "big")
            self.pos += size
            return v
        if vtype == _STRING:
            self.skip_string(f"metadata {key}")
            return None
        if vtype == _ARRAY and not nested:
            itype = self.u32(f"metadata {key} element type")
            count = self.u64(f"metadata {key} element count")
            left = self.size - self.pos
            if itype in _SCALAR_SIZE:
                if count * _SCALAR_SIZE[itype] > left:
                    _fail(self.path, f"metadata {key}: array of {count} elements does not fit in the "
                                     f"{left} bytes left in the file")
                self.pos += count * _SCALAR_SIZE[itype]
            elif itype == _STRING:
                if count * 8 > left:
                    _fail(self.path, f"metadata {key}: array of {count} strings does not fit in the "
                                     f"{left} bytes left in the file")
                # bounded: each string takes at least its 8-byte length. A vocabulary is most
                # of a header (98k strings in SmolLM2's): walked in C, and a string that does not
                # fit is skipped by skip_string, whose error names it.
                end = skip_strings(self.buf, self.pos, self.size, count, self.e == ">")
                if end < 0:
                    self.pos = -1 - end
                    self.skip_string(f"metadata {key} element")  # raises
                self.pos = end
            else:
                _fail(self.path, f"metadata {key}: unsupported array element type {itype}")
            return None
        _fail(self.path, f"metadata {key}: unknown value type {vtype}")


def skip_metadata_value(path, buf, pos: int, endian: str, key: str) -> int:
    """The offset after metadata `key`'s type and value, which start at `pos` (bounds-checked)."""
    w = _Walker(path, buf, endian)
    w.pos = pos
    w.skip_value(w.u32(f"metadata {key} type"), key)
    return w.pos


def check_layout(path: Path, buf) -> None:
    """Walk the header of the GGUF bytes `buf` (a memory map) and check the tensor table."""
    if len(buf) < 24:
        _fail(path, f"truncated GGUF header ({len(buf)} bytes)")
    # gguf-py's rule: a version whose low half is 0 was written in the other byte order
    endian = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
    w = _Walker(path, buf, endian)
    w.pos = 4
    version = w.u32("version")
    if version not in (2, 3):
        _fail(path, f"GGUF version {version} is not supported (2 or 3)")
    n_tensors = w.u64("tensor count")
    n_kv = w.u64("metadata count")
    if n_kv > (w.size - w.pos) // _MIN_KV:
        _fail(path, f"GGUF.kv_count = {n_kv}: more metadata entries than the file can hold")
    if n_tensors > (w.size - w.pos) // _MIN_TENSOR:
        _fail(path, f"GGUF.tensor_count = {n_tensors}: more tensors than the file can hold")

    alignment = 32
    keys: set[str] = set()
    for i in range(n_kv):
        key = w.string(f"metadata key #{i}", MAX_KEY)
        if key in keys:
            _fail(path, f"metadata {key} appears twice")
        keys.add(key)
        vtype = w.u32(f"metadata {key} type")
        v = w.skip_value(vtype, key)
        if key == "general.alignment":
            if vtype != int(GGUFValueType.UINT32) or not v or v & (v - 1) or v > MAX_ALIGNMENT:
                _fail(path, f"metadata general.alignment = {v}: must be a power of two up to "
                            f"{MAX_ALIGNMENT} stored as uint32")
            alignment = v

    tensors = []  # (offset, nbytes, name, type name)
    names: set[str] = set()
    for i in range(n_tensors):
        name = w.string(f"tensor name #{i}", MAX_NAME)
        if name in names:
            _fail(path, f"tensor {name} appears twice")
        names.add(name)
        n_dims = w.u32(f"tensor {name} n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            _fail(path, f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS})")
        dims = [w.u64(f"tensor {name} dims") for _ in range(n_dims)]
        raw_type = w.u32(f"tensor {name} type")
        offset = w.u64(f"tensor {name} offset")
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            _fail(path, f"tensor {name} has unknown type id {raw_type}")
        if any(d < 0 for d in dims):  # an empty tensor is legal (a gpuidx layer with no hot neuron)
            _fail(path, f"tensor {name} has dims {dims}: a dimension is negative")
        if dims[0] % block:
            _fail(path, f"tensor {name}: first dimension {dims[0]} is not a multiple of "
                        f"{qtype.name}'s block size {block}")
        n = math.prod(dims)  # Python ints: no overflow; the in-file check below bounds it
        tensors.append((offset, n // block * type_size, name, qtype.name, dims))

    data_start = -(-w.pos // alignment) * alignment
    size = w.size
    for offset, nbytes, name, tname, dims in tensors:
        if offset % alignment:
            _fail(path, f"tensor {name}: offset {offset} is not a multiple of the alignment {alignment}")
        end = data_start + offset + nbytes
        if data_start + offset > size or end > size:
            _fail(path, f"truncated: tensor {name} needs bytes up to {end} but the file has {size}")
    tensors.sort()
    for (o1, n1, a, t1, d1), (o2, _n2, b, _t2, _d2) in zip(tensors, tensors[1:]):
        if o1 + n1 > o2:
            _fail(path, f"tensor {a} ({t1}, dims {d1}, {n1} bytes at offset {o1}) overlaps tensor {b} "
                        f"at offset {o2}")
        # writers (gguf-py, ggml) pack tensors back to back, each padded to the alignment; a
        # larger hole means the declared type or dims do not describe the bytes there
        if o2 - (o1 + n1) >= alignment:
            _fail(path, f"tensor {a}: declared type {t1} with dims {d1} is {n1} bytes but its data "
                        f"runs {o2 - o1} bytes up to tensor {b}: type does not match the data")
    if tensors:
        o, n, a, t, d = tensors[-1]
        tail = size - (data_start + o + n)
        if tail >= alignment:
            _fail(path, f"tensor {a}: declared type {t} with dims {d} is {n} bytes but {n + tail} bytes "
                        f"follow it to the end of the file: type does not match the data")


# --------------------------------------------------------------------------- hyper-parameters

def _number(path, reader: GGUFReader, key: str, default, *, integer: bool):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            _fail(path, f"metadata field {key} is missing")
        return default
    kinds = _INT_TYPES if integer else _INT_TYPES | _FLOAT_TYPES
    if len(f.types) != 1 or f.types[0] not in kinds:
        shown = "/".join(t.name for t in f.types)
        _fail(path, f"metadata {key} has type {shown}, expected {'an integer' if integer else 'a number'}")
    return f.contents()


def _int(path, reader, key, default, lo, hi, why=""):
    v = _number(path, reader, key, default, integer=True)
    if not lo <= v <= hi:
        _fail(path, f"metadata {key} = {v}: must be " + (f"{lo}{why}" if lo == hi else f"in {lo}..{hi}{why}"))
    return int(v)


def _positive_float(path, reader, key, default):
    v = _number(path, reader, key, default, integer=False)
    if not (math.isfinite(v) and v > 0):
        _fail(path, f"metadata {key} = {v}: must be a finite positive number")
    return float(v)


_BLK = re.compile(r"blk\.(\d+)\.")


def check_model_metadata(path: Path, reader: GGUFReader, arch: str) -> None:
    """Hyper-parameters of a llama-layout model: bounds, and agreement with the tensor shapes
    (checked for the tensors present, so architectures with other tensor sets pass through)."""
    p = f"{arch}."
    n_layers = _int(path, reader, p + "block_count", None, 1, MAX_LAYERS)
    layers = {int(m.group(1)) for t in reader.tensors if (m := _BLK.match(t.name))}
    if layers != set(range(n_layers)):
        extra = sorted(layers - set(range(n_layers)))[:1]
        missing = sorted(set(range(n_layers)) - layers)[:1]
        detail = f"blk.{extra[0]} is present" if extra else f"blk.{missing[0]} is missing"
        _fail(path, f"metadata {p}block_count = {n_layers} does not match the tensors ({detail}; "
                    f"{len(layers)} blocks in the file)")
    hidden = _int(path, reader, p + "embedding_length", None, 1, MAX_HIDDEN)
    n_ff = _int(path, reader, p + "feed_forward_length", None, 1, MAX_FF)
    n_heads = _int(path, reader, p + "attention.head_count", None, 1, min(MAX_HEADS, hidden))
    n_kv = _int(path, reader, p + "attention.head_count_kv", n_heads, 1, n_heads)
    if n_heads % n_kv:
        _fail(path, f"metadata {p}attention.head_count_kv = {n_kv} does not divide head_count {n_heads}")
    if p + "attention.key_length" not in reader.fields and hidden % n_heads:
        _fail(path, f"metadata {p}attention.head_count = {n_heads} does not divide embedding_length {hidden}")
    head_dim = _int(path, reader, p + "attention.key_length", hidden // n_heads, 1, MAX_HIDDEN)
    v_dim = _int(path, reader, p + "attention.value_length", head_dim, 1, MAX_HIDDEN)
    rope_dim = _int(path, reader, p + "rope.dimension_count", head_dim, 2, head_dim,
                    f" (head dimension {head_dim})")
    if rope_dim % 2:
        _fail(path, f"metadata {p}rope.dimension_count = {rope_dim}: must be even")
    _positive_float(path, reader, p + "rope.freq_base", 10000.0)
    _positive_float(path, reader, p + "attention.layer_norm_rms_epsilon", 1e-5)
    _positive_float(path, reader, p + "attention.layer_norm_epsilon", 1e-5)  # falcon's LayerNorm
    _int(path, reader, p + "context_length", 2048, 1, MAX_CONTEXT)

    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    emb = shapes.get("token_embd.weight")
    if emb is None:
        _fail(path, "tensor token_embd.weight is missing")
    if len(emb) != 2 or emb[0] != hidden:
        _fail(path, f"tensor token_embd.weight has shape {emb}, expected [{hidden}, vocab] "
                    f"({p}embedding_length = {hidden})")
    vocab = emb[1]
    if p + "vocab_size" in reader.fields:
        _int(path, reader, p + "vocab_size", None, vocab, vocab, " (token_embd.weight's rows)")
    tok = reader.fields.get("tokenizer.ggml.tokens")
    if tok is not None and len(tok.data) != vocab:
        _fail(path, f"metadata tokenizer.ggml.tokens has {len(tok.data)} tokens but token_embd.weight "
                    f"has {vocab} rows")

    expect = {"output.weight": [hidden, vocab], "output_norm.weight": [hidden]}
    spec = ARCHS.get(arch)
    gate_in_up = spec is not None and spec.fused_gate_up
    full_qk = spec is not None and spec.qk_norm_full
    if spec is not None and spec.routed(p + "expert_count" in reader.fields):  # nothing sized from an unchecked count
        n_exp = _int(path, reader, p + "expert_count", None, 1, MAX_EXPERTS)
        _int(path, reader, p + "expert_used_count", None, 1, n_exp, f" ({p}expert_count = {n_exp})")
        # llama.cpp sizes smallthinker's experts by this key alone (0 without it)
        f_exp = _int(path, reader, p + "expert_feed_forward_length", None if spec.expert_ff_required else n_ff, 1, MAX_FF)
        if spec.gating_from_file:  # smallthinker: softmax or sigmoid, as the file says (llama.cpp has no default)
            gating = _int(path, reader, p + "expert_gating_func", None, min(EXPERT_GATING_FUNCS),
                          max(EXPERT_GATING_FUNCS), " (" + ", ".join(f"{k} {v}" for k, v in
                                                                     EXPERT_GATING_FUNCS.items()) + ")")
            if gating not in EXPERT_GATING_FUNCS:
                _fail(path, f"metadata {p}expert_gating_func = {gating}: must be one of {sorted(EXPERT_GATING_FUNCS)}")
        f_sh = 0
        if spec.shared_expert:  # the shared expert: each process runs the same multiple of its expert range
            f_sh = _int(path, reader, p + "expert_shared_feed_forward_length", None, f_exp, MAX_FF)
            if f_sh % f_exp:
                _fail(path, f"metadata {p}expert_shared_feed_forward_length = {f_sh}: must be a multiple of "
                            f"{p}expert_feed_forward_length = {f_exp}")
        for i in range(n_layers):
            b = f"blk.{i}."
            expect.update({b + "ffn_gate_inp.weight": [hidden, n_exp], b + "ffn_gate_exps.weight": [hidden, f_exp, n_exp],
                           b + "ffn_up_exps.weight": [hidden, f_exp, n_exp],
                           b + "ffn_down_exps.weight": [f_exp, hidden, n_exp]})
            if f_sh:
                expect.update({b + "ffn_gate_shexp.weight": [hidden, f_sh], b + "ffn_up_shexp.weight": [hidden, f_sh],
                               b + "ffn_down_shexp.weight": [f_sh, hidden]})
                gate = shapes.get(b + "ffn_gate_inp_shexp.weight")
                if gate is not None and gate not in ([hidden], [hidden, 1]):  # the converter keeps HF's (1, hidden)
                    _fail(path, f"tensor {b}ffn_gate_inp_shexp.weight has shape {gate}, expected [{hidden}] or "
                                f"[{hidden}, 1] ({p}embedding_length = {hidden})")
    for i in range(n_layers):
        b = f"blk.{i}."
        expect.update({
            b + "attn_norm.weight": [hidden], b + "ffn_norm.weight": [hidden],
            b + "attn_q.weight": [hidden, n_heads * head_dim],
            b + "attn_k.weight": [hidden, n_kv * head_dim],
            b + "attn_v.weight": [hidden, n_kv * v_dim],
            b + "attn_output.weight": [n_heads * v_dim, hidden],
            b + "ffn_gate.weight": [hidden, n_ff], b + "ffn_down.weight": [n_ff, hidden],
            b + "ffn_down_t.weight": [hidden, n_ff],
            # phi3 fuses gate and up into ffn_up (no ffn_gate), and Q, K, V into attn_qkv;
            # falcon has no gate at all
            b + "ffn_up.weight": [hidden, 2 * n_ff if gate_in_up else n_ff],
            b + "attn_qkv.weight": [hidden, n_heads * head_dim + n_kv * (head_dim + v_dim)],
            # Q/K norms: per head (qwen3, gemma3), or over every head at once (olmoe)
            b + "attn_q_norm.weight": [n_heads * head_dim if full_qk else head_dim],
            b + "attn_k_norm.weight": [n_kv * head_dim if full_qk else head_dim],
        })
    if spec is not None and spec.sliding_global_first:  # smallthinker's layer pattern: one period, 0 every layer sliding
        if p + "attention.sliding_window_pattern" in reader.fields:
            _int(path, reader, p + "attention.sliding_window_pattern", None, 0, MAX_LAYERS)
        if p + "rope.freq_base_swa" in reader.fields:
            _positive_float(path, reader, p + "rope.freq_base_swa", None)
    if spec is not None and spec.attn_sinks:  # gpt-oss: sinks, biases of the output and of the experts
        n_exp = _int(path, reader, p + "expert_count", None, 1, MAX_EXPERTS)
        f_exp = _int(path, reader, p + "expert_feed_forward_length", n_ff, 1, MAX_FF)
        for i in range(n_layers):
            b = f"blk.{i}."
            expect.update({b + "attn_sinks.weight": [n_heads], b + "attn_output.bias": [hidden],
                           b + "attn_q.bias": [n_heads * head_dim], b + "attn_k.bias": [n_kv * head_dim],
                           b + "attn_v.bias": [n_kv * v_dim], b + "post_attention_norm.weight": [hidden],
                           b + "ffn_gate_inp.bias": [n_exp], b + "ffn_gate_exps.bias": [f_exp, n_exp],
                           b + "ffn_up_exps.bias": [f_exp, n_exp], b + "ffn_down_exps.bias": [hidden, n_exp]})
    for name, want in expect.items():
        got = shapes.get(name)
        if got is not None and got != want:
            _fail(path, f"tensor {name} has shape {got}, expected {want} from the metadata "
                        f"(embedding_length {hidden}, feed_forward_length {n_ff}, head_count {n_heads}, "
                        f"head_count_kv {n_kv}, head dim {head_dim})")
