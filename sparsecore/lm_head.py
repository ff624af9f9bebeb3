"""The output projection for one decoded token, read in the file's own Q8_0 blocks, whole or
a range of its vocabulary rows (the coordinator and the workers split it on CPU-only machines).

The lm_head is the largest matrix a token reads (SmolLM2: 49152 x 576, 113 MB as float32, a
fifth of all bytes per token). When it is stored as Q8_0 (32 int8 values and one f16 scale per
block, as llama.cpp writes token_embd), one decode step reads the int8 values through fbgemm's
fused dequantize-and-sum kernel (torch.ops.quantized.embedding_bag_byte_rowwise_offsets) and
applies the block scales after:

    logits[v] = sum_b d[v, b] * (sum_{i in b} q[v, i] * x[i])

Mathematically the same as the float32 product with the dequantized matrix (d * q is exact in
float32); only the summation order differs. The kernel sums rows of a table, so the table
holds the transposed values: row i is q[:, i] for every vocabulary entry, as uint8 q + 128 with
the row's scale 1 and bias -128, and bag b takes rows i in block b weighted by x[i].
Measured on one core of the 2-core CI machine: 9.3 ms against 13.2 ms for the float32 matmul.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType

from .file_rows import FileRows
from .kernels import FileMatrix, supports

if TYPE_CHECKING:
    import torch

# torch is imported where a float or Q8_0 copy is used: a CPU worker whose head rows stay in the
# file's blocks (--weights gguf) never imports it (a quarter of a GB and a second at start-up).

QK8_0 = 32


def _kernel():
    import torch

    try:
        return torch.ops.quantized.embedding_bag_byte_rowwise_offsets
    except (AttributeError, RuntimeError):
        return None


class Q8Head:
    """logits = x @ W.T for one row x, W given as GGUF Q8_0 bytes (rows, n_blocks * 34)."""

    def __init__(self, raw: np.ndarray, n_cols: int):
        import torch

        n_rows, nb = raw.shape[0], n_cols // QK8_0
        blocks = np.ascontiguousarray(raw).reshape(n_rows, nb, 2 + QK8_0)
        d = blocks[:, :, :2].copy().view(np.float16).reshape(n_rows, nb)
        q = blocks[:, :, 2:].copy().view(np.int8).reshape(n_rows, n_cols)
        table = np.empty((n_cols, n_rows + 8), np.uint8)
        table[:, :n_rows] = (q.T.astype(np.int16) + 128).astype(np.uint8)
        table[:, n_rows:] = np.frombuffer(np.array([1.0, -128.0], np.float32).tobytes(), np.uint8)
        self.table = torch.from_numpy(table)
        self.scales = torch.from_numpy(np.ascontiguousarray(d.T.astype(np.float32)))  # (nb, n_rows)
        self.indices = torch.arange(n_cols, dtype=torch.int32)
        self.offsets = torch.arange(0, n_cols, QK8_0, dtype=torch.int32)
        self.op = _kernel()

    @classmethod
    def from_tensor(cls, t, rows: slice = slice(None)) -> "Q8Head | None":
        """A Q8Head for `rows` of a GGUF tensor when it is Q8_0 and torch has the kernel, else None."""
        if t.tensor_type != GGMLQuantizationType.Q8_0 or _kernel() is None:
            return None
        n_cols = int(t.shape[0])
        if n_cols % QK8_0:
            return None
        return cls(np.asarray(t.data).reshape(int(t.shape[1]), -1)[rows], n_cols)

    @property
    def nbytes(self) -> int:
        return self.table.numel() + self.scales.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (1, n_cols) float32 -> (1, n_rows) logits."""
        partial = self.op(self.table, self.indices, self.offsets, False, 0, False,
                          x.reshape(-1).contiguous(), None, False)  # (n_blocks, n_rows)
        return partial.mul_(self.scales).sum(0, keepdim=True)


# Vocabulary rows a process scores exactly after its input-sparse pass (HeadCandidates): the
# approximate logits of the rest only matter where a token falls outside every process's best
# ones (sampling's tail; perplexity's rare tokens).
HEAD_CANDIDATES = 256


class HeadCandidates:
    """A one-token lm_head over rows [start, stop) with input sparsity: every row's logit from
    the inputs above the threshold (`twinned`: FileRows over a matrix carrying an input-major
    twin; sparsecore/input_sparsity.py), then the HEAD_CANDIDATES highest rows again, exactly,
    on the file's rows (`exact`: their FileMatrix), so the likely tokens' logits are the dense
    ones (about HEAD_CANDIDATES: _best_rows). Below zero the threshold word means dense: the
    twinned rows then read densely too."""

    def __init__(self, twinned: FileRows, exact: FileMatrix, start: int, word: np.ndarray, fast: bool):
        self.twinned, self.exact, self.start, self.word, self.fast = twinned, exact, start, word, fast
        self.n_rows = len(twinned.rows)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x (hidden,) float32 -> (rows,) logits, in a buffer the next call overwrites."""
        if self.word[0] >= 0 and self.n_rows <= HEAD_CANDIDATES:  # every row is a candidate
            return self.exact.matvec(x, rows=range(self.start, self.start + self.n_rows), fast=self.fast)
        logits = self.twinned.matvec(x)
        if self.word[0] < 0:
            return logits
        best = _best_rows(logits)
        logits[best] = self.exact.matvec(x, rows=best + self.start, fast=self.fast)
        return logits


def _best_rows(logits: np.ndarray) -> np.ndarray:
    """About 1.5 x HEAD_CANDIDATES rows with the highest logits, the highest always among them
    (int32): those at or above a threshold taken from every 16th logit, which costs a tenth of
    an exact selection (np.argpartition over SmolLM2's 24576 rows a process: 220 us, more than
    the sparse pass saved); an exact selection where the sample misjudged the count."""
    n, step = len(logits), 16
    sample = logits[::step]
    k = min(len(sample) - 1, HEAD_CANDIDATES * 3 // (2 * step))
    t = np.partition(sample, -k - 1)[-k - 1]
    best = np.flatnonzero(logits >= t)
    if not HEAD_CANDIDATES // 2 <= len(best) <= 4 * HEAD_CANDIDATES:
        best = np.argpartition(logits, -min(n, HEAD_CANDIDATES))[-min(n, HEAD_CANDIDATES):]
    return best.astype(np.int32)


def head_tensor_name(tied_embeddings: bool) -> str:
    return "token_embd.weight" if tied_embeddings else "output.weight"


class HeadRows:
    """Vocabulary rows [start, stop) of the output projection for one token: in Q8_0 blocks
    when the file has them, else as float32 rows. Each logit is its own row's dot product, so
    the rows computed in several processes and put side by side equal the whole head's."""

    def __init__(self, store, name: str, start: int, stop: int, in_file: bool = False, fast: bool = False):
        self.start, self.stop = start, stop
        t = store.info(name)
        # in_file (--weights gguf): the rows stay in the file's blocks, read by the native kernel;
        # in fast mode interleaved 16 by 16 where they can be (FileMatrix.interleave)
        self.file = self.candidates = None
        self.fast = fast
        if in_file and supports(t.tensor_type):
            self.rows_m = m = FileMatrix(t)  # the file's rows: any of them by number (HeadCandidates)
            self.file = FileRows(m.for_fast_products(range(start, stop)) if fast else m, range(start, stop), fast)
        self.q8 = None if self.file is not None else Q8Head.from_tensor(t, slice(start, stop))
        self.w = None
        if self.file is None and self.q8 is None:
            import torch

            self.w = torch.from_numpy(np.ascontiguousarray(store.rows(name, np.arange(start, stop))))

    def add_twin(self, add, word: np.ndarray) -> None:
        """Input sparsity for one token (HeadCandidates): add(matrix, rows, cols) gives the matrix
        carrying an input-major twin of these rows that reads the threshold `word`
        (sparsecore/input_sparsity.py), or the matrix itself (its type has none)."""
        if self.file is None:
            return
        m = add(self.file.m, range(self.start, self.stop), None)
        if m is not self.file.m:
            self.candidates = HeadCandidates(FileRows(m, range(self.start, self.stop), self.fast), self.rows_m,
                                             self.start, word, self.fast)

    @property
    def nbytes(self) -> int:
        if self.file is not None:
            return self.file.nbytes
        return self.q8.nbytes if self.q8 is not None else self.w.numel() * 4

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x: (T, n_cols) float32 (shared memory, as the processes hold it) -> logits: (stop - start,)
        for one token, (T, stop - start) for several (sequences decoded together; up to
        MAX_SMALL_BATCH in the file's blocks read once for all, more through a GEMM)."""
        if self.file is not None:
            if len(x) == 1:
                return (self.candidates or self.file.matvec)(x[0])
            return self.file.x_wt(x)
        import torch

        t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        if len(x) == 1:
            return (self.q8(t) if self.q8 is not None else t @ self.w.T)[0].numpy()
        if self.q8 is not None:  # Q8Head takes one token
            return torch.cat([self.q8(t[i:i + 1]) for i in range(len(t))]).numpy()
        return (t @ self.w.T).numpy()
