"""Tensor access by name: whole matrices, row subsets, column subsets, all as float32.

GGUF stores a matrix W (out x in) row-major with its quant blocks running along `in`, so a
row subset is a cheap slice of the memory-mapped blocks, while a column subset (the down
projection's neurons) needs the whole matrix dequantized (or PowerInfer's ffn_down_t).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

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


# Types with no native kernel that convert exactly into one that has (see TensorStore.info):
# type -> (native type, function of the (rows, bytes) blocks). None now: Q5_0, which was
# rewritten as Q8_0 (1.5x its bytes), has kernels of its own.
EXACT_CONVERSIONS: dict = {}


def fused_aliases(reader: GGUFReader, by_name: dict) -> dict:
    """The llama names of the parts of fused tensors (phi3): `attn_qkv` rows are Q (n_heads *
    head_dim), then K and V (n_kv_heads * head_dim each); `ffn_up` holds gate rows, then up rows
    (HF Phi3MLP's gate_up_proj, which the converter keeps whole). Falcon has no gate: its
    `ffn_gate` is its `ffn_up` (the FFN step, told ffn_gate = "none", applies the activation to
    that product and reads no second row), so activity, |act(up x)|, is read the one way."""
    arch = field_value(reader, "general.architecture")
    out: dict = {}
    if arch is None:
        return out
    p = f"{arch}."
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
        elif (name.endswith(".ffn_up.weight") and n_ff and int(np.prod(t.shape[1:])) == 2 * int(n_ff)
              and name.replace("ffn_up", "ffn_gate") not in by_name):
            blk, f = name[: -len("ffn_up.weight")], int(n_ff)
            out[blk + "ffn_gate.weight"] = row_slice(t, blk + "ffn_gate.weight", 0, f)
            out[blk + "ffn_up.weight"] = row_slice(t, blk + "ffn_up.weight", f, 2 * f)
        elif name.endswith(".ffn_up.weight") and arch == "falcon":
            out.setdefault(name.replace("ffn_up", "ffn_gate"), t)
    return out


class TensorStore:
    def __init__(self, path: Path, reader: GGUFReader):
        self.path = Path(path)
        self.reader = reader
        self.by_name = {t.name: t for t in reader.tensors}
        # fused tensors (phi3) under the names of their parts (a fused ffn_up's name means its up half)
        self.by_name.update(fused_aliases(reader, self.by_name))
        self.converted: dict = {}

    def _native(self, t):
        """t, or for a type in EXACT_CONVERSIONS the same values in a block type the kernels
        read, converted once here in memory."""
        conv = EXACT_CONVERSIONS.get(t.tensor_type)
        if conv is None or len(t.shape) != 2:
            return t
        if t.name not in self.converted:
            new_type, fn = conv
            n_rows = int(t.shape[1])
            data = fn(np.asarray(t.data).reshape(n_rows, -1))
            self.converted[t.name] = t._replace(tensor_type=new_type, data=data, n_bytes=data.nbytes)
        return self.converted[t.name]

    def has(self, name: str) -> bool:
        return name in self.by_name

    def info(self, name: str):
        t = self.by_name.get(name)
        if t is None:
            raise ModelFileError(f"{self.path}: tensor {name} is missing")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ModelFileError(
                f"{self.path}: tensor {name} has type {t.tensor_type.name}, which sparseinfer does not support")
        return self._native(t)

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy order (rows, cols) — GGUF lists dimensions the other way round."""
        return tuple(int(d) for d in reversed(self.info(name).shape))

    def _rows_raw(self, t, rows) -> np.ndarray:
        data = t.data
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return data.reshape(-1, int(t.shape[0]))[rows] if data.ndim == 1 else data[rows]
        return data[rows]

    def matrix(self, name: str) -> np.ndarray:
        """The whole tensor as float32 in numpy order (1-D for norms)."""
        t = self.info(name)
        out = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if not out.flags.writeable:  # an F32 tensor comes back as a view of the read-only map
            out = out.copy()
        return out.reshape(self.shape(name))

    def rows(self, name: str, idx: np.ndarray) -> np.ndarray:
        """Rows `idx` of a 2-D tensor as float32, touching only those rows' bytes."""
        t = self.info(name)
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
