"""Native kernels on the GGUF file's own blocks (_kernels.c), and the Python side that checks
what it hands them.

A `FileMatrix` is one 2-D tensor of the memory-mapped model file: rows of `stride` bytes in the
file's own type. Nothing is copied: a process that computes some rows only pages those in.

    FileMatrix.matvec(x, rows=..., cols=...)      rows . x   (decode: one token)
    FileMatrix.dequantize(rows=..., cols=...)     float32    (prefill: one layer at a time, then a GEMM)
    ffn_token(gate, up, down, x, own, ...)        one token's partial FFN in one call
    FileMatrix.matmul(X, ...) / prepare_batch     rows . x_b for a small batch (2..16 tokens)
    ffn_batch(gate, up, down, X, own, ...)        a small batch's partial FFN in one call

The small-batch kernels (continuous batching: several sequences decoded together) read each
row once for all tokens and give every token exactly what the one-token kernel gives it (the
same float operations in the same order), so a request decodes the same alone or in a batch.

`fast=False` (exact): float32 activations times the dequantized block values, what the
transformers oracle computes. `fast=True`: the activation quantized to 8 bits per block of 32,
integer block dot products (llama.cpp's arithmetic). Types: F32, F16, BF16, Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, IQ4_NL, and in blocks of 256 values (such a block spans 8 activation blocks) the
K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS and IQ3_S.
"""
from __future__ import annotations

import copy
import ctypes
import mmap
import os

import numpy as np

from . import _kernels

# gguf.GGMLQuantizationType values the kernels read, and the values per block of each
NATIVE_TYPES = {0: 1, 1: 1, 30: 1, 2: 32, 3: 32, 8: 32,  # F32, F16, BF16, Q4_0, Q4_1, Q8_0
                10: 256, 11: 256, 12: 256, 13: 256, 14: 256,  # Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
                6: 32, 7: 32, 20: 32, 23: 256,  # Q5_0, Q5_1, IQ4_NL, IQ4_XS
                18: 256, 21: 256}  # IQ3_XXS, IQ3_S
ACT_IDS = {"silu": 0, "relu": 1, "gelu_tanh": 2, "gelu": 3}  # act_fn in ffn_step.c
# How gate and up combine (ModelConfig.ffn_gate), or'ed into the activation id: "par"
# act(gate x) * (up x); "none" act(gate x) alone, with `gate` the up matrix (falcon: no second
# row is read); "sym" act(gate x) * act(up x) (bamboo). ACT_NOGATE, ACT_SYM in ffn_step.c.
GATE_BITS = {"par": 0, "none": 16, "sym": 32}
Q8_BLOCK_BYTES = 40  # struct q8blk: float d, int32 s, int8 q[32]
# Most tokens the small-batch kernels take at once (base.c MAXB); larger batches (prefill)
# dequantize tiles and run a GEMM instead.
MAX_SMALL_BATCH = 16
# How a matrix's rows lie in memory, handed to the kernels beside its type (FileMatrix.args;
# base.c's L_FILE, L_X16, L_R16): the file's rows; rows interleaved 16 by 16
# (FileMatrix.interleave); each row's blocks interleaved 16 by 16 (FileMatrix.interleave_blocks)
FILE_LAYOUT, X16, R16 = 0, 1, 2
# Input-major twins (FileMatrix.with_input_major, base.c's L_COLS): the types with their products
COLS_TYPES = (2, 3, 8, 6, 7, 12, 13, 14)  # Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K
FUSED_TYPES = (2, 3, 8)  # those whose twins also fuse (FileMatrix.fuse_input_major): Q4_0, Q4_1, Q8_0
COLS_HEADER = 64  # bytes of a twin's header (cols_generic.c cols_hdr): n_active at 48, n_groups at 56
X16_TYPES = (2, 3, 6, 7, 8, 12, 14, 20, 23, 10, 11)  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K, IQ4_NL, IQ4_XS, Q2_K, Q3_K
R16_TYPES = (2, 3, 8)  # Q4_0, Q4_1, Q8_0


# The levels with SIMD kernels for the interleaved layouts (X16 and R16), where they beat the
# file's rows for every type that has them (measurements per level and type: docs/KERNELS.md);
# the portable loops are slower than the file's rows.
SIMD_LEVELS = ("avx2", "avxvnni", "avx512vnni")


def interleaving(tensor_type: int | None = None) -> bool:
    """Whether fast mode holds rows interleaved 16 by 16 (FileMatrix.interleave) at this ISA
    level: any X16 type (None) or `tensor_type`."""
    return isa() in SIMD_LEVELS and (tensor_type is None or int(tensor_type) in X16_TYPES)


def blocked_rows() -> bool:
    """Whether rows picked by activity hold their blocks interleaved (FileMatrix.interleave_blocks,
    R16) at this ISA level."""
    return isa() in SIMD_LEVELS


def input_major_type(tensor_type) -> bool:
    """Whether a matrix of this type can have an input-major twin (FileMatrix.with_input_major;
    sparsecore/input_sparsity.py)."""
    return int(tensor_type) in COLS_TYPES


def isa() -> str:
    """The instruction set the kernels use on this CPU: "avx512vnni" (fast mode's integer dots
    with AVX-512 VNNI, AVX2 for the rest), "avxvnni" (the interleaved layouts' integer sums with
    256-bit vpdpbusd, AVX2 for the rest), "avx2" or "generic"; import picks the best one."""
    return _kernels.isa()


def set_isa(name: str) -> str:
    """Force "generic" (portable C), "avx2", "avxvnni" or "avx512vnni", each where the CPU has it
    (else the next one down; "avxvnni" on an AVX-512 VNNI CPU runs its code EVEX-encoded: the
    tests' way to that level); returns what is in use. Fast mode's results differ between ISA levels within
    rounding; on one level a token's result is the same alone and in any batch."""
    return _kernels.set_isa(name)


# SPARSEINFER_ISA=generic|avx2|avxvnni|avx512vnni caps the level in every process of a run (workers
# inherit it): to measure or test a lower level on a better CPU, as a user of that CPU gets it.
if os.environ.get("SPARSEINFER_ISA"):
    set_isa(os.environ["SPARSEINFER_ISA"])


def supports(tensor_type: int) -> bool:
    return int(tensor_type) in NATIVE_TYPES


def neuron_align(down_type: int, down_t: bool = False) -> int:
    """Where a range of owned neurons may start for ffn_token: down's columns are read in whole
    blocks (32, or 256 for the K-quants); a transposed down_t has a row per neuron (any range)."""
    return 1 if down_t else max(32, NATIVE_TYPES.get(int(down_type), 32))


def _unmap_file_pages(a: np.ndarray) -> None:
    """Drop this process's mapping of the pages under `a` if it views a memory-mapped file
    (madvise MADV_DONTNEED): the bytes stay in the page cache and fault back in if read again,
    but stop counting in resident memory. Anything else (a converted tensor in anonymous
    memory, which MADV_DONTNEED would zero) is left alone."""
    base = a
    while getattr(base, "base", None) is not None and not isinstance(base, mmap.mmap):
        base = base.base
    if not isinstance(base, mmap.mmap) or isinstance(base, _AnonymousMap) or not a.nbytes \
            or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page, origin = mmap.PAGESIZE, _ptr(np.frombuffer(base, np.uint8))  # the mapping starts on a page
    start = (_ptr(a) - origin) // page * page
    end = min(len(base), _ptr(a) - origin + (a.shape[0] - 1) * a.strides[0] + a.shape[1] * a.itemsize)
    base.madvise(mmap.MADV_DONTNEED, start, end - start)


class _AnonymousMap(mmap.mmap):
    """Memory of the process's own, mapped: never a file's pages to unmap (_unmap_file_pages)."""


def _anonymous(n: int) -> np.ndarray:
    """n bytes of anonymous memory, page-aligned, in transparent huge pages where the kernel
    gives them: an interleaved copy is written once at load, and on these VMs a first write
    faulting 4 KB at a time cost more than the copying (the 1.1B shape's Q6_K lm_head: 252 ->
    61 ms)."""
    if n < 1 << 21 or not hasattr(mmap, "MADV_HUGEPAGE"):
        raw = np.empty(n + 64, np.uint8)
        return raw[-_ptr(raw) % 64:][:n]  # 64-byte aligned
    m = _AnonymousMap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # no transparent huge pages here: 4 KB pages it is
        pass
    return np.frombuffer(m, np.uint8)


_TWIN_CHUNK = 64 << 20  # bytes of address space per arena map (untouched pages cost nothing)
_twin_arena: list = [None, 0]  # the current map and its next free byte


def _twin_buffer(n: int) -> np.ndarray:
    """n bytes (64-byte aligned, on a 4 KB page) for an input-major twin, carved from maps of
    anonymous memory in transparent huge pages (_anonymous), one after another: a twin under
    2 MB (a process's Q|K|V or output columns of the 1.1B shape: 1.2-1.5 MB) in pages of its
    own would take 4 KB pages, and its products, whose channel rows jump pages at every
    active input, ran 10-15 % slower (one core, from memory: 104 -> 93 us a layer at 50 %)."""
    need = -(-n // 4096) * 4096
    m, off = _twin_arena
    if m is None or off + need > len(m):
        m, off = _anonymous(max(_TWIN_CHUNK, -(-need // (1 << 21)) * (1 << 21))), 0
    _twin_arena[:] = m, off + need
    return m[off:off + n]


def _ptr(a: np.ndarray) -> int:
    """The address of a's first element. Through ctypes for a writable array (0.5 us); the
    array interface, which builds a dict (1.5 us), only for a read-only one (a file's map):
    a decoded layer hands the kernels some twenty addresses, ten of them per call."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.__array_interface__["data"][0]


def q8_scratch(n_values: int, tokens: int = 1) -> np.ndarray:
    """Room for `n_values` activations quantized to 8-bit blocks (fast mode), for each of `tokens`."""
    return np.empty(tokens * max(1, -(-n_values // 32)) * Q8_BLOCK_BYTES, np.uint8)


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fast mode's quantization of float32 x (a whole number of blocks of 32), as every kernel
    does it: per block (d, sum of q, q int8 values)."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if len(x) % 32:
        raise ValueError(f"{len(x)} values is not a whole number of blocks of 32")
    out = q8_scratch(len(x))
    _kernels.quantize_q8(_ptr(x), len(x), _ptr(out))
    blocks = out.reshape(-1, Q8_BLOCK_BYTES)
    return blocks[:, :4].copy().view(np.float32)[:, 0], blocks[:, 4:8].copy().view(np.int32)[:, 0], \
        blocks[:, 8:].view(np.int8).copy()


def residual_norm_args(shares: list[np.ndarray]) -> np.ndarray:
    """The addresses of `shares` ((rows, hidden) float32, contiguous, the same shape) for
    residual_norm_into, resolved once: the arrays must outlive their use."""
    if not shares or any(s.dtype != np.float32 or s.shape != shares[0].shape or s.ndim != 2
                         or not s.flags.c_contiguous for s in shares):
        raise ValueError("residual shares must be (rows, hidden) float32, contiguous, of one shape")
    return np.array([_ptr(s) for s in shares], np.int64)


def residual_norm_into(h: np.ndarray, shares: np.ndarray, B: int, norm: np.ndarray | None, eps: float,
                       x: np.ndarray) -> None:
    """Rows [0, B) of h += the sum of the shares (residual_norm_args), added in their order;
    then x = RMSNorm(h) * norm, unless norm is None. h, x: (>= B, hidden) float32, contiguous;
    the shares hold at least B rows of the same width (checked by the callers, once)."""
    _kernels.residual_norm(_ptr(h), _ptr(shares), len(shares), h.shape[1], B,
                           0 if norm is None else _ptr(norm), float(eps), _ptr(x))


def rms_norm(h: np.ndarray, norm: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm(h) * norm for each row of h (B, hidden) float32: the kernel residual_norm_into
    normalizes with, so that a layer's FFN input is the same floats on every decode path."""
    h = np.ascontiguousarray(h, dtype=np.float32)
    if h.ndim != 2 or norm.dtype != np.float32 or norm.shape != (h.shape[1],) or not norm.flags.c_contiguous:
        raise ValueError("rms_norm: h must be (B, hidden) float32, norm (hidden,) float32")
    x = np.empty_like(h)
    if len(h):
        _kernels.residual_norm(_ptr(h), 0, 0, h.shape[1], len(h), _ptr(norm), float(eps), _ptr(x))
    return x


def residual_norm(h: np.ndarray, shares: list[np.ndarray], norm: np.ndarray | None, eps: float) -> np.ndarray:
    """Checked form of residual_norm_into for the whole of h (B, hidden), in place; returns x."""
    B, hidden = h.shape
    if h.dtype != np.float32 or not h.flags.c_contiguous or any(s.shape != h.shape for s in shares) or (
            norm is not None and (norm.dtype != np.float32 or norm.shape != (hidden,))):
        raise ValueError("residual_norm: h and the shares must be (B, hidden) float32, norm (hidden,)")
    held = [np.ascontiguousarray(s) for s in shares]  # alive while the kernel reads them
    ptrs = residual_norm_args(held)
    x = np.empty_like(h)
    residual_norm_into(h, ptrs, B, norm, eps, x)
    return x


def _check_batch(x: np.ndarray, n: int, what: str) -> int:
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
    def can_interleave(self) -> bool:
        """Whether interleave() takes this matrix: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K, IQ4_NL,
        IQ4_XS, Q2_K or Q3_K, at an ISA level
        with interleaved tiles (interleaving())."""
        return self.type in X16_TYPES and not self.interleaved and interleaving(self.type)

    def for_fast_products(self, rows: range | None = None) -> "FileMatrix":
        """The matrix to run fast-mode products of `rows` (a range; None: all) on: those rows
        interleaved where they can be (can_interleave, the range starting on 16 rows), else
        this matrix as it is. One rule for every caller (FFN, attention, lm_head)."""
        if not self.can_interleave or (rows is not None and rows.start % 16):
            return self
        return (self if rows is None else self.keep_rows(rows)).interleave()

    def interleave(self) -> "FileMatrix":
        """This matrix (the columns it holds) with its rows 16 side by side, in memory of its own
        (interleaved_generic.c interleave: the same bytes, the file's pages then unmapped from this process,
        as keep_columns does). For fast mode's dense products only: one token's integer dots
        then cost a third of the vector operations, shared by 16 rows (one vpdpbusd covers 4
        weights of 16 rows), which is what lets a batch of sequences or a prompt's tiles cost
        little more than one token. Rows are then taken as ranges starting on a multiple of 16,
        never one at a time: a shard that picks rows by activity keeps the file's layout."""
        if self.interleaved:
            raise ValueError(f"tensor {self.name}: already interleaved")
        if self.type not in X16_TYPES:
            raise ValueError(f"tensor {self.name}: only Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K, IQ4_NL, IQ4_XS, "
                             f"Q2_K and Q3_K rows interleave")
        held = self.col_range or range(self.cols)
        nb, gb = len(held) // self.block, self._x16_block_bytes
        n_held = len(self.data)  # rows held: all, or row_range's
        if self.row_range is not None and self.row_range.start % 16:
            raise ValueError(f"{self.name}: interleaved rows start on a multiple of 16, not {self.row_range.start}")
        groups = -(-n_held // 16)
        buf = _anonymous(groups * nb * gb)
        _kernels.interleave(_ptr(self.data), self.stride, self.type, n_held, nb, _ptr(buf))
        part = copy.copy(self)
        part.data, part.stride, part.interleaved = buf.reshape(groups, nb * gb), nb * gb, True
        _unmap_file_pages(self.data)
        return part

    @property
    def can_interleave_blocks(self) -> bool:
        """Whether interleave_blocks() takes this matrix: whole rows of Q4_0, Q4_1 or Q8_0 in the
        file's layout."""
        return self.type in R16_TYPES and not (self.interleaved or self.blocked) and self.col_range is None

    def for_row_products(self, rows: range | None = None) -> "FileMatrix":
        """The matrix to run fast-mode products of rows picked one by one on (rows: the range a
        shard may pick from; None: all): those rows with their blocks interleaved where they can
        be (interleave_blocks: Q4_0, Q4_1 or Q8_0, the CPU with AVX-512 VNNI), else this matrix
        as it is."""
        if not (self.can_interleave_blocks and blocked_rows()):
            return self
        return (self if rows is None else self.keep_rows(rows)).interleave_blocks()

    def interleave_blocks(self) -> "FileMatrix":
        """This matrix with each row's blocks 16 side by side (layout R16, base.c): every row keeps
        its place and its bytes, every 16 of its blocks laid out as `interleave` lays out 16
        rows' block (its last nb % 16 blocks as a run of that many). For fast mode's products of
        rows a shard picks by activity (threshold steps' up rows, predictors' gate and up rows),
        which one by one cannot share the work of 16 rows: here a row's 16 blocks share it instead (1.1B shape, one core, a quarter of
        a layer's up rows picked at random: see docs/KERNELS.md, Rows picked by activity)."""
        if not self.can_interleave_blocks:
            raise ValueError(f"tensor {self.name}: only whole rows of Q4_0, Q4_1 or Q8_0 interleave their blocks")
        buf = _anonymous(len(self.data) * self.row_bytes)
        _kernels.interleave_blocks(_ptr(self.data), self.stride, self.type, len(self.data), self.cols // self.block,
                                   _ptr(buf))
        part = copy.copy(self)
        part.data, part.stride, part.blocked = buf.reshape(len(self.data), self.row_bytes), self.row_bytes, True
        _unmap_file_pages(self.data)
        return part

    @property
    def args(self) -> tuple[int, int, int, int, int]:
        """(base address, row stride, type, layout, twin header's address or 0) for the kernels;
        worked out once for the data held."""
        held = self.__dict__.get("_args")
        if held is not None and held[0] is self.data and held[1] == (self.col_range, self.stride) and held[3] is self.twin:
            return held[2]
        twin = 0 if self.twin is None else _ptr(self.twin)
        base = _ptr(self.data)
        if self.row_range is not None:  # likewise a held row keeps its number (a group: 16 rows)
            base -= self.row_range.start // (16 if self.interleaved else 1) * self.stride
        if self.col_range is not None:
            # Rows start at column col_range.start: the kernels add (col0 / block) * block bytes
            # to the base, so a held column keeps its number and every call site stays the same.
            base -= self.col_range.start // self.block * (self._x16_block_bytes if self.interleaved else self._block_bytes)
        a = (base, self.stride, self.type, X16 if self.interleaved else R16 if self.blocked else FILE_LAYOUT, twin)
        self._args = (self.data, (self.col_range, self.stride), a, self.twin)
        return a

    @staticmethod
    def _twin_threshold(name: str, threshold):
        if isinstance(threshold, np.ndarray):
            if threshold.dtype != np.float32 or threshold.size != 1:
                raise ValueError(f"{name}: the twin's threshold is one float32 value")
            return threshold, _ptr(threshold)
        if isinstance(threshold, int) and threshold:
            return None, threshold
        raise ValueError(f"{name}: the twin needs a threshold (a float32 array of one value, or its address)")

    def _twin_part(self, rows: range | None, cols: range | None) -> tuple[range, int, int]:
        if self.type not in COLS_TYPES:
            raise ValueError(f"tensor {self.name}: no input-major kernels for type {self.type} "
                             "(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K have them)")
        held_r = self.row_range or range(self.rows)
        rows = held_r if rows is None else rows
        col0, n = self._cols(self.col_range if cols is None else cols)
        if rows.step != 1 or not 0 <= rows.start < rows.stop <= self.rows:
            raise ValueError(f"{self.name}: twin rows {rows} outside 0..{self.rows}")
        return rows, col0, n

    def with_input_major(self, rows: range | None = None, cols: range | None = None, threshold=None) -> "FileMatrix":
        """This matrix (a copy of the object, the same data) carrying an input-major twin of rows
        `rows` (a range; None: the rows held), columns `cols` (whole blocks of 32; None: the
        columns held): TEAL's input sparsity. A one-token product of exactly those rows and
        columns then reads only the inputs with |x_j| > threshold (R/2 contiguous bytes each for
        Q4_0, and each block of 32 inputs' scales once if any of them is active); batches, row
        lists, other ranges and a negative threshold take this matrix as it is (base.c L_COLS,
        cols_generic.c). `threshold`: a float32 array of one value (kept alive here: the kernels
        read it at every product, so its owner may change it between calls, e.g. in shared
        memory), or the address of one. The twin is memory of its own, repacked from the file's
        rows at load whatever this object's layout; ValueError for a type without twin products
        (the caller keeps the matrix dense)."""
        rows, col0, n = self._twin_part(rows, cols)
        keep, thr_ptr = self._twin_threshold(self.name, threshold)
        nbytes = _kernels.cols_bytes(self.type, len(rows), n)
        buf = _twin_buffer(COLS_HEADER + nbytes)
        src = self.file_rows
        _kernels.cols_repack(_ptr(src), src.strides[0], self.type, rows.start, len(rows), col0, n, thr_ptr, _ptr(buf))
        if not np.may_share_memory(self.data, src):  # a held copy: the file's pages just read are not this one's
            _unmap_file_pages(src[rows.start:rows.stop])
        part = copy.copy(self)
        part.twin, part.twin_rows, part.twin_cols, part._twin_thr = buf, rows, range(col0, col0 + n), keep
        part.twin_parts = None
        return part

    @staticmethod
    def fuse_input_major(parts: list, cols: range | None = None, threshold=None) -> list["FileMatrix"]:
        """One input-major twin for several matrices that read the same input with one threshold
        (parts: [(matrix, rows), ...], rows a range or None as with_input_major's): their rows
        stacked in that order, so that a one-token product streams one channel row of all of them
        per active input (cols_generic.c COLS_MAGIC_FUSED). Returns the matrices: the first a
        copy carrying the fused twin (twin_rows: its own rows; twin_parts: every part's), the
        others as they were. Only callers that know the parts read it: ffn_token (gate | up of
        the owned neurons) and the attention step (Q | K | V of its heads, one token); every
        other product of these matrices, the first's included, reads their rows. The parts share
        a type and the columns `cols` (None: all)."""
        first = parts[0][0]
        if first.type not in FUSED_TYPES:
            raise ValueError(f"{first.name}: no fused input-major kernels for type {first.type}")
        spans = []
        for m, rows in parts:
            if m.type != first.type or m.cols != first.cols:
                raise ValueError(f"{m.name}: fused with {first.name}, of another type or width")
            spans.append((m, *m._twin_part(rows, cols)))
        col0, n = spans[0][2], spans[0][3]
        if any((c, k) != (col0, n) for _, _, c, k in spans):
            raise ValueError(f"{first.name}: fused twins read the same columns")
        keep, thr_ptr = FileMatrix._twin_threshold(first.name, threshold)
        stacked = np.concatenate([m.file_rows[r.start:r.stop] for m, r, _, _ in spans])
        total = len(stacked)
        nbytes = _kernels.cols_bytes(first.type, total, n)
        buf = _twin_buffer(COLS_HEADER + nbytes)
        _kernels.cols_repack(_ptr(stacked), stacked.strides[0], first.type, 0, total, col0, n, thr_ptr, _ptr(buf),
                             spans[0][1].start)
        del stacked
        for m, r, _, _ in spans:
            if not np.may_share_memory(m.data, m.file_rows):
                _unmap_file_pages(m.file_rows[r.start:r.stop])
        part = copy.copy(first)
        part.twin, part.twin_rows, part.twin_cols, part._twin_thr = buf, spans[0][1], range(col0, col0 + n), keep
        part.twin_parts = tuple((m.name, r) for m, r, _, _ in spans)
        return [part, *(m for m, _, _, _ in spans[1:])]

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
        _kernels.cols_dequant(_ptr(self.twin), _ptr(out))
        return out

    @property
    def _x16_block_bytes(self) -> int:
        """Bytes of 16 rows' block once interleaved: 16 of the file's, and Q4_K's scales and mins
        a byte each, IQ4_XS's and Q3_K's scales (interleaved_generic.c x16_block_bytes)."""
        return {12: 2368, 23: 2208, 11: 1824}.get(self.type, 16 * self._block_bytes)

    @property
    def _block_bytes(self) -> int:
        return self.row_bytes * self.block // self.cols  # row_bytes: a whole row's, held or not

    def keep_columns(self, cols: range) -> "FileMatrix":
        """This matrix holding only columns `cols` (whole blocks), copied into memory of its own
        and addressed by the same column numbers. A process that reads part of every row (its
        neurons' columns of down, its heads' columns of the attention output) would otherwise
        stream all of it: the hardware prefetchers fetch the lines between the parts too (the
        1.1B shape, one core: half of the output matrix's columns took 115 us, all of them 121;
        half of down's 195 us, all 315). The file's pages are then unmapped from this process,
        so it holds the part once, not the part and the whole."""
        if self.interleaved or self.blocked:
            raise ValueError(f"{self.name}: keep columns before interleaving, not after")
        col0, n = self._cols(cols)
        if n == self.cols:
            return self
        bb = self._block_bytes
        part = copy.copy(self)
        part.data = np.ascontiguousarray(self.data.view(np.uint8)[:, col0 // self.block * bb:(col0 + n) // self.block * bb])
        part.stride, part.col_range = part.data.strides[0], range(col0, col0 + n)
        _unmap_file_pages(self.data)
        return part

    def held_copy(self) -> "FileMatrix":
        """This matrix (the rows it holds, whole) copied as it is into memory of the process's own,
        the file's pages then unmapped from this process (as keep_columns does): rows a step
        reads in place would otherwise fault back in mid-token whenever the page cache has
        dropped them (a VM holding 7 GB of page cache, after other files were read: a 3B
        PowerInfer file's decode 1.95x llama.cpp's instead of 2.54x)."""
        if self.interleaved or self.blocked or self.col_range is not None or self.stride != self.row_bytes:
            raise ValueError(f"{self.name}: only whole rows in the file's layout are copied as they are")
        buf = _anonymous(len(self.data) * self.row_bytes)
        buf[:] = np.ascontiguousarray(self.data).view(np.uint8).reshape(-1)
        part = copy.copy(self)
        part.data = buf.reshape(len(self.data), self.row_bytes)
        _unmap_file_pages(self.data)
        return part

    def keep_rows(self, rows: range) -> "FileMatrix":
        """This matrix holding only rows `rows` (for interleave: a view of the file's, nothing is
        copied here), addressed by the same row numbers; other rows may not be asked for."""
        if self.row_range is not None or self.interleaved or self.blocked or rows.step != 1 or not 0 <= rows.start <= rows.stop <= self.rows:
            raise ValueError(f"{self.name}: cannot keep rows {rows}")
        part = copy.copy(self)
        part.data, part.row_range = self.data[rows.start:rows.stop], rows
        return part

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

    def _cols(self, cols) -> tuple[int, int]:
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
        col0, ncol = self._cols(cols)
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        if len(x) != ncol:
            raise ValueError(f"{self.name}: x has {len(x)} values for {ncol} columns")
        y = np.empty(n, np.float32) if out is None else out
        if y.dtype != np.float32 or not y.flags.c_contiguous or len(y) < n:
            raise ValueError("out must be a contiguous float32 array with room for every row")
        xq = q8_scratch(ncol) if xq is None else xq
        _kernels.matvec(*self.args, 0 if idx is None else _ptr(idx), start, n, col0, ncol, _ptr(x), int(fast),
                        _ptr(xq), _ptr(y))
        return y[:n]

    def prepare(self, rows=None, cols: range | None = None, fast: bool = False, xq: np.ndarray | None = None):
        """matvec with its rows, columns and buffers checked once: a function of x (float32,
        contiguous, len(cols) values) returning y, a buffer it reuses from call to call."""
        idx, start, n = self._rows(rows, fast)
        col0, ncol = self._cols(cols)
        y = np.empty(n, np.float32)
        xq = q8_scratch(ncol) if xq is None else xq
        fixed = (*self.args, 0 if idx is None else _ptr(idx), start, n, col0, ncol)
        tail = (int(fast), _ptr(xq), _ptr(y))
        keep = (idx, xq)  # the arrays the pointers point into live as long as the function

        def call(x: np.ndarray) -> np.ndarray:
            if x.dtype != np.float32 or x.shape != (ncol,) or not x.flags.c_contiguous:
                raise ValueError(f"{self.name}: x must be {ncol} contiguous float32 values")
            _kernels.matvec(*fixed, _ptr(x), *tail)
            return y
        call.keep = keep
        return call

    def matmul(self, x: np.ndarray, rows=None, cols: range | None = None, fast: bool = False,
               out: np.ndarray | None = None, xq: np.ndarray | None = None) -> np.ndarray:
        """Y[b, i] = row_i[cols] . x[b] for a small batch x (B, len(cols)), B <= MAX_SMALL_BATCH:
        each row is read once for all B tokens; Y[b] equals matvec(x[b]) bit for bit."""
        idx, start, n = self._rows(rows, fast)
        col0, ncol = self._cols(cols)
        x = np.ascontiguousarray(x, dtype=np.float32)
        B = _check_batch(x[None] if x.ndim == 1 else x, ncol, self.name)
        y = np.empty((B, n), np.float32) if out is None else out
        if y.dtype != np.float32 or not y.flags.c_contiguous or y.size < B * n:
            raise ValueError("out must be a contiguous float32 array with room for every row of every token")
        xq = q8_scratch(ncol, B) if xq is None else xq
        _kernels.matmul(*self.args, 0 if idx is None else _ptr(idx), start, n, col0, ncol, _ptr(x), ncol, B, int(fast),
                        _ptr(xq), _ptr(y), n)
        return y.reshape(-1)[: B * n].reshape(B, n)

    def prepare_batch(self, rows=None, cols: range | None = None, fast: bool = False):
        """matmul with its rows, columns and buffers checked once (as prepare): a function of
        x (B, len(cols)) float32, contiguous, 1 <= B <= MAX_SMALL_BATCH, returning Y (B, n_rows),
        a view of a buffer it reuses from call to call."""
        idx, start, n = self._rows(rows, fast)
        col0, ncol = self._cols(cols)
        y = np.empty((MAX_SMALL_BATCH, n), np.float32)
        xq = q8_scratch(ncol, MAX_SMALL_BATCH)
        fixed = (*self.args, 0 if idx is None else _ptr(idx), start, n, col0, ncol)
        keep = (idx, xq, y)
        name = self.name

        def call(x: np.ndarray) -> np.ndarray:
            B = _check_batch(x, ncol, name)
            _kernels.matmul(*fixed, _ptr(x), ncol, B, int(fast), _ptr(xq), _ptr(y), n)
            return y[:B]
        call.keep = keep
        return call

    def dequantize(self, rows=None, cols: range | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """The chosen rows and columns as float32 (n_rows, n_cols)."""
        idx, start, n = self._rows(rows, fast=True)
        col0, ncol = self._cols(cols)
        o = np.empty((n, ncol), np.float32) if out is None else out
        if o.dtype != np.float32 or not o.flags.c_contiguous or o.size < n * ncol:
            raise ValueError("out must be a contiguous float32 array with room for the rows")
        _kernels.dequant(*self.args, 0 if idx is None else _ptr(idx), start, n, col0, ncol, _ptr(o))
        return o.reshape(-1)[: n * ncol].reshape(n, ncol)


_scratch = np.empty(0, np.float32)


def dequant_scratch(n: int) -> np.ndarray:
    """A float32 buffer of `n` values, reused from call to call (one per process): a batched
    product dequantizes one matrix into it and runs its GEMM before the next one needs it."""
    global _scratch
    if _scratch.size < n:
        _scratch = np.empty(n, np.float32)
    return _scratch[:n]


class FfnScratch:
    """Per-process buffers the FFN kernel writes into, sized once for the largest shard; and,
    made on the first batch, three float32 tiles of `chunk` neurons for batched (prefill) steps."""

    def __init__(self, hidden: int, n_own: int):
        self.hidden, self.n_own = hidden, n_own
        self.h = np.empty(max(1, n_own), np.float32)
        self.xq = q8_scratch(hidden)
        self.hq = q8_scratch(n_own)
        self.y = np.empty(hidden, np.float32)
        # h, any, xq, hq, counts as ffn_token takes them (it has no any or counts), looked up once
        self.token_ptrs = (_ptr(self.h), 0, _ptr(self.xq), _ptr(self.hq), 0)
        self.tiles: list[np.ndarray] = []
        self.small: tuple[np.ndarray, ...] = ()

    def small_batch(self) -> tuple[np.ndarray, ...]:
        """ffn_batch's buffers for MAX_SMALL_BATCH tokens, made on the first small batch:
        h, any, xq, hq, counts (per token active neurons), y, thresholds."""
        if not self.small:
            B, n = MAX_SMALL_BATCH, max(1, self.n_own)
            self.small = (np.empty(B * n, np.float32), np.empty(n, np.uint8), q8_scratch(self.hidden, B),
                          q8_scratch(n, B), np.zeros(B, np.int64), np.empty((B, self.hidden), np.float32),
                          np.empty(B, np.float32))
            # h, any, xq, hq, counts as the kernel takes them: looked up once, not per layer and step
            self.small_ptrs = tuple(_ptr(a) for a in self.small[:5])
        return self.small

    def batch_tiles(self, chunk: int) -> list[np.ndarray]:
        if not self.tiles:
            self.tiles = [np.empty(chunk * self.hidden, np.float32) for _ in range(3)]
        return self.tiles


def _check_ffn(gate: FileMatrix, up: FileMatrix, down: FileMatrix, own: range, mask: np.ndarray | None,
               down_t: bool) -> int:
    """The checks ffn_token and ffn_batch share; returns the hidden size."""
    hidden = gate.cols
    d_rows, d_cols = (down.cols, down.rows) if down_t else (down.rows, down.cols)
    if not (up.cols == hidden and d_rows == hidden and gate.rows == up.rows == d_cols):
        raise ValueError(f"FFN shapes disagree: gate {gate.rows}x{gate.cols}, up {up.rows}x{up.cols}, "
                         f"down{'_t' if down_t else ''} {down.rows}x{down.cols}")
    align = neuron_align(down.type)  # down's columns are read in whole blocks (and h quantized by 32)
    aligned = own.start % align == 0 and (len(own) % align == 0 or own.stop == gate.rows)
    if own.step != 1 or own.stop > gate.rows or not (aligned or down_t):
        raise ValueError(f"owned neurons {own} are not a {align}-aligned range of the layer's {gate.rows}")
    if mask is not None and (mask.dtype != np.uint8 or len(mask) < gate.rows or not mask.flags.c_contiguous):
        raise ValueError("mask must be a contiguous uint8 array over the layer's neurons")
    return hidden


def ffn_token(gate: FileMatrix, up: FileMatrix, down: FileMatrix, x: np.ndarray, own: range, activation: str,
              scratch: FfnScratch, threshold: float | None = None, mask: np.ndarray | None = None,
              fast: bool = False, down_t: bool = False,
              out: np.ndarray | None = None, gate_mode: str = "par") -> tuple[np.ndarray, int]:
    """One token's partial FFN over owned neurons `own` (a range of the layer's aligned to whole
    blocks of down's rows, 32 or 256 values, or any range when `down_t`): (y (hidden,) float32 in scratch.y, active neurons). Dense unless
    `threshold` (|act(gate x)| > threshold) or `mask` (uint8 over all the layer's neurons) says
    which are active. `down_t`: `down` is stored transposed (n_ff rows of hidden values, as
    PowerInfer's ffn_down_t), and only active neurons' rows are read. `gate_mode`: GATE_BITS."""
    hidden = _check_ffn(gate, up, down, own, mask, down_t)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if len(x) != hidden:
        raise ValueError(f"x has {len(x)} values, the layer's hidden size is {hidden}")
    y = scratch.y if out is None else out  # out: e.g. the process's output slot in shared memory
    if y.dtype != np.float32 or y.shape != (hidden,) or not y.flags.c_contiguous:
        raise ValueError(f"out must be {hidden} contiguous float32 values")
    n = _kernels.ffn_token(*gate.args, *up.args, *down.args, int(down_t), hidden, own.start, len(own),
                           ACT_IDS[activation] | GATE_BITS[gate_mode], -1.0 if threshold is None else float(threshold), 0,
                           0 if mask is None else _ptr(mask), _ptr(x), 1, int(fast), *scratch.token_ptrs, _ptr(y))
    return y, n


def ffn_batch(gate: FileMatrix, up: FileMatrix, down: FileMatrix, x: np.ndarray, own: range, activation: str,
              scratch: FfnScratch, threshold=None, mask: np.ndarray | None = None, fast: bool = False,
              down_t: bool = False, out: np.ndarray | None = None, gate_mode: str = "par") -> tuple[np.ndarray, int]:
    """ffn_token for a small batch x (B, hidden), 1 <= B <= MAX_SMALL_BATCH, in one pass over the
    shard's rows: (y (B, hidden), active (neuron, token) pairs); scratch.small_batch()[4][:B]
    holds each token's count. `threshold`: one value for every token or B values (None, or a
    negative value: dense for that token), each token's neurons chosen by its own gate; `mask`
    is shared by all tokens. y[b] equals ffn_token(x[b]) bit for bit. `out`: (B, hidden)
    float32, contiguous (e.g. the first B rows of the process's output slot)."""
    hidden = _check_ffn(gate, up, down, own, mask, down_t)
    B = _check_batch(x, hidden, "ffn_batch")
    if len(own) > scratch.n_own or scratch.hidden != hidden:
        raise ValueError(f"scratch sized for {scratch.n_own} neurons of {scratch.hidden}, not {len(own)} of {hidden}")
    h, anyv, xq, hq, counts, ys, thr = scratch.small_batch()
    y = ys[:B] if out is None else out
    if y.dtype != np.float32 or y.shape != (B, hidden) or not y.flags.c_contiguous:
        raise ValueError(f"out must be ({B}, {hidden}) contiguous float32 values")
    if threshold is None:
        thr_ptr = 0
    else:
        thr[:B] = threshold  # a scalar or B values
        thr_ptr = _ptr(thr)
    n = _kernels.ffn_batch(*gate.args, *up.args, *down.args, int(down_t), hidden, own.start, len(own),
                           ACT_IDS[activation] | GATE_BITS[gate_mode], -1.0, thr_ptr, 0 if mask is None else _ptr(mask),
                           _ptr(x), B, int(fast), *scratch.small_ptrs, _ptr(y))
    return y, n


class AttentionStep:
    """One decoded token's attention block of one layer in one native call (_kernels.attn_token):
    RMSNorm, Q/K/V products (`q_rows`, `k_rows`: the file's rows in un-permuted order), RoPE
    from the model's cos / signed-sin tables, the KV cache write, softmax attention (GQA) and
    the output product, added to the residual in place. Everything is checked here, once."""

    def __init__(self, q: FileMatrix, q_rows: np.ndarray, k: FileMatrix, k_rows: np.ndarray, v: FileMatrix,
                 o: FileMatrix, norm: np.ndarray, eps: float, n_heads: int, n_kv: int, head_dim: int,
                 rope_dim: int, cos: np.ndarray, sin_signed: np.ndarray, k_cache: np.ndarray,
                 v_cache: np.ndarray, fast: bool):
        hidden, max_ctx = q.cols, k_cache.shape[1]
        if not (q.rows == len(q_rows) == n_heads * head_dim and k.rows == len(k_rows) == v.rows == n_kv * head_dim
                and k.cols == v.cols == hidden and o.cols == n_heads * head_dim and o.rows == hidden):
            raise ValueError("attention shapes disagree")
        for a, shape in ((norm, (hidden,)), (cos, (max_ctx, rope_dim)), (sin_signed, (max_ctx, rope_dim)),
                         (k_cache, (n_kv, max_ctx, head_dim)), (v_cache, (n_kv, max_ctx, head_dim))):
            if a.dtype != np.float32 or a.shape != shape or not a.flags.c_contiguous:
                raise ValueError(f"attention table of shape {a.shape} {a.dtype}, expected {shape} float32, contiguous")
        if rope_dim > min(head_dim, 1024) or rope_dim % 2 or n_heads % n_kv:
            raise ValueError("attention: rope dimension or head counts not supported natively")
        self.q_rows, self.k_rows = (np.ascontiguousarray(r, dtype=np.int32) for r in (q_rows, k_rows))
        for rows, n in ((self.q_rows, n_heads), (self.k_rows, n_kv)):  # attn_part reads Q and K in file order
            heads = rows.reshape(n, head_dim)
            if not (np.sort(heads, axis=1) == np.arange(n * head_dim).reshape(n, head_dim)).all():
                raise ValueError("attention: q_rows and k_rows must order rows within each head only")
        self.keep = (q, k, v, o, norm, cos, sin_signed, k_cache, v_cache)
        self.weight_bytes = sum(m.rows * m.row_bytes for m in (q, k, v, o))
        self.hidden, self.max_ctx = hidden, max_ctx
        self.scratch = [np.empty(n, np.float32) for n in (hidden, n_heads * head_dim, n_kv * head_dim,
                                                          n_kv * head_dim, max_ctx, n_heads * head_dim)]
        self.scratch += [q8_scratch(hidden), q8_scratch(n_heads * head_dim)]
        self.cos, self.sin = _ptr(cos), _ptr(sin_signed)
        self._head = lambda q, k, v, o: (*q.args, _ptr(self.q_rows), *k.args, _ptr(self.k_rows), *v.args, *o.args,
                                         _ptr(norm), float(eps), hidden, n_heads, n_kv, head_dim, rope_dim)
        self.head = self._head(q, k, v, o)
        self.head_dim, self.group = head_dim, n_heads // n_kv
        self.o_cols_per_kv = n_heads // n_kv * head_dim
        self.part_heads, self.part_head = None, self.head  # keep_output_columns
        self.cache_shape = k_cache.shape
        self.tail = (_ptr(k_cache), _ptr(v_cache), max_ctx, int(fast), *(_ptr(a) for a in self.scratch))
        self.sizes = (hidden, n_heads * head_dim, n_kv * head_dim)
        self.fast, self.batch_tail = int(fast), None

    def _check_rows(self, h: np.ndarray, pos: np.ndarray, kp: np.ndarray, vp: np.ndarray) -> None:
        B = len(pos)
        if h.dtype != np.float32 or h.shape != (B, self.hidden) or not h.flags.c_contiguous or not (
                1 <= B <= MAX_SMALL_BATCH and len(kp) == len(vp) == B
                and pos.dtype == kp.dtype == vp.dtype == np.int64):
            raise ValueError(f"attention batch: h must be (B, {self.hidden}) float32 with one position and cache "
                             f"per row, 1 <= B <= {MAX_SMALL_BATCH}")
        if self.batch_tail is None:  # room for MAX_SMALL_BATCH rows, made on first use
            hidden, nq, nk = self.sizes
            n = MAX_SMALL_BATCH
            self.batch_scratch = [np.empty(m, np.float32) for m in (n * hidden, n * nq, n * nk, n * nk, self.max_ctx,
                                                                    n * nq)]
            self.batch_scratch += [q8_scratch(hidden, n), q8_scratch(nq, n)]
            self.batch_tail = tuple(_ptr(a) for a in self.batch_scratch)

    def keep_output_columns(self, kv0: int, kv1: int) -> None:
        """A process that computes the share of KV heads [kv0, kv1) (`part`) keeps their columns
        of the output matrix in memory of their own (FileMatrix.keep_columns: read in part from
        the file, every row of it would stream whole). Other calls read the file as before."""
        cols = self.o_cols_per_kv
        q, k, v, o = self.keep[:4]
        self.o_part = o.keep_columns(range(kv0 * cols, kv1 * cols))
        qkv = q, k, v
        # Fast mode: the share's rows of Q, K and V and its columns of the output interleaved
        # 16 by 16 where they can be (attn_part asks for them as ranges, in file order)
        if self.fast:
            q_rows = range(kv0 * self.group * self.head_dim, kv1 * self.group * self.head_dim)
            k_rows = range(kv0 * self.head_dim, kv1 * self.head_dim)
            qkv = tuple(m.for_fast_products(r) for m, r in ((q, q_rows), (k, k_rows), (v, k_rows)))
            self.o_part = self.o_part.for_fast_products()
        self.qkv_part = qkv  # alive as long as the addresses in part_head
        self.part_heads, self.part_head = (kv0, kv1), self._head(*qkv, self.o_part)

    def add_twins(self, add) -> None:
        """Input-major twins (sparsecore/input_sparsity.py): add(matrix, rows, cols, site) gives
        the matrix carrying one, or the matrix itself. Q, K and V over the rows of the heads this
        step computes (input "attn_in"; one fused twin, Q's rows then K's then V's, where add has
        `fused`), the output matrix over their columns ("attn_out"): the
        share kept by keep_output_columns, else every head. A one-token product then reads the
        twin (the kernels' dispatch); prompts and batches the rows as before."""
        if self.part_heads is not None:
            kv0, kv1 = self.part_heads
            q_rows = range(kv0 * self.group * self.head_dim, kv1 * self.group * self.head_dim)
            k_rows = range(kv0 * self.head_dim, kv1 * self.head_dim)
            cols = range(kv0 * self.o_cols_per_kv, kv1 * self.o_cols_per_kv)
            q, k, v = self.qkv_part
            fused = getattr(add, "fused", None)
            if fused is not None:  # Q's rows, K's, V's: one twin (attn_part's one-token products)
                self.qkv_part = tuple(fused([(q, q_rows), (k, k_rows), (v, k_rows)], None, "attn_in"))
            else:
                self.qkv_part = (add(q, q_rows, None, "attn_in"), add(k, k_rows, None, "attn_in"),
                                 add(v, k_rows, None, "attn_in"))
            self.o_part = add(self.o_part, None, cols, "attn_out")
            self.part_head = self._head(*self.qkv_part, self.o_part)
            return
        q, k, v, o = self.keep[:4]
        fused = getattr(add, "fused", None)
        qkv = fused([(q, None), (k, None), (v, None)], None, "attn_in") if fused is not None else \
            [add(q, None, None, "attn_in"), add(k, None, None, "attn_in"), add(v, None, None, "attn_in")]
        whole = (*qkv, add(o, None, None, "attn_out"))
        self.keep = (*whole, *self.keep[4:])
        self.head = self.part_head = self._head(*whole)

    def part(self, h: np.ndarray, pos: np.ndarray, kp: np.ndarray, vp: np.ndarray, kv0: int, kv1: int,
             out: np.ndarray) -> None:
        """The share of KV heads [kv0, kv1) (and their query heads) in the attention output of
        each row of h (_kernels.attn_part): written to out (B, hidden), h left as it is. Their
        keys and values go into the caches at kp, vp (addresses of head 0 of this layer's caches,
        as for `batch`). Shares of disjoint ranges summed are the whole attention: processes
        that split a layer's heads each compute one (coordinator/attention_split.py)."""
        self._check_rows(h, pos, kp, vp)
        if out.dtype != np.float32 or out.shape != h.shape or not out.flags.c_contiguous:
            raise ValueError(f"attention share: out must be {h.shape} float32, contiguous")
        held = self.part_heads
        head = self.part_head if held is not None and held[0] <= kv0 <= kv1 <= held[1] else self.head
        _kernels.attn_part(*head, self.cos, self.sin, len(pos), _ptr(pos), _ptr(kp), _ptr(vp), self.max_ctx,
                           self.fast, *self.batch_tail, _ptr(h), int(kv0), int(kv1), _ptr(out))

    def batch(self, h: np.ndarray, pos: np.ndarray, kp: np.ndarray, vp: np.ndarray) -> None:
        """Several sequences' decoded tokens (continuous batching) in one call, the weights read
        once for all B (_kernels.attn_batch); per row the arithmetic of a call of the step alone.
        h (B, hidden) float32 contiguous, updated in place; pos, kp, vp: B int64 (positions, and
        the addresses of this layer's key and value caches, each shaped like the constructor's).
        The caller (Transformer.decode_batch) checks the caches once per step, not per layer."""
        self._check_rows(h, pos, kp, vp)
        _kernels.attn_batch(*self.head, self.cos, self.sin, len(pos), _ptr(pos), _ptr(kp), _ptr(vp), self.max_ctx,
                            self.fast, *self.batch_tail, _ptr(h))

    def __call__(self, h: np.ndarray, pos: int, cache: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """h (hidden,) float32, contiguous: the residual, updated in place; pos: the token's position.
        `cache`: another sequence's (keys, values) of this layer, shaped like the ones given at
        construction (continuous batching: one step object, one cache per sequence)."""
        if h.dtype != np.float32 or h.shape != (self.hidden,) or not h.flags.c_contiguous or not 0 <= pos < self.max_ctx:
            raise ValueError("attention step: h must be the hidden-size float32 residual, pos within the cache")
        tail = self.tail
        if cache is not None:
            k, v = cache
            for a in (k, v):
                if a.dtype != np.float32 or a.shape != self.cache_shape or not a.flags.c_contiguous:
                    raise ValueError(f"attention step: cache of shape {a.shape} {a.dtype}, expected {self.cache_shape}")
            tail = (_ptr(k), _ptr(v), *tail[2:])
            self.keep_cache = cache  # alive until the next call, like the constructor's
        _kernels.attn_token(*self.head, self.cos, self.sin, pos,
                            *tail, _ptr(h))
