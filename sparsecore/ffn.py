"""The FFN math of one shard (sparsecore/shard.py), for whichever neurons are active:
    y = down_t[A]^T @ (act(gate[A] @ x) * (up[A] @ x))

Each of the three matrices is either a float tensor, Int8Rows (weights kept quantized in
worker memory, dequantized on the fly after the row gather) or HalfRows (float16): see
WEIGHT_FORMATS.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from protocol.messages import WEIGHT_FORMATS  # noqa: F401  (re-exported: the formats this module implements)

from .file_rows import FileRows
from .kernels import MAX_SMALL_BATCH

# silu: SwiGLU (llama, qwen, mistral, phi3); relu: PowerInfer's ReLU models; gelu_tanh: GeGLU
# with tanh-approximated GELU (gemma3's gelu_pytorch_tanh).
# gelu: falcon's (exact, erf).
ACTIVATIONS = {"silu": F.silu, "relu": F.relu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "gelu": F.gelu}
# How gate and up combine (ModelConfig.ffn_gate; the kernels' GATE_BITS): "par" act(gate x) *
# (up x), "sym" act(gate x) * act(up x) (bamboo), "none" act(gate x) alone, where the shard's
# gate rows are the up matrix's (falcon has no gate). The activity rule reads act(gate x) in all.
GATE_MODES = ("par", "sym", "none")


def combine(g: torch.Tensor, x: torch.Tensor, up, activation: str, gate_mode: str) -> torch.Tensor:
    """h from g = act(gate x): times up x, times act(up x), or g itself (the down matrix's input;
    the quality tools compute it for calibration and emulation too)."""
    if gate_mode == "none":
        return g
    u = x_wt(x, up)
    return g * (ACTIVATIONS[activation](u) if gate_mode == "sym" else u)


class Int8Rows:
    """A row matrix kept as int8 with one float32 scale per row: W = q * scale[:, None].

    Per-row (per-neuron) scales keep every row self-contained, so gathering active neurons
    keeps the scales valid and the result does not depend on how neurons are sharded. The
    kernel (gather int8 rows, convert the gathered rows to float32, float32 matmul, scale) won
    the measurements in scripts/bench_ffn_kernels.py: 0.6-0.75x the float32 time on sparse
    steps, about 1x dense, where torch's _weight_int8pack_mm took 2.6-4.9x and the int4 CPU
    kernel 6.5x (docs/KERNELS.md, "Converted weight formats"). The products are those of the dequantized
    weights up to float32 rounding."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        if q.dtype != torch.int8 or scale.dtype != torch.float32 or scale.shape != q.shape[:1]:
            raise ValueError(f"Int8Rows wants int8 (n, k) and float32 (n,), got {q.dtype} {tuple(q.shape)} "
                             f"and {scale.dtype} {tuple(scale.shape)}")
        self.q, self.scale = q, scale

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Int8Rows":
        """Symmetric round-to-nearest: the largest |w| of a row maps to 127, so every weight is
        within half a step, max|row| / 254, of its original value."""
        w = w.float()
        scale = w.abs().amax(1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
        return cls(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()

    def index_select(self, dim: int, idx: torch.Tensor) -> "Int8Rows":
        if dim != 0:
            raise ValueError("Int8Rows gathers whole rows only (dim 0)")
        return Int8Rows(self.q.index_select(0, idx), self.scale.index_select(0, idx))

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


class HalfRows:
    """A row matrix kept as float16: half the bytes of float32, so a decode step, which reads
    every weight once, waits half as long on memory. A one-token product runs in float16 (torch
    accumulates in float32 and rounds the result to float16): on a 2-core AVX2 EPYC, 30 layers
    cycled out of cache, 590 us per SmolLM2 FFN layer against 930 us in float32. Batches upcast
    the rows instead, because torch's float16 GEMM on CPUs without native float16 is ~7x slower
    than float32 (pp128: 20.7 vs 3.1 ms for one 576x1536 matrix). On the CPU a down matrix also
    keeps its columns as rows (`cols`): h @ W on row-major float16 takes torch's slow path (970
    vs 180 us), while gathering active rows needs the row layout, so dense steps read `cols` and
    sparse gathers read `rows`. On CUDA both are fast and only `rows` is kept."""

    def __init__(self, rows: torch.Tensor, cols: torch.Tensor | None = None):
        if rows.dtype != torch.float16 or (cols is not None and (cols.dtype != torch.float16
                                                                 or cols.shape != rows.shape[::-1])):
            raise ValueError(f"HalfRows wants float16 (n, k) rows and optionally their (k, n) transpose, "
                             f"got {rows.dtype} {tuple(rows.shape)}")
        self.rows, self.cols = rows, cols

    @classmethod
    def convert(cls, w: torch.Tensor, for_h_w: bool = False) -> "HalfRows":
        rows = w.to(torch.float16).contiguous()
        keep_cols = for_h_w and rows.device.type == "cpu"
        return cls(rows, rows.T.contiguous() if keep_cols else None)

    @property
    def shape(self) -> torch.Size:
        return self.rows.shape

    @property
    def nbytes(self) -> int:
        n = self.rows.numel() * 2
        return n if self.cols is None else 2 * n

    def index_select(self, dim: int, idx: torch.Tensor) -> "HalfRows":
        if dim != 0:
            raise ValueError("HalfRows gathers whole rows only (dim 0)")
        return HalfRows(self.rows.index_select(0, idx))  # gathered once per step: no transpose

    def dequantize(self) -> torch.Tensor:
        return self.rows.float()


Rows = torch.Tensor | Int8Rows | HalfRows | FileRows


def quantize_rows(w: torch.Tensor, fmt: str, for_h_w: bool = False) -> Rows:
    """Float rows in the worker's weight format `fmt` (one of WEIGHT_FORMATS). `for_h_w`: the
    matrix is used as h @ W (the down projection held as rows), which f16 lays out for."""
    if fmt == "f32":
        return w
    if fmt == "int8":
        return Int8Rows.quantize(w)
    if fmt == "f16":
        return HalfRows.convert(w, for_h_w)
    raise ValueError(f"unknown weight format {fmt!r}: choose one of {', '.join(WEIGHT_FORMATS)}")


def row_nbytes(hidden: int, fmt: str) -> int:
    """Bytes one row of `hidden` values takes in weight format `fmt` (as quantize_rows stores it
    on a GPU, which is what placement budgets; a CPU worker's f16 down rows take twice this)."""
    if fmt == "f32":
        return 4 * int(hidden)
    if fmt == "int8":
        return int(hidden) + 4  # int8 values + one float32 scale
    if fmt in ("f16", "gguf"):  # gguf: a GPU worker holds its hot rows as float16
        return 2 * int(hidden)
    raise ValueError(f"unknown weight format {fmt!r}: choose one of {', '.join(WEIGHT_FORMATS)}")


def rows_nbytes(w: Rows) -> int:
    return w.nbytes if isinstance(w, (Int8Rows, HalfRows, FileRows)) else w.numel() * w.element_size()


def x_wt(x: torch.Tensor, w: Rows) -> torch.Tensor:
    """x @ W.T (one output per row of W). Public: the coordinator's attention matrices use it
    when they are kept as HalfRows too."""
    if isinstance(w, Int8Rows):
        return (x @ w.q.to(x.dtype).T) * w.scale.to(x.dtype)
    if isinstance(w, HalfRows):
        if x.shape[0] == 1 or x.device.type != "cpu":
            return (x.to(torch.float16) @ w.rows.T).to(x.dtype)
        return x @ w.rows.T.to(x.dtype)
    if isinstance(w, FileRows):
        if x.shape[0] == 1:  # the caller combines the result before the next product
            return torch.from_numpy(w.matvec(x.numpy()[0]))[None]
        if x.shape[0] <= MAX_SMALL_BATCH and x.device.type == "cpu":
            # a copy: a batch's outputs (logits of several sequences) may outlive the next product
            return torch.from_numpy(w.matmul(x.detach().numpy()).copy())
        if w.tiled_prefill and x.device.type == "cpu":
            return torch.from_numpy(w.matmul_tiled(x.detach().numpy()))
        return x @ torch.from_numpy(w.dequantize()).T
    return x @ w.T


def _h_w(h: torch.Tensor, w: Rows) -> torch.Tensor:
    """h @ W (W's rows weighted by h): the row scales fold into h before the product."""
    if isinstance(w, Int8Rows):
        return (h * w.scale.to(h.dtype)) @ w.q.to(h.dtype)
    if isinstance(w, HalfRows):
        if h.shape[0] == 1 or h.device.type != "cpu":
            hh = h.to(torch.float16)
            return (hh @ w.cols.T if w.cols is not None else hh @ w.rows).to(h.dtype)
        return h @ (w.cols.T if w.cols is not None else w.rows).to(h.dtype)
    return h @ w


def ffn_partial(x: torch.Tensor, gate: Rows, up: Rows, down_t: Rows,
                activation: str, active: torch.Tensor | None = None, gate_mode: str = "par") -> torch.Tensor:
    """x: (T, hidden); gate/up/down_t: (n_owned, hidden); active: local row indices or None (all)."""
    if active is not None:
        if active.numel() == 0:
            return x.new_zeros(x.shape)
        gate, down_t = gate.index_select(0, active), down_t.index_select(0, active)
        up = up if gate_mode == "none" else up.index_select(0, active)
    h = combine(ACTIVATIONS[activation](x_wt(x, gate)), x, up, activation, gate_mode)
    return _h_w(h, down_t)


# Above this fraction of active neurons, a one-token threshold step computes up and down densely
# and zeroes the inactive neurons instead of gathering their rows: gathering copies the rows it
# reads, so at SmolLM2's operating point (80 % active) it made the FFN 2.7x slower than dense,
# and below ~35 % it wins (scripts/bench_ffn_kernels.py; docs/PERFORMANCE.md, "What bounds decoding here").
GATHER_BELOW = 0.35


def is_active(g: torch.Tensor, threshold: float) -> torch.Tensor:
    """THE gate-activity rule (CATS): a neuron is active for a token where |act(gate x)| exceeds
    its layer's threshold (0 for ReLU models). Calibration and profiling use it too."""
    return g.abs() > threshold


def ffn_partial_threshold(x: torch.Tensor, gate: Rows, up: Rows, down_t: Rows,
                          activation: str, threshold: float, gate_mode: str = "par") -> tuple[torch.Tensor, int]:
    """CATS: a neuron is active for a token where |act(gate x)| > threshold; up and down are
    computed for active neurons only. Returns (output, active neuron-token pairs).
    One token with few active neurons: gather the active rows. Otherwise the same math with a
    mask (prefill-sized batches activate nearly every neuron somewhere, so gathering would not
    pay). Either way inactive neurons contribute exactly zero."""
    g = ACTIVATIONS[activation](x_wt(x, gate))
    keep = is_active(g, threshold)
    n = int(keep.sum())
    if n == 0:
        return x.new_zeros(x.shape), 0
    if x.shape[0] == 1 and n < GATHER_BELOW * g.shape[1]:
        active = keep[0].nonzero().squeeze(1)
        h = combine(g[:, active], x, up if gate_mode == "none" else up.index_select(0, active), activation, gate_mode)
        return _h_w(h, down_t.index_select(0, active)), n
    if gate_mode != "par":
        return _h_w(combine(g.mul_(keep), x, up, activation, gate_mode), down_t), n
    return _h_w(g.mul_(keep).mul_(x_wt(x, up)), down_t), n  # in place: g is ours
