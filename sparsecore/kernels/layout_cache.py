"""The repacked layouts kept on disk: every conversion layouts.py makes at load (X16, R16, held
rows and columns, input-major twins) is written once to a file of its own in a directory for the
model, the instruction set level and the kernels' build, and read back on every later start
instead of being made again: no repacking on a warm start, and a matrix the memory plan leaves
out of memory is mapped from its file (page cache the kernel can drop and read back) instead of
being anonymous memory a run must hold whole.

One file per conversion (a process's part of one matrix: one expert's rows, one layer's gate):
what one token reads of a cold unit is one contiguous run on disk. A file is written to a
temporary name and linked into place, so a reader sees it whole or not at all; processes that
hold the same layouts (dealt experts, each process every expert whole) may make one at the same
time, and the first file written is the one they all map (LayoutCache._write). A file starts with a
4096-byte header (magic, version, the conversion's key, its size, the sum of all its 64-bit
words and a CRC-32 of a sample of its pages); the data follows, page-aligned. A file whose header, size or
checksum does not match is made again, with a one-line notice.

Where a product goes. A held product (one the memory plan keeps in memory) is mapped from its
file (MAP_PRIVATE: clean page cache, shared, nothing copied) with the sum of all of it checked,
which also faults it in; where the plan leaves some units on disk (LayoutCache.copy_held), or
for a twin (whose sparse products jump pages and want huge pages), it is read into anonymous
memory instead, which the kernel cannot drop for the cold units' reads. A cold product stays
mapped with only the sampled CRC checked (one page in 64, not all of what may stay on disk).
The loader says which for each unit it loads (LayoutCache.placing).
"""
from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import struct
import sys
import zlib
from pathlib import Path

import numpy as np

from . import _kernels
from .formats import isa

# Bump when any conversion's output bytes change for the same input (the kernels' build hash,
# part of the directory's name, catches most of it; this catches a change in this file's rules).
LAYOUT_VERSION = 2
HEADER = 4096
MAGIC = b"sparseinfer-lay1"
_HEAD = struct.Struct("<16sIQQII")  # magic, version, nbytes, sum of all, crc of the sample, key length
SAMPLE_STRIDE = 64 * 4096  # the mapped check reads one page in every 64 (and the last)
COPY_CHUNK = 8 << 20
# read_ahead asks for this much at a time: one MADV_WILLNEED reads no more than the device's
# readahead window (or its largest request) of what it is given, the rest was left to faults
READ_CHUNK = 256 << 10
# Device readahead (read_ahead_kb) above which a cold dense layer is read ahead by the layer
# before it rather than by its faults. This VM's virtio disk at its 8 MB: faults read the 1.45 GB
# Q8_0 shape's cold layers at 0.66 GB/s (1.18 tok/s under 1000 MB), explicit reads one layer
# ahead at 0.87 (1.52 tok/s); at 128 KB the faults' 1.1 GB/s (2.06 tok/s) beat them (1.51).
LARGE_READAHEAD_KB = 1024


def _sum_all(view, total: int = 0) -> int:
    """The sum of its 64-bit words (its last bytes as one more), mod 2^64: any word changed
    changes it, and it runs at memory speed (28 GB/s here, where CRC-32 ran at 3: a warm start
    of the 30B-A3B shape checked its 2.9 GB slower than it repacked them)."""
    n = len(view) // 8 * 8
    words = np.frombuffer(view, np.uint64, n // 8)
    total = (total + int(words.sum(dtype=np.uint64))) & (2**64 - 1)
    return (total + int.from_bytes(bytes(view[n:]), "little")) & (2**64 - 1)


def _crc_sample(view: memoryview) -> int:
    crc = 0
    for off in range(0, len(view), SAMPLE_STRIDE):
        crc = zlib.crc32(view[off:off + 4096], crc)
    return zlib.crc32(view[max(0, len(view) - 4096):], crc)


def device_readahead_kb(path: Path) -> int | None:
    """The readahead window, in KB, of the device holding `path` (its backing device's
    read_ahead_kb in sysfs), or None where it cannot be read."""
    try:
        dev = os.stat(path).st_dev
        return int(Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").read_text())
    except (OSError, ValueError):
        return None


def kernels_build() -> str:
    """A hash of the compiled kernels (the conversions are theirs): another build, another directory."""
    h = hashlib.sha1()
    with open(_kernels.__file__, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:12]


def model_directory(root: Path, model_path: Path, isa: str) -> Path:
    """root/<model stem>-<path hash>/<size>-<mtime>-<isa>-v<version>-<kernels>: a changed model
    (size or mtime), another level or another build of the kernels never reads another's files."""
    p = Path(model_path).resolve()
    st = p.stat()
    model = f"{p.stem[:48]}-{hashlib.sha1(str(p).encode()).hexdigest()[:8]}"
    return Path(root) / model / f"{st.st_size}-{st.st_mtime_ns}-{isa}-v{LAYOUT_VERSION}-{kernels_build()}"


def level_directory(root: str | Path, model_path: str | Path) -> Path | None:
    """This process's directory under `root` ("": None) for the model at the level it runs."""
    return model_directory(Path(root), Path(model_path), isa()) if root else None


def prune_stale(directory: Path) -> None:
    """Remove the model's other directories but its other levels' (tests and `--isa` switch
    levels): those of an earlier version of the file (another size or mtime), of another layout
    version or another build of the kernels, which this install never reads again."""
    def identity(name: str) -> tuple:
        size, mtime, rest = (name.split("-", 2) + ["", ""])[:3]
        return size, mtime, rest.split("-", 1)[-1]  # the level dropped: -v<version>-<build> kept

    here = identity(directory.name)
    for d in directory.parent.iterdir() if directory.parent.is_dir() else ():
        if d != directory and d.is_dir() and identity(d.name) != here:
            for f in d.iterdir():
                with contextlib.suppress(OSError):
                    f.unlink()
            with contextlib.suppress(OSError):
                d.rmdir()


class LayoutCache:
    """The conversions of one process, kept in `directory` (made if missing)."""

    def __init__(self, directory: str | Path, copy_held: bool = False):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.resident = True  # where products go now (placing): held in memory, or cold on disk
        # Held products are read into anonymous memory rather than mapped where some units are
        # cold: their pages would otherwise compete in the page cache with the cold units' reads.
        # Mapped otherwise: a warm start of the 1.1B Q4_0 shape copied 0.43 GB per process into
        # fresh memory (0.3 s of its 1.06), and mapped layouts decode as fast (45-48 tok/s both).
        self.copy_held = copy_held
        self.hits = self.misses = self.rebuilt = 0
        self.mapped_bytes = self.resident_bytes = self.held_mapped_bytes = 0
        self.maps: list[tuple[mmap.mmap, int]] = []  # mapped products: (map, data bytes), for prefetch
        self.writable = True
        # whether a cold dense layer's files are read ahead explicitly (LARGE_READAHEAD_KB);
        # $SPARSEINFER_COLD_READS=ahead|faults says so instead (tests take both paths anywhere)
        forced = os.environ.get("SPARSEINFER_COLD_READS", "")
        ra = device_readahead_kb(self.directory)
        self.reads_layers_ahead = forced == "ahead" if forced in ("ahead", "faults") else \
            ra is not None and ra > LARGE_READAHEAD_KB

    @contextlib.contextmanager
    def placing(self, resident: bool):
        """Products made inside go to anonymous memory (resident) or stay mapped from their files."""
        before, self.resident = self.resident, resident
        try:
            yield
        finally:
            self.resident = before

    def path(self, key: str) -> Path:
        return self.directory / (hashlib.sha1(key.encode()).hexdigest()[:24] + ".lay")

    def product(self, key: str, nbytes: int, alloc, fill, mappable: bool = True) -> np.ndarray:
        """The conversion `key`'s nbytes of output: from its file when it holds them (read into
        alloc(nbytes), or mapped), else fill(buf) into alloc(nbytes), then written to its file
        (and, where it is to be mapped, mapped from it and the memory given back). `mappable`:
        False where a held product must be in alloc's memory (a twin's huge pages)."""
        path = self.path(key)
        copy = self.resident and (self.copy_held or not mappable)
        stale = path.exists()
        if stale:
            got = self._read(path, key, nbytes, alloc, copy)
            if got is not None:
                self.hits += 1
                return got
            self.rebuilt += 1
            print(f"note: layout cache {path}: damaged or stale, made again", file=sys.stderr)
        self.misses += 1
        buf = alloc(nbytes)
        fill(buf)
        if self.writable and self._write(path, key, buf, replace=stale) and not copy:
            mapped = self._read(path, key, nbytes, alloc, copy)
            if mapped is not None:
                return mapped
        self.resident_bytes += nbytes
        return buf

    def _header(self, key: str, view: memoryview) -> bytes:
        k = key.encode()
        head = _HEAD.pack(MAGIC, LAYOUT_VERSION, len(view), _sum_all(view), _crc_sample(view), len(k)) + k
        if len(head) > HEADER:
            raise ValueError(f"layout cache key too long: {key[:80]}...")
        return head.ljust(HEADER, b"\0")

    def _write(self, path: Path, key: str, buf: np.ndarray, replace: bool = False) -> bool:
        """Write buf as the conversion's file. Processes that hold the same layouts (dealt experts)
        may make one at the same time: the first file written stays (linked, not renamed over), so
        a process that has mapped it keeps sharing its pages with the others, which map it too;
        `replace`: the file there is damaged or stale, and this one takes its place."""
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        view = memoryview(buf).cast("B")
        try:
            with open(tmp, "wb") as f:
                f.write(self._header(key, view))
                for off in range(0, len(view), COPY_CHUNK):
                    f.write(view[off:off + COPY_CHUNK])
            if replace:
                os.replace(tmp, path)
                return True
            try:
                os.link(tmp, path)
            except FileExistsError:  # another process wrote it first: theirs is the file
                pass
            except OSError:  # a file system without hard links
                os.replace(tmp, path)
                return True
            tmp.unlink()
            return True
        except OSError as e:  # a full or read-only disk: run on, without the cache
            with contextlib.suppress(OSError):
                tmp.unlink()
            print(f"note: layout cache {self.directory}: cannot write ({e.strerror}): layouts are made at "
                  f"every start", file=sys.stderr)
            self.writable = False
            return False

    def _read(self, path: Path, key: str, nbytes: int, alloc, copy: bool) -> np.ndarray | None:
        """The file's data checked against its header (and the key, size, checksum), or None:
        copied into alloc(nbytes), or mapped (held: all of it summed; cold: the sample's CRC)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            head = os.pread(fd, HEADER, 0)
            if len(head) < _HEAD.size:
                return None
            magic, version, n, total, crc_s, klen = _HEAD.unpack_from(head)
            if (magic, version, n) != (MAGIC, LAYOUT_VERSION, nbytes) or head[_HEAD.size:_HEAD.size + klen] != key.encode() \
                    or os.fstat(fd).st_size != HEADER + nbytes:
                return None
            if copy:
                buf = alloc(nbytes)
                view = memoryview(buf).cast("B")
                got = 0
                while got < nbytes:
                    k = os.preadv(fd, [view[got:got + COPY_CHUNK]], HEADER + got)
                    if k <= 0:
                        return None
                    got += k
                if _sum_all(view) != total:
                    return None
                self.resident_bytes += nbytes
                return buf
            if nbytes == 0:
                return alloc(0)
            m = mmap.mmap(fd, HEADER + nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            data = memoryview(m)[HEADER:]
            ok = _sum_all(data) == total if self.resident else _crc_sample(data) == crc_s
            data.release()
            if not ok:
                m.close()
                return None
            if self.resident:  # held: checked whole, its pages now mapped in this process
                self.held_mapped_bytes += nbytes
                return np.frombuffer(m, np.uint8, nbytes, HEADER)
            # a product is read front to back: readahead runs ahead of the faults (without it, a
            # fault reads around itself, half behind: the 1.45 GB Q8_0 shape under 1000 MB with
            # this VM's 8 MB read_ahead_kb decoded at 1.08 tok/s where 128 KB gave 2.20)
            m.madvise(mmap.MADV_SEQUENTIAL)
            self.maps.append((m, nbytes))
            self.mapped_bytes += nbytes
            return np.frombuffer(m, np.uint8, nbytes, HEADER)
        finally:
            os.close(fd)



active: LayoutCache | None = None  # the cache of the conversions being made now, if any (using)


def read_ahead(maps: list) -> None:
    """Ask the kernel to read these mapped products (LayoutCache.maps entries) now
    (MADV_WILLNEED: it queues the reads and returns), so that several come from disk at once
    instead of one page fault after another."""
    for m, n in maps:
        with contextlib.suppress(OSError, ValueError):
            for off in range(0, HEADER + n, READ_CHUNK):
                m.madvise(mmap.MADV_WILLNEED, off, min(READ_CHUNK, HEADER + n - off))


@contextlib.contextmanager
def using(directory: str | Path | None, copy_held: bool = False):
    """A cache in `directory` for the conversions made inside (None or "": none), the process's
    earlier one (or none) after: a process that loads more than one model (the coordinator, a
    test) must not look up one model's conversions in another's directory. copy_held: held
    products read into memory, not mapped (LayoutCache.copy_held)."""
    global active
    before = active
    active = LayoutCache(directory, copy_held) if directory else None
    try:
        yield active
    finally:
        active = before


def placing(resident: bool):
    """The active cache's placing(resident), or nothing to do without one."""
    return active.placing(resident) if active is not None else contextlib.nullcontext()
