"""Tensor access by name: whole matrices, row subsets, column subsets, all as float32.

GGUF stores a matrix W (out x in) row-major with its quant blocks running along `in`, so a
row subset is a cheap slice of the memory-mapped blocks, while a column subset (the down
projection's neurons) needs the whole matrix dequantized (or PowerInfer's ffn_down_t).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from .arch import ARCHS
from .errors import ModelFileError
from .gguf_file import SUPPORTED_TYPES, field_value


def row_slice(t, name: str, start: int, stop: int):
    """Rows start..stop of a 2-D reader tensor as a tensor of its own (a view of the same
    memory-mapped blocks: nothing is copied), named `name`."""
    n_rows = int(np.prod(t.shape[1:]))
    data = np.asarray(t.data).reshape(n_rows, -1)[start:stop]
    shape = np.array(t.shape, copy=True)
    shape[1:] = 1
    shape[1] = stop - start
    return t._replace(name=name, shape=shape, n_elements=int(shape[0]) * (stop - start),
                      n_bytes=data.nbytes, data_offset=int(t.data_offset) + start * data.strides[0], data=data)


CONVERT_ROWS = 1024  # rows dequantized at a time by requantize: a few MB of float32 scratch


def requantize(raw: np.ndarray, src: GGMLQuantizationType, dst: GGMLQuantizationType) -> np.ndarray:
    """Rows of `src` blocks (rows, bytes) dequantized by gguf-py and quantized to `dst` by
    gguf-py, a chunk of rows at a time (never the whole matrix in float32)."""
    rows = raw.shape[0]
    cols = raw.shape[1] // GGML_QUANT_SIZES[src][1] * GGML_QUANT_SIZES[src][0]
    out = np.empty((rows, cols // GGML_QUANT_SIZES[dst][0] * GGML_QUANT_SIZES[dst][1]), np.uint8)
    with np.errstate(all="ignore"):  # a hostile file's inf scales stay inf, without numpy's warnings
        for r in range(0, rows, CONVERT_ROWS):
            part = dequantize(raw[r:r + CONVERT_ROWS], src).astype(np.float32, copy=False).reshape(-1, cols)
            out[r:r + CONVERT_ROWS] = quantize(part, dst).reshape(len(part), -1)
    return out


def conversion(t) -> tuple[GGMLQuantizationType, object] | None:
    """(native type, function of the raw rows) for a quantized tensor type the kernels cannot
    read (the i-quants of 1 and 2 bits, TQ1_0/TQ2_0), else None: requantized to the nearest
    native type of at most 8 bits that keeps their precision: Q5_0 (5.5 bits per weight) for the
    types of at most 4, else Q8_0 (8.5). Never float32."""
    from .kernels import supports

    tt = t.tensor_type
    if supports(tt) or len(t.shape) not in (2, 3) or tt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                                                   GGMLQuantizationType.BF16):
        return None
    block, size = GGML_QUANT_SIZES[tt]
    q5 = GGMLQuantizationType.Q5_0
    dst = q5 if 8 * size / block <= 4.0 and supports(q5) else GGMLQuantizationType.Q8_0
    return dst, lambda raw, src=tt, dst=dst: requantize(raw, src, dst)


def converted_size(t) -> tuple[GGMLQuantizationType, int] | None:
    """(type, bytes) tensor t takes once converted at load (conversion), or None: read as it is."""
    conv = conversion(t)
    if conv is None:
        return None
    block, size = GGML_QUANT_SIZES[conv[0]]
    return conv[0], int(t.n_elements) // block * size


def conversion_notes(path: Path, tensors) -> list[str]:
    """One line per type in `tensors` the kernels cannot read: how many, their size in the file
    and converted (conversion)."""
    by_type: dict = {}
    for t in tensors:
        conv = converted_size(t)
        if conv is None:
            continue
        n, have, new = by_type.get((t.tensor_type, conv[0]), (0, 0, 0))
        by_type[(t.tensor_type, conv[0])] = (n + 1, have + int(t.n_bytes), new + conv[1])
    return [f"note: {Path(path).name}: {n} {src.name} tensor{'s' if n > 1 else ''} ({have / 1e9:.3f} GB) have no "
            f"native kernel: requantized once at load to {dst.name} ({new / 1e9:.3f} GB)"
            for (src, dst), (n, have, new) in sorted(by_type.items(), key=lambda kv: kv[0][0].value)]


def fused_aliases(reader: GGUFReader, by_name: dict) -> dict:
    """The llama names of the parts of fused tensors (sparsecore/arch.py: fused_qkv, fused_gate_up): `attn_qkv` rows are Q (n_heads *
    head_dim), then K and V (n_kv_heads * head_dim each); `ffn_up` holds gate rows, then up rows
    (HF Phi3MLP's gate_up_proj, which the converter keeps whole). A gate-less FFN's (falcon's)
    `ffn_gate` is its `ffn_up` (the FFN step, told ffn_gate = "none", applies the activation to
    that product and reads no second row), so activity, |act(up x)|, is read the one way."""
    arch = field_value(reader, "general.architecture")
    out: dict = {}
    if arch not in ARCHS:
        return out
    spec, p = ARCHS[arch], f"{arch}."
    n_heads = field_value(reader, p + "attention.head_count")
    hidden = field_value(reader, p + "embedding_length")
    n_ff = field_value(reader, p + "feed_forward_length")
    for name, t in by_name.items():
        if name.endswith(".attn_qkv.weight") and n_heads and hidden:
            blk = name[: -len("attn_qkv.weight")]
            hd = int(field_value(reader, p + "attention.key_length", int(hidden) // int(n_heads)))
            nq = int(n_heads) * hd
            nkv = int(field_value(reader, p + "attention.head_count_kv", n_heads)) * hd
            for part, (a, b) in (("attn_q", (0, nq)), ("attn_k", (nq, nq + nkv)), ("attn_v", (nq + nkv, nq + 2 * nkv))):
                out.setdefault(blk + part + ".weight", row_slice(t, blk + part + ".weight", a, b))
        elif (spec.fused_gate_up and name.endswith(".ffn_up.weight") and n_ff
              and int(np.prod(t.shape[1:])) == 2 * int(n_ff)):
            blk, f = name[: -len("ffn_up.weight")], int(n_ff)
            out[blk + "ffn_gate.weight"] = row_slice(t, blk + "ffn_gate.weight", 0, f)
            out[blk + "ffn_up.weight"] = row_slice(t, blk + "ffn_up.weight", f, 2 * f)
        elif spec.ffn_norm_name != "ffn_norm" and name.endswith(f".{spec.ffn_norm_name}.weight"):
            # gpt-oss's FFN input norm is its post_attention_norm: shown (only) as ffn_norm
            alias = name[: -len(spec.ffn_norm_name + ".weight")] + "ffn_norm.weight"
            out[alias] = t._replace(name=alias)
        elif name.endswith(".ffn_up.weight") and spec.ffn_gate == "none":
            out.setdefault(name.replace("ffn_up", "ffn_gate"), t)
    return out


class TensorStore:
    def __init__(self, path: Path, reader: GGUFReader):
        self.path = Path(path)
        self.reader = reader
        self.by_name = {t.name: t for t in reader.tensors}
        # fused tensors (phi3) under the names of their parts (a fused ffn_up's name means its up half)
        self.by_name.update(fused_aliases(reader, self.by_name))
        spec = ARCHS.get(field_value(reader, "general.architecture"))
        if spec is not None and spec.ffn_norm_name != "ffn_norm":  # not also a gemma3-style output norm
            for n in [n for n in self.by_name if n.endswith(f".{spec.ffn_norm_name}.weight")]:
                del self.by_name[n]
        self.converted: dict = {}

    def _native(self, t):
        """t, or for a type the kernels cannot read (conversion) its values requantized into a
        block type they read, once here in memory."""
        conv = conversion(t)
        if conv is None:
            return t
        if t.name not in self.converted:
            new_type, fn = conv
            n_rows = int(np.prod(t.shape[1:]))  # a stacked tensor's (ffn_*_exps) rows of every expert
            data = fn(np.asarray(t.data).reshape(n_rows, -1))
            self.converted[t.name] = t._replace(tensor_type=new_type, data=data, n_bytes=data.nbytes)
        return self.converted[t.name]

    def has(self, name: str) -> bool:
        return name in self.by_name

    def raw(self, name: str):
        """The tensor as the file holds it (its own type)."""
        t = self.by_name.get(name)
        if t is None:
            raise ModelFileError(f"{self.path}: tensor {name} is missing")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ModelFileError(
                f"{self.path}: tensor {name} has type {t.tensor_type.name}, which sparseinfer does not support")
        return t

    def info(self, name: str):
        """The tensor as the native kernels read it: the file's, or converted (conversion)."""
        return self._native(self.raw(name))

    def expert(self, name: str, e: int):
        """Expert e's 2-D matrix of the stacked 3-D tensor `name` (ffn_*_exps: ggml dims {cols,
        rows, E}): its rows are a contiguous run of the file, viewed in place (as `info`: a type
        the kernels cannot read comes converted)."""
        t = self.raw(name)
        if len(t.shape) != 3 or not 0 <= e < int(t.shape[2]):
            raise ModelFileError(f"{self.path}: tensor {name} has shape {list(t.shape)}: no expert {e}")
        rows = int(t.shape[1])
        return self._native(row_slice(t, f"{name}[{e}]", e * rows, (e + 1) * rows))

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy order (rows, cols) — GGUF lists dimensions the other way round."""
        return tuple(int(d) for d in reversed(self.raw(name).shape))

    def _rows_raw(self, t, rows) -> np.ndarray:
        data = t.data
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return data.reshape(-1, int(t.shape[0]))[rows] if data.ndim == 1 else data[rows]
        return data[rows]

    def matrix(self, name: str) -> np.ndarray:
        """The whole tensor as float32 in numpy order (1-D for norms): the file's values (a
        converted type's requantization is for the kernels only)."""
        t = self.raw(name)
        out = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if not out.flags.writeable:  # an F32 tensor comes back as a view of the read-only map
            out = out.copy()
        return out.reshape(self.shape(name))

    def rows(self, name: str, idx: np.ndarray) -> np.ndarray:
        """Rows `idx` of a 2-D tensor as float32, touching only those rows' bytes (the file's values)."""
        t = self.raw(name)
        n_rows, n_cols = self.shape(name)
        if len(idx) == 0:  # a worker that owns no neuron of this layer
            return np.zeros((0, n_cols), np.float32)
        raw = t.data.reshape(n_rows, -1)[np.asarray(idx, dtype=np.int64)]
        return dequantize(raw, t.tensor_type).astype(np.float32, copy=False).reshape(len(idx), n_cols)

    def columns(self, name: str, idx: np.ndarray) -> np.ndarray:
        """Columns `idx` of a 2-D tensor, returned transposed: shape (len(idx), n_rows)."""
        return np.ascontiguousarray(self.matrix(name)[:, np.asarray(idx, dtype=np.int64)].T)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time Q/K row permutation so rotate-half RoPE applies (as HF does)."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))
