"""FileMatrix: one 2-D tensor of the memory-mapped model file as the kernels see it (the rows
and columns it holds, their layout, an input-major twin) and its products: matvec, matmul and
their prepared forms, dequantize, the twin's counters. The layout conversions that make a new
matrix (keep_rows, interleave, with_input_major...) are layouts.py's, callable as methods;
the memory they fill is held_memory.py's.
"""
from __future__ import annotations

import numpy as np

from . import _kernels, layouts
from .formats import COLS_HEADER, FILE_LAYOUT, MAX_SMALL_BATCH, NATIVE_TYPES, Q8_BLOCK_BYTES, R16, X16
from .held_memory import ptr


def q8_scratch(n_values: int, tokens: int = 1) -> np.ndarray:
    """Room for `n_values` activations quantized to 8-bit blocks (fast mode), for each of `tokens`."""
    return np.empty(tokens * max(1, -(-n_values // 32)) * Q8_BLOCK_BYTES, np.uint8)


def check_batch(x: np.ndarray, n: int, what: str) -> int:
    """x must be (B, n) float32, C-contiguous, 1 <= B <= MAX_SMALL_BATCH; returns B."""
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != n or not x.flags.c_contiguous \
            or not 1 <= x.shape[0] <= MAX_SMALL_BATCH:
        raise ValueError(f"{what}: x must be (1..{MAX_SMALL_BATCH}, {n}) contiguous float32, "
                         f"got {x.shape} {x.dtype}")
    return x.shape[0]


class FileMatrix:
    """One GGUF tensor (rows, cols) in the file's own blocks; `data` is the reader's view of it
    (numpy over the memory map), kept alive here."""

    def __init__(self, tensor):
        t = int(tensor.tensor_type)
        if t not in NATIVE_TYPES:
            raise ValueError(f"tensor {tensor.name}: type {tensor.tensor_type.name} has no native kernel")
        self.name, self.type = tensor.name, t
        self.cols, self.rows = int(tensor.shape[0]), int(np.prod(tensor.shape[1:]))
        self.block = NATIVE_TYPES[t]
        if self.cols % self.block:
            raise ValueError(f"tensor {tensor.name}: {self.cols} columns is not a whole number of blocks")
        self.data = np.asarray(tensor.data).reshape(self.rows, -1)
        self.stride = self.data.strides[0]
        if not self.data.flags.c_contiguous and self.data.strides[1] != self.data.itemsize:
            raise ValueError(f"tensor {tensor.name}: rows are not contiguous in the file")
        self.row_bytes = self.data.shape[1] * self.data.itemsize
        self.file_rows = self.data  # the file's rows, whatever this object later holds (with_input_major reads them)

    col_range = None  # keep_columns: the only columns held, else all of them
    row_range = None  # keep_rows: the only rows held, else all of them
    interleaved = False  # interleave: 16 rows side by side in memory of the process's own
    twin = None  # with_input_major: the input-major twin (uint8: its header, then its data), else None
    twin_rows = twin_cols = None  # the twin's sub-matrix
    twin_parts = None  # a fused twin (fuse_input_major): ((name, rows), ...) of the matrices stacked in it
    blocked = False  # interleave_blocks: each row's blocks 16 side by side, the same

    @property
    def args(self) -> tuple[int, int, int, int, int]:
        """(base address, row stride, type, layout, twin header's address or 0) for the kernels;
        worked out once for the data held."""
        held = self.__dict__.get("_args")
        if held is not None and held[0] is self.data and held[1] == (self.col_range, self.stride) and held[3] is self.twin:
            return held[2]
        twin = 0 if self.twin is None else ptr(self.twin)
        base = ptr(self.data)
        if self.row_range is not None:  # likewise a held row keeps its number (a group: 16 rows)
            base -= self.row_range.start // (16 if self.interleaved else 1) * self.stride
        if self.col_range is not None:
            # Rows start at column col_range.start: the kernels add (col0 / block) * block bytes
            # to the base, so a held column keeps its number and every call site stays the same.
            base -= self.col_range.start // self.block * (self.x16_block_bytes if self.interleaved else self.block_bytes)
        a = (base, self.stride, self.type, X16 if self.interleaved else R16 if self.blocked else FILE_LAYOUT, twin)
        self._args = (self.data, (self.col_range, self.stride), a, self.twin)
        return a

    # Conversions (layouts.py), as methods so that they chain: m.keep_rows(r).interleave()
    keep_rows = layouts.keep_rows
    keep_columns = layouts.keep_columns
    held_copy = layouts.held_copy
    can_interleave = property(layouts.can_interleave)
    interleave = layouts.interleave
    for_fast_products = layouts.for_fast_products
    can_interleave_blocks = property(layouts.can_interleave_blocks)
    interleave_blocks = layouts.interleave_blocks
    for_row_products = layouts.for_row_products
    with_input_major = layouts.with_input_major
    fuse_input_major = staticmethod(layouts.fuse_input_major)

    def _twin_counter(self, offset: int) -> np.ndarray:
        if self.twin is None:
            raise ValueError(f"{self.name}: no input-major twin")
        return self.twin[offset:offset + 8].view(np.int64)

    @property
    def twin_active(self) -> int:
        """Active inputs (channels) the twin's products have read since the last reset, summed"""
        return int(self._twin_counter(48)[0])

    @property
    def twin_groups(self) -> int:
        """Groups (twin_group inputs: 32, a K-quant's 256) with an active input (each read its rows'
        scales), likewise"""
        return int(self._twin_counter(56)[0])

    def reset_twin_counts(self) -> tuple[int, int]:
        """(twin_active, twin_groups), then both zeroed"""
        out = (self.twin_active, self.twin_groups)
        self._twin_counter(48)[0] = 0
        self._twin_counter(56)[0] = 0
        return out

    @property
    def twin_bytes(self) -> int:
        """The twin's data bytes (its header apart): the sub-matrix's bytes in the file, plus
        zero rows up to a multiple of 128 (Q8_0: 64) rows"""
        return len(self.twin) - COLS_HEADER if self.twin is not None else 0

    @property
    def twin_group(self) -> int:
        """Inputs that share their rows' scales (a group: 32, the K-quants' super-block 256)"""
        return self._twin_sizes[0]

    @property
    def twin_channel_bytes(self) -> int:
        """Bytes one active input costs: its channel row (Rp/2 for Q4, Rp for Q8_0, Rp/2 + Rp/8
        for Q5_0, Q5_1, Q5_K, Rp/2 + Rp/4 for Q6_K; cols_generic.c, cols_kquants_generic.c)"""
        return self._twin_sizes[1]

    @property
    def twin_scale_bytes(self) -> int:
        """Bytes each group (twin_group inputs) with an active input costs: its rows' scale fields
        (f16 scales, mins; the K-quants' packed 6-bit or int8 scales)"""
        return self._twin_sizes[2]

    def twin_bytes_read(self, active: int, groups: int) -> int:
        """The bytes products read for `active` channels in `groups` groups (reset_twin_counts)"""
        return active * self.twin_channel_bytes + groups * self.twin_scale_bytes

    @property
    def _twin_sizes(self) -> tuple[int, int, int]:
        if self.twin is None:
            raise ValueError(f"{self.name}: no input-major twin")
        return _kernels.cols_sizes(self.type, self._twin_R)

    @property
    def _twin_R(self) -> int:  # the twin's rows: a fused one's parts stacked
        return sum(len(r) for _, r in self.twin_parts) if self.twin_parts else len(self.twin_rows)

    def twin_dequantize(self) -> np.ndarray:
        """The twin's values as float32 (len(twin_rows), len(twin_cols)): the file's, exactly (a
        fused twin: its parts' rows stacked)"""
        if self.twin is None:
            raise ValueError(f"{self.name}: no input-major twin")
        out = np.empty((self._twin_R, len(self.twin_cols)), np.float32)
        _kernels.cols_dequant(ptr(self.twin), ptr(out))
        return out

    @property
    def x16_block_bytes(self) -> int:
        """Bytes of 16 rows' block once interleaved: 16 of the file's, and Q4_K's scales and mins
        a byte each, IQ4_XS's and Q3_K's scales (interleaved_generic.c x16_block_bytes)."""
        return {12: 2368, 23: 2208, 11: 1824}.get(self.type, 16 * self.block_bytes)

    @property
    def block_bytes(self) -> int:
        """Bytes of one of the file's blocks (row_bytes: a whole row's, held or not)."""
        return self.row_bytes * self.block // self.cols

    def _rows(self, rows, fast: bool):
        """(int32 index array or None, start, count) for rows = None (all), a range, or indices;
        `fast`: for fast-mode products or dequantize, the two that interleaved rows take."""
        if self.interleaved and not (fast and (rows is None or isinstance(rows, range) and rows.start % 16 == 0)):
            raise ValueError(f"{self.name}: interleaved rows take fast-mode products of ranges starting on 16 rows")
        if self.blocked and not fast:
            raise ValueError(f"{self.name}: rows with interleaved blocks take fast-mode products only")
        held = self.row_range or range(self.rows)
        if rows is None:
            if self.row_range is not None:
                raise ValueError(f"{self.name}: holds rows {held} only")
            return None, 0, self.rows
        if isinstance(rows, range):
            if rows.step != 1 or not 0 <= rows.start <= rows.stop <= self.rows:
                raise ValueError(f"{self.name}: row range {rows} outside 0..{self.rows}")
            if not held.start <= rows.start <= rows.stop <= held.stop:
                raise ValueError(f"{self.name}: holds rows {held} only")
            return None, rows.start, len(rows)
        idx = np.ascontiguousarray(rows, dtype=np.int32)
        if len(idx) and (idx.min() < 0 or idx.max() >= self.rows):
            raise ValueError(f"{self.name}: row index outside 0..{self.rows - 1}")
        if len(idx) and (idx.min() < held.start or idx.max() >= held.stop):
            raise ValueError(f"{self.name}: holds rows {held} only")
        return idx, 0, len(idx)

    def column_span(self, cols) -> tuple[int, int]:
        """(first column, count) of `cols` (None: every column; only those held may be asked for)."""
        held = range(self.cols) if self.col_range is None else self.col_range
        if cols is None:
            if self.col_range is not None:
                raise ValueError(f"{self.name}: holds columns {held} only")
            return 0, self.cols
        if cols.step != 1 or not held.start <= cols.start <= cols.stop <= held.stop or cols.start % self.block \
                or len(cols) % self.block:
            raise ValueError(f"{self.name}: columns {cols} are not whole blocks of {self.block} within {held}")
        return cols.start, len(cols)

    def matvec(self, x: np.ndarray, rows=None, cols: range | None = None, fast: bool = False,
               out: np.ndarray | None = None, xq: np.ndarray | None = None) -> np.ndarray:
        """y[i] = row_i[cols] . x for the chosen rows: x float32 (len(cols),)."""
        idx, start, n = self._rows(rows, fast)
        col0, ncol = self.column_span(cols)
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        if len(x) != ncol:
            raise ValueError(f"{self.name}: x has {len(x)} values for {ncol} columns")
        y = np.empty(n, np.float32) if out is None else out
        if y.dtype != np.float32 or not y.flags.c_contiguous or len(y) < n:
            raise ValueError("out must be a contiguous float32 array with room for every row")
        xq = q8_scratch(ncol) if xq is None else xq
        _kernels.matvec(*self.args, 0 if idx is None else ptr(idx), start, n, col0, ncol, ptr(x), int(fast),
                        ptr(xq), ptr(y))
        return y[:n]

    def prepare(self, rows=None, cols: range | None = None, fast: bool = False, xq: np.ndarray | None = None):
        """matvec with its rows, columns and buffers checked once: a function of x (float32,
        contiguous, len(cols) values) returning y, a buffer it reuses from call to call."""
        idx, start, n = self._rows(rows, fast)
        col0, ncol = self.column_span(cols)
        y = np.empty(n, np.float32)
        xq = q8_scratch(ncol) if xq is None else xq
        fixed = (*self.args, 0 if idx is None else ptr(idx), start, n, col0, ncol)
        tail = (int(fast), ptr(xq), ptr(y))
        keep = (idx, xq)  # the arrays the pointers point into live as long as the function

        def call(x: np.ndarray) -> np.ndarray:
            if x.dtype != np.float32 or x.shape != (ncol,) or not x.flags.c_contiguous:
                raise ValueError(f"{self.name}: x must be {ncol} contiguous float32 values")
            _kernels.matvec(*fixed, ptr(x), *tail)
            return y
        call.keep = keep
        return call

    def matmul(self, x: np.ndarray, rows=None, cols: range | None = None, fast: bool = False,
               out: np.ndarray | None = None, xq: np.ndarray | None = None) -> np.ndarray:
        """Y[b, i] = row_i[cols] . x[b] for a small batch x (B, len(cols)), B <= MAX_SMALL_BATCH:
        each row is read once for all B tokens; Y[b] equals matvec(x[b]) bit for bit."""
        idx, start, n = self._rows(rows, fast)
        col0, ncol = self.column_span(cols)
        x = np.ascontiguousarray(x, dtype=np.float32)
        B = check_batch(x[None] if x.ndim == 1 else x, ncol, self.name)
        y = np.empty((B, n), np.float32) if out is None else out
        if y.dtype != np.float32 or not y.flags.c_contiguous or y.size < B * n:
            raise ValueError("out must be a contiguous float32 array with room for every row of every token")
        xq = q8_scratch(ncol, B) if xq is None else xq
        _kernels.matmul(*self.args, 0 if idx is None else ptr(idx), start, n, col0, ncol, ptr(x), ncol, B, int(fast),
                        ptr(xq), ptr(y), n)
        return y.reshape(-1)[: B * n].reshape(B, n)

    def prepare_batch(self, rows=None, cols: range | None = None, fast: bool = False):
        """matmul with its rows, columns and buffers checked once (as prepare): a function of
        x (B, len(cols)) float32, contiguous, 1 <= B <= MAX_SMALL_BATCH, returning Y (B, n_rows),
        a view of a buffer it reuses from call to call."""
        idx, start, n = self._rows(rows, fast)
        col0, ncol = self.column_span(cols)
        y = np.empty((MAX_SMALL_BATCH, n), np.float32)
        xq = q8_scratch(ncol, MAX_SMALL_BATCH)
        fixed = (*self.args, 0 if idx is None else ptr(idx), start, n, col0, ncol)
        keep = (idx, xq, y)
        name = self.name

        def call(x: np.ndarray) -> np.ndarray:
            B = check_batch(x, ncol, name)
            _kernels.matmul(*fixed, ptr(x), ncol, B, int(fast), ptr(xq), ptr(y), n)
            return y[:B]
        call.keep = keep
        return call

    def dequantize(self, rows=None, cols: range | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """The chosen rows and columns as float32 (n_rows, n_cols)."""
        idx, start, n = self._rows(rows, fast=True)
        col0, ncol = self.column_span(cols)
        o = np.empty((n, ncol), np.float32) if out is None else out
        if o.dtype != np.float32 or not o.flags.c_contiguous or o.size < n * ncol:
            raise ValueError("out must be a contiguous float32 array with room for the rows")
        _kernels.dequant(*self.args, 0 if idx is None else ptr(idx), start, n, col0, ncol, ptr(o))
        return o.reshape(-1)[: n * ncol].reshape(n, ncol)
