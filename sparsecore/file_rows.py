"""`FileRows`: a matrix (or some of its rows) left in the model file's own blocks and computed on
by the native kernels. No torch here: the CPU workers that only read the file's blocks never
import it (sparsecore/shard.py, sparsecore/lm_head.py).
"""
from __future__ import annotations

import numpy as np

from .kernels import MAX_SMALL_BATCH, FileMatrix, dequant_scratch, q8_scratch


class FileRows:
    """A matrix left in the model file's own blocks (sparsecore.kernels.FileMatrix), or some of
    its rows in a given order (a shard's neurons, Q/K un-permuted): nothing is copied. One row
    x is a native matvec; a small batch (2..MAX_SMALL_BATCH rows, sequences decoded together)
    the native matmul, which reads each row once for all of them and gives each what matvec
    would; larger batches (prefill) dequantize the rows once for a float32 GEMM."""

    def __init__(self, m: FileMatrix, rows: np.ndarray | range | None = None, fast: bool = False):
        self.m, self.fast = m, fast
        self.rows = range(m.rows) if rows is None else rows
        self.xq = q8_scratch(m.cols)
        # Checked once here: a decoded token calls matvec per layer, where checks cost as much
        # as a small product.
        self._call = m.prepare(self.rows, fast=fast, xq=self.xq)
        self._batch = None  # prepared on the first small batch: its buffers hold MAX_SMALL_BATCH rows

    @property
    def tiled_prefill(self) -> bool:
        """Fast arithmetic on quantized blocks: a prompt's tokens go through the small-batch
        integer kernels in tiles (each weight row read once per tile) instead of dequantizing
        to float32 for torch's GEMM: 2.1x faster for a 1.1B-shape Q4_0 matrix and 64 tokens on
        one AVX-512 VNNI core, and the arithmetic of decoding (and of llama.cpp) for the prompt too."""
        return self.fast and self.m.block >= 32

    def matmul_tiled(self, x: np.ndarray) -> np.ndarray:
        """rows . x[t] for any number of tokens, MAX_SMALL_BATCH at a time: (T, rows), new array."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((len(x), len(self.rows)), np.float32)
        for a in range(0, len(x), MAX_SMALL_BATCH):
            out[a:a + MAX_SMALL_BATCH] = self.matmul(x[a:a + MAX_SMALL_BATCH])
        return out

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """rows . x[b] for a small batch x (B, cols), B <= MAX_SMALL_BATCH: (B, rows), in a
        buffer the next call overwrites."""
        if self._batch is None:
            self._batch = self.m.prepare_batch(self.rows, fast=self.fast)
        return self._batch(np.ascontiguousarray(x, dtype=np.float32))

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.rows), self.m.cols)

    @property
    def nbytes(self) -> int:
        """Bytes of the file these rows span (what a product reads)."""
        return len(self.rows) * self.m.row_bytes

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """rows . x, in a buffer the next call overwrites."""
        return self._call(np.ascontiguousarray(x, dtype=np.float32))

    def dequantize(self) -> np.ndarray:
        """The rows as float32 (rows, cols), in the process's reusable scratch: use before the next call."""
        flat = self.m.dequantize(self.rows, out=dequant_scratch(len(self.rows) * self.m.cols))
        return flat.reshape(len(self.rows), self.m.cols)

    def x_wt(self, x: np.ndarray) -> np.ndarray:
        """x @ rows.T for any number of tokens x (T, cols) float32: a new (T, rows) array. One
        token: matvec; a small batch: the small-batch kernel; a prompt: integer tiles (fast) or
        the dequantized rows through numpy's GEMM (exact)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if len(x) == 1:
            return self.matvec(x[0])[None].copy()
        if len(x) <= MAX_SMALL_BATCH:
            return self.matmul(x).copy()
        if self.tiled_prefill:
            return self.matmul_tiled(x)
        return x @ self.dequantize().T
