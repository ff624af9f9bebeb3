"""`KvPool`: the KV caches of every sequence and the rope tables, in memory the coordinator and
its CPU workers share, so that a decoded token's attention heads can be split across them
(coordinator/runtime/attention_split.py, sparsecore/attn_shard.py): each process writes the keys and
values of its own heads, and the coordinator's prompt (prefill) steps write every head.

The memory is an anonymous memfd (Linux): it has no name, so nothing can be left behind in
/dev/shm whoever is killed, and it is not bounded by /dev/shm's size; the workers inherit the
descriptor at spawn. Pages are allocated as positions are first written, so caches reserved
for server slots cost nothing until used.

    [cos 0: f32 max_ctx x rope_dim][sin_signed 0: same] ... [cos, sin of table n_tables - 1]
    [cache 0: keys, values][cache 1] ...
The rope tables: one pair per (base, scale) the layers use (sparsecore/rope.py layer_tables).
    one cache's keys (or values): f32 (n_layers, n_kv, max_ctx, head_dim)
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KvShape:
    n_caches: int
    n_layers: int
    n_kv: int
    max_ctx: int
    head_dim: int
    rope_dim: int
    n_tables: int = 1  # rope table pairs (gemma3: its sliding layers' base and the global layers')

    @property
    def table_bytes(self) -> int:  # one cos (or sin) table
        return 4 * self.max_ctx * self.rope_dim

    @property
    def tables_bytes(self) -> int:  # every table pair
        return 2 * self.n_tables * self.table_bytes

    @property
    def half_bytes(self) -> int:  # one cache's keys (or values)
        return 4 * self.n_layers * self.n_kv * self.max_ctx * self.head_dim

    @property
    def layer_bytes(self) -> int:  # one layer of one cache's keys (or values)
        return self.half_bytes // self.n_layers

    @property
    def size(self) -> int:
        return self.tables_bytes + 2 * self.n_caches * self.half_bytes


def supported() -> bool:
    return hasattr(os, "memfd_create")


class KvPool:
    """numpy views of the pool: `tables[t]` = (cos, sin) (max_ctx, rope_dim) per rope table and per
    cache `keys(i)`, `values(i)` (n_layers, n_kv, max_ctx, head_dim); `addresses(layer, caches)`
    for the kernels."""

    def __init__(self, shape: KvShape, fd: int, owner: bool):
        self.shape, self.fd, self.owner = shape, fd, owner
        self._mm = mmap.mmap(fd, shape.size)
        self.base = np.frombuffer(self._mm, np.uint8)
        s = shape
        view = lambda k: self.base[k * s.table_bytes:(k + 1) * s.table_bytes].view(np.float32).reshape(  # noqa: E731
            s.max_ctx, s.rope_dim)
        self.tables = [(view(2 * t), view(2 * t + 1)) for t in range(s.n_tables)]
        self.address = self.base.ctypes.data
        self._free = list(range(s.n_caches))

    @classmethod
    def create(cls, shape: KvShape) -> "KvPool":
        fd = os.memfd_create("sparseinfer-kv", 0)  # close-on-exec: spawn passes it on explicitly
        try:
            os.ftruncate(fd, shape.size)
            return cls(shape, fd, owner=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, shape: KvShape, fd: int) -> "KvPool":
        """A worker's view of the pool it inherited as descriptor `fd`; refuses a size mismatch."""
        size = os.fstat(fd).st_size
        if size != shape.size:
            raise ValueError(f"KV pool descriptor {fd} holds {size} bytes, {shape} needs {shape.size}")
        return cls(shape, fd, owner=False)

    def _half(self, cache: int, values: bool) -> int:
        s = self.shape
        if not 0 <= cache < s.n_caches:
            raise IndexError(f"KV cache {cache} outside the pool's {s.n_caches}")
        return s.tables_bytes + (2 * cache + int(values)) * s.half_bytes

    def keys(self, cache: int) -> np.ndarray:
        s, off = self.shape, self._half(cache, False)
        return self.base[off: off + s.half_bytes].view(np.float32).reshape(s.n_layers, s.n_kv, s.max_ctx, s.head_dim)

    def values(self, cache: int) -> np.ndarray:
        s, off = self.shape, self._half(cache, True)
        return self.base[off: off + s.half_bytes].view(np.float32).reshape(s.n_layers, s.n_kv, s.max_ctx, s.head_dim)

    def addresses(self, layer: int, caches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Addresses of `layer`'s keys and values in each of `caches` (int64 indices, checked)."""
        s = self.shape
        if len(caches) and (caches.min() < 0 or caches.max() >= s.n_caches):
            raise IndexError(f"KV cache index outside the pool's {s.n_caches}")
        k = self.address + s.tables_bytes + 2 * caches * s.half_bytes + layer * s.layer_bytes
        return k, k + s.half_bytes

    # Which caches are in use: the coordinator hands them out (Transformer.new_cache), the lowest
    # free one first: a cache's pages, once written, stay resident in every process that wrote
    # them, so handing out the one given back last (not the next of the rotation) keeps only as
    # many caches' pages as are in use at once (Gemma 3 270M's benchmark runs touched a fresh
    # cache each, 8 MB a run in both processes).
    def take(self) -> int | None:
        if not self._free:
            return None
        i = min(self._free)
        self._free.remove(i)
        return i

    def give_back(self, cache: int) -> None:
        if cache not in self._free:
            self._free.append(cache)

    def close(self) -> None:
        self.tables, self.base = [], None
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes at exit
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass
