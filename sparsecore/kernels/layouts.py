"""Layout conversions of a FileMatrix (sparsecore/kernels/file_matrix.py): each returns a new
matrix over other memory, the one it was given left as it was. Rows or columns kept
(keep_rows, keep_columns), a held copy of the file's rows (held_copy), the repacked layouts X16
(interleave, for_fast_products) and R16 (interleave_blocks, for_row_products), and input-major
twins (with_input_major, fuse_input_major). The memory they fill comes from held_memory.py,
or, where the process has a layout cache, from the file the conversion was written to on an
earlier start (layout_cache.py: read back, or left mapped where the memory plan says so).
FileMatrix carries each as a method of the same name, so conversions chain:
`m.keep_rows(r).interleave()`.
"""
from __future__ import annotations

from copy import copy as copy_of
from typing import TYPE_CHECKING

import numpy as np

from . import _kernels
from .formats import COLS_HEADER, COLS_TYPES, FUSED_TYPES, R16_TYPES, X16_TYPES, blocked_rows, interleaving
from . import layout_cache
from .held_memory import anonymous, ptr, twin_buffer, unmap_file_pages

if TYPE_CHECKING:
    from .file_matrix import FileMatrix


# Conversions copy this many source bytes at a time, dropping the file's pages of each piece as
# soon as it is copied: converting the whole matrix and then dropping its pages held the source
# and the copy at once (Gemma 3 270M's 178 MB head: every process peaked 85 MB above where it
# settled, which is peak memory the kernel must find at load and a bigger-than-memory run cannot).
CHUNK_BYTES = 4 << 20


def _made(key: str, nbytes: int, alloc, fill, mappable: bool = True) -> np.ndarray:
    """A conversion's nbytes of output: fill(alloc(nbytes)), or, where the process has a layout
    cache (layout_cache.active), its file's bytes when it holds them (nothing read from the
    model then) and the made ones written to it. key: what the output depends on besides the
    model file, the level and the kernels' build (its directory's)."""
    cache = layout_cache.active
    if cache is None:
        buf = alloc(nbytes)
        fill(buf)
        return buf
    return cache.product(key, nbytes, alloc, fill, mappable)


def _np_bytes(n: int) -> np.ndarray:
    return np.empty(n, np.uint8)


def _chunks(n_rows: int, row_bytes: int, multiple: int = 1):
    """Row ranges of about CHUNK_BYTES of source each, starting on a multiple of `multiple`."""
    step = max(multiple, CHUNK_BYTES // max(1, row_bytes) // multiple * multiple)
    for r0 in range(0, n_rows, step):
        yield r0, min(n_rows, r0 + step)


def keep_rows(m: FileMatrix, rows: range) -> "FileMatrix":
    """This matrix holding only rows `rows` (for interleave: a view of the file's, nothing is
    copied here), addressed by the same row numbers; other rows may not be asked for."""
    if m.row_range is not None or m.interleaved or m.blocked or rows.step != 1 or not 0 <= rows.start <= rows.stop <= m.rows:
        raise ValueError(f"{m.name}: cannot keep rows {rows}")
    part = copy_of(m)
    part.data, part.row_range = m.data[rows.start:rows.stop], rows
    return part


def keep_columns(m: FileMatrix, cols: range, copy: bool = True) -> "FileMatrix":
    """This matrix holding only columns `cols` (whole blocks), copied into memory of its own
    and addressed by the same column numbers. A process that reads part of every row (its
    neurons' columns of down, its heads' columns of the attention output) would otherwise
    stream all of it: the hardware prefetchers fetch the lines between the parts too (the
    1.1B shape, one core: half of the output matrix's columns took 115 us, all of them 121;
    half of down's 195 us, all 315). The file's pages are then unmapped from this process,
    so it holds the part once, not the part and the whole. `copy` False: a view of the file's
    rows instead, for a conversion that copies the columns itself (columns_for: interleave)."""
    if m.interleaved or m.blocked:
        raise ValueError(f"{m.name}: keep columns before interleaving, not after")
    col0, n = m.column_span(cols)
    if n == m.cols:
        return m
    bb = m.block_bytes
    src = m.data.view(np.uint8)[:, col0 // m.block * bb:(col0 + n) // m.block * bb]
    part = copy_of(m)
    part.col_range = range(col0, col0 + n)
    if not copy:
        part.data = src
        return part

    def fill(buf):
        data = buf.reshape(src.shape)
        for r0, r1 in _chunks(len(src), m.stride):
            data[r0:r1] = src[r0:r1]
            unmap_file_pages(m.data[r0:r1])

    key = f"cols:{m.name}:{m.type}:{m.row_range}:{col0}:{n}"
    part.data = _made(key, src.size, _np_bytes, fill).reshape(src.shape)
    part.stride = part.data.strides[0]
    return part


def columns_for(m: FileMatrix, cols: range, fast: bool) -> "FileMatrix":
    """Columns `cols` of m held as its products will read them: interleaved where fast mode
    interleaves m (the interleaving copies only those columns: no copy of them in the file's
    layout first), else copied as they are (keep_columns)."""
    if fast and can_interleave(m):
        return interleave(keep_columns(m, cols, copy=False))
    return keep_columns(m, cols)


def held_copy(m: FileMatrix) -> "FileMatrix":
    """This matrix (the rows it holds, whole) copied as it is into memory of the process's own,
    the file's pages then unmapped from this process (as keep_columns does): rows a step
    reads in place would otherwise fault back in mid-token whenever the page cache has
    dropped them (a VM holding 7 GB of page cache, after other files were read: a 3B
    PowerInfer file's decode 1.95x llama.cpp's instead of 2.54x). With a layout cache the copy
    is its file, mapped whole where the plan holds everything (layout_cache.LayoutCache): pages
    a decode touches at every token stay on the active list (a 2 GB cgroup streaming 6 GB of
    other files through it decoded the 1.1B shape at 32 tok/s mapped, 23 copied)."""
    if m.interleaved or m.blocked or m.col_range is not None or m.stride != m.row_bytes:
        raise ValueError(f"{m.name}: only whole rows in the file's layout are copied as they are")
    shape = (len(m.data), m.row_bytes)

    def fill(buf):
        data = buf.reshape(shape)
        for r0, r1 in _chunks(len(m.data), m.row_bytes):
            data[r0:r1] = m.data[r0:r1].view(np.uint8)
            unmap_file_pages(m.data[r0:r1])

    part = copy_of(m)
    part.data = _made(f"held:{m.name}:{m.type}:{m.row_range}", shape[0] * shape[1], anonymous, fill).reshape(shape)
    return part


def can_interleave(m: FileMatrix) -> bool:
    """Whether interleave() takes this matrix: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K, IQ4_NL,
    IQ4_XS, Q2_K, Q3_K or MXFP4, at an ISA level
    with interleaved tiles (interleaving())."""
    return m.type in X16_TYPES and not m.interleaved and interleaving(m.type)


def interleave(m: FileMatrix) -> "FileMatrix":
    """This matrix (the columns it holds) with its rows 16 side by side, in memory of its own
    (interleaved_generic.c interleave: the same bytes, the file's pages then unmapped from this process,
    as keep_columns does). For fast mode's dense products only: one token's integer dots
    then cost a third of the vector operations, shared by 16 rows (one vpdpbusd covers 4
    weights of 16 rows), which is what lets a batch of sequences or a prompt's tiles cost
    little more than one token. Rows are then taken as ranges starting on a multiple of 16,
    never one at a time: a shard that picks rows by activity keeps the file's layout."""
    if m.interleaved:
        raise ValueError(f"tensor {m.name}: already interleaved")
    if m.type not in X16_TYPES:
        raise ValueError(f"tensor {m.name}: only Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K, IQ4_NL, IQ4_XS, "
                         f"Q2_K, Q3_K and MXFP4 rows interleave")
    held = m.col_range or range(m.cols)
    nb, gb = len(held) // m.block, m.x16_block_bytes
    n_held = len(m.data)  # rows held: all, or row_range's
    if m.row_range is not None and m.row_range.start % 16:
        raise ValueError(f"{m.name}: interleaved rows start on a multiple of 16, not {m.row_range.start}")
    groups = -(-n_held // 16)

    def fill(flat):
        out = flat.reshape(groups, nb * gb)
        for r0, r1 in _chunks(n_held, m.stride, 16):
            _kernels.interleave(ptr(m.data[r0:]), m.stride, m.type, r1 - r0, nb, ptr(out[r0 // 16:]))
            unmap_file_pages(m.data[r0:r1])

    key = f"x16:{m.name}:{m.type}:{m.row_range}:{m.col_range}"
    buf = _made(key, groups * nb * gb, anonymous, fill).reshape(groups, nb * gb)
    part = copy_of(m)
    part.data, part.stride, part.interleaved = buf, nb * gb, True
    return part


def for_fast_products(m: FileMatrix, rows: range | None = None) -> "FileMatrix":
    """The matrix to run fast-mode products of `rows` (a range; None: all) on: those rows
    interleaved where they can be (can_interleave, the range starting on 16 rows), else
    this matrix as it is. One rule for every caller (FFN, attention, lm_head)."""
    if not can_interleave(m) or (rows is not None and rows.start % 16):
        return m
    return interleave(m if rows is None else keep_rows(m, rows))


def can_interleave_blocks(m: FileMatrix) -> bool:
    """Whether interleave_blocks() takes this matrix: whole rows of Q4_0, Q4_1 or Q8_0 in the
    file's layout."""
    return m.type in R16_TYPES and not (m.interleaved or m.blocked) and m.col_range is None


def interleave_blocks(m: FileMatrix) -> "FileMatrix":
    """This matrix with each row's blocks 16 side by side (layout R16, base.c): every row keeps
    its place and its bytes, every 16 of its blocks laid out as `interleave` lays out 16
    rows' block (its last nb % 16 blocks as a run of that many). For fast mode's products of
    rows a shard picks by activity (threshold steps' up rows, predictors' gate and up rows),
    which one by one cannot share the work of 16 rows: here a row's 16 blocks share it instead (1.1B shape, one core, a quarter of
    a layer's up rows picked at random: see docs/KERNELS.md, Rows picked by activity)."""
    if not can_interleave_blocks(m):
        raise ValueError(f"tensor {m.name}: only whole rows of Q4_0, Q4_1 or Q8_0 interleave their blocks")
    shape = (len(m.data), m.row_bytes)

    def fill(flat):
        out = flat.reshape(shape)
        for r0, r1 in _chunks(len(m.data), m.stride):
            _kernels.interleave_blocks(ptr(m.data[r0:]), m.stride, m.type, r1 - r0, m.cols // m.block, ptr(out[r0:]))
            unmap_file_pages(m.data[r0:r1])

    buf = _made(f"r16:{m.name}:{m.type}:{m.row_range}", shape[0] * shape[1], anonymous, fill).reshape(shape)
    part = copy_of(m)
    part.data, part.stride, part.blocked = buf, m.row_bytes, True
    return part


def for_row_products(m: FileMatrix, rows: range | None = None) -> "FileMatrix":
    """The matrix to run fast-mode products of rows picked one by one on (rows: the range a
    shard may pick from; None: all): those rows with their blocks interleaved where they can
    be (interleave_blocks: Q4_0, Q4_1 or Q8_0, at any SIMD level: formats.blocked_rows), else this matrix
    as it is."""
    if not (can_interleave_blocks(m) and blocked_rows()):
        return m
    return interleave_blocks(m if rows is None else keep_rows(m, rows))


def _twin_threshold(name: str, threshold):
    if isinstance(threshold, np.ndarray):
        if threshold.dtype != np.float32 or threshold.size != 1:
            raise ValueError(f"{name}: the twin's threshold is one float32 value")
        return threshold, ptr(threshold)
    if isinstance(threshold, int) and threshold:
        return None, threshold
    raise ValueError(f"{name}: the twin needs a threshold (a float32 array of one value, or its address)")


def _twin_part(m: FileMatrix, rows: range | None, cols: range | None) -> tuple[range, int, int]:
    if m.type not in COLS_TYPES:
        raise ValueError(f"tensor {m.name}: no input-major kernels for type {m.type} "
                         "(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K have them)")
    held_r = m.row_range or range(m.rows)
    rows = held_r if rows is None else rows
    col0, n = m.column_span(m.col_range if cols is None else cols)
    if rows.step != 1 or not 0 <= rows.start < rows.stop <= m.rows:
        raise ValueError(f"{m.name}: twin rows {rows} outside 0..{m.rows}")
    return rows, col0, n


def _twin_made(key: str, nbytes: int, fill, thr_ptr: int) -> np.ndarray:
    """A twin (header and data) made by fill, or read back from the layout cache: its header's
    threshold address is this process's (cols_generic.c cols_hdr.thr, at byte 40) and its
    counters start at zero, whatever the file holds."""
    buf = _made(key, nbytes, twin_buffer, fill, mappable=False)  # huge pages (held_memory.twin_buffer)
    if layout_cache.active is not None:
        head = buf[:COLS_HEADER].view(np.int64)
        head[5], head[6], head[7] = thr_ptr, 0, 0
    return buf


def with_input_major(m: FileMatrix, rows: range | None = None, cols: range | None = None, threshold=None) -> "FileMatrix":
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
    rows, col0, n = _twin_part(m, rows, cols)
    keep, thr_ptr = _twin_threshold(m.name, threshold)
    nbytes = _kernels.cols_bytes(m.type, len(rows), n)
    src = m.file_rows

    def fill(buf):
        _kernels.cols_repack(ptr(src), src.strides[0], m.type, rows.start, len(rows), col0, n, thr_ptr, ptr(buf))
        if not np.may_share_memory(m.data, src):  # a held copy: the file's pages just read are not this one's
            unmap_file_pages(src[rows.start:rows.stop])

    buf = _twin_made(f"twin:{m.name}:{m.type}:{rows}:{col0}:{n}", COLS_HEADER + nbytes, fill, thr_ptr)
    part = copy_of(m)
    part.twin, part.twin_rows, part.twin_cols, part.twin_threshold_held = buf, rows, range(col0, col0 + n), keep
    part.twin_parts = None
    return part


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
        spans.append((m, *_twin_part(m, rows, cols)))
    col0, n = spans[0][2], spans[0][3]
    if any((c, k) != (col0, n) for _, _, c, k in spans):
        raise ValueError(f"{first.name}: fused twins read the same columns")
    keep, thr_ptr = _twin_threshold(first.name, threshold)
    total = sum(len(r) for _, r, _, _ in spans)
    nbytes = _kernels.cols_bytes(first.type, total, n)

    def fill(buf):
        stacked = np.concatenate([m.file_rows[r.start:r.stop] for m, r, _, _ in spans])
        _kernels.cols_repack(ptr(stacked), stacked.strides[0], first.type, 0, total, col0, n, thr_ptr, ptr(buf),
                             spans[0][1].start)
        del stacked
        for m, r, _, _ in spans:
            if not np.may_share_memory(m.data, m.file_rows):
                unmap_file_pages(m.file_rows[r.start:r.stop])

    key = "twinf:" + ",".join(f"{m.name}:{r}" for m, r, _, _ in spans) + f":{first.type}:{col0}:{n}"
    buf = _twin_made(key, COLS_HEADER + nbytes, fill, thr_ptr)
    part = copy_of(first)
    part.twin, part.twin_rows, part.twin_cols, part.twin_threshold_held = buf, spans[0][1], range(col0, col0 + n), keep
    part.twin_parts = tuple((m.name, r) for m, r, _, _ in spans)
    return [part, *(m for m, _, _, _ in spans[1:])]
