"""Memory a process holds of its own for weights, apart from the mapped file: anonymous maps in
transparent huge pages for repacked and copied rows (`anonymous`), the arena that input-major
twins are carved from (`twin_buffer`), giving the file's pages back once their bytes are held
elsewhere (`unmap_file_pages`), and the address of an array handed to the kernels (`ptr`).
Nothing here is freed by hand: an array keeps its map alive, and the arena's maps live as long
as the process (the twins in them do too).
"""
from __future__ import annotations

import ctypes
import mmap

import numpy as np


def unmap_file_pages(a: np.ndarray) -> None:
    """Drop this process's mapping of the pages under `a` if it views a memory-mapped file
    (madvise MADV_DONTNEED): the bytes stay in the page cache and fault back in if read again,
    but stop counting in resident memory. Anything else (a converted tensor in anonymous
    memory, which MADV_DONTNEED would zero) is left alone."""
    base = a
    while getattr(base, "base", None) is not None and not isinstance(base, mmap.mmap):
        base = base.base
    if not isinstance(base, mmap.mmap) or isinstance(base, AnonymousMap) or not a.nbytes \
            or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page, origin = mmap.PAGESIZE, ptr(np.frombuffer(base, np.uint8))  # the mapping starts on a page
    start = (ptr(a) - origin) // page * page
    end = min(len(base), ptr(a) - origin + (a.shape[0] - 1) * a.strides[0] + a.shape[1] * a.itemsize)
    base.madvise(mmap.MADV_DONTNEED, start, end - start)


class AnonymousMap(mmap.mmap):
    """Memory of the process's own, mapped: never a file's pages to unmap (unmap_file_pages)."""


def anonymous(n: int) -> np.ndarray:
    """n bytes of anonymous memory, page-aligned, in transparent huge pages where the kernel
    gives them: an interleaved copy is written once at load, and on these VMs a first write
    faulting 4 KB at a time cost more than the copying (the 1.1B shape's Q6_K lm_head: 252 ->
    61 ms)."""
    if n < 1 << 21 or not hasattr(mmap, "MADV_HUGEPAGE"):
        raw = np.empty(n + 64, np.uint8)
        return raw[-ptr(raw) % 64:][:n]  # 64-byte aligned
    m = AnonymousMap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # no transparent huge pages here: 4 KB pages it is
        pass
    return np.frombuffer(m, np.uint8)


TWIN_CHUNK = 64 << 20  # bytes of address space per arena map (untouched pages cost nothing)
twin_arena: list = [None, 0]  # the current map and its next free byte


def twin_buffer(n: int) -> np.ndarray:
    """n bytes (64-byte aligned, on a 4 KB page) for an input-major twin, carved from maps of
    anonymous memory in transparent huge pages (anonymous), one after another: a twin under
    2 MB (a process's Q|K|V or output columns of the 1.1B shape: 1.2-1.5 MB) in pages of its
    own would take 4 KB pages, and its products, whose channel rows jump pages at every
    active input, ran 10-15 % slower (one core, from memory: 104 -> 93 us a layer at 50 %)."""
    need = -(-n // 4096) * 4096
    m, off = twin_arena
    if m is None or off + need > len(m):
        m, off = anonymous(max(TWIN_CHUNK, -(-need // (1 << 21)) * (1 << 21))), 0
    twin_arena[:] = m, off + need
    return m[off:off + n]


def ptr(a: np.ndarray) -> int:
    """The address of a's first element. Through ctypes for a writable array (0.5 us); the
    array interface, which builds a dict (1.5 us), only for a read-only one (a file's map):
    a decoded layer hands the kernels some twenty addresses, ten of them per call."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.__array_interface__["data"][0]
