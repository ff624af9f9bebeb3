"""`FileLayer`: one layer's FFN neurons that a process owns, left in the model file's own blocks
(or its repacked layouts) and computed on by the native kernels: its gate and up rows, its down
columns; a dense layer, one routed expert (sparsecore/experts.py ExpertsLayer holds a layer's
experts as FileLayers) or a shared expert. Split from shard.py, which holds the shard of every
layer and the step that serves them.
"""
from __future__ import annotations

import sys

import numpy as np

from .kernels import (MAX_SMALL_BATCH, FfnCall, FfnScratch, FileMatrix, ffn_batch, ffn_token, ffn_token_call,
                      neuron_align, supports)
from .kernels import layout_cache
from .kernels.layouts import columns_for
from .tensors import TensorStore


def _gemm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b in float32. Where torch is already loaded (the coordinator's own share) through
    torch, whose thread count the engine sets: numpy's BLAS would start a thread per core there
    and fight the workers for them (exact prefill lost 10-14 % that way); a worker's numpy BLAS
    has its thread count from its environment (coordinator/runtime/worker_pool.py)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.from_numpy(a).matmul(torch.from_numpy(b)).numpy()
    return a @ b


def _np_activation(activation: str):
    """The FFN activations on float32 numpy arrays (the file-block prompt path below)."""
    if activation == "silu":
        return lambda g: g / (np.float32(1) + np.exp(-g))
    if activation == "relu":
        return lambda g: np.maximum(g, np.float32(0))
    if activation == "gelu_tanh":
        return lambda g: np.float32(0.5) * g * (np.float32(1) + np.tanh(
            np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)))
    import torch  # gelu with erf (falcon): numpy has no erf

    from .ffn import ACTIVATIONS
    return lambda g: ACTIVATIONS[activation](torch.from_numpy(g)).numpy()


# Neurons per dequantized chunk in a batched (prefill) step: bounds the float32 scratch to
# 3 x PREFILL_CHUNK x hidden values whatever the shard's size.
PREFILL_CHUNK = 512


class FileLayer:
    """One layer's owned neurons left in the file's own blocks: gate and up rows [own], and the
    down matrix's columns [own] (whole blocks of its rows: 32, or 256 for the K-quants), computed
    on by the native kernels.
    Nothing is copied; a decoded token makes one kernel call (sparsecore.kernels.ffn_token), and
    so does a small batch of them (2..MAX_SMALL_BATCH sequences decoded together: ffn_batch,
    each row read once for all tokens, each token's output the one it would get alone)."""

    def __init__(self, store: TensorStore, layer: int, own: range, fast: bool, scratch: FfnScratch,
                 gate_mode: str = "par", row_layout: str = "", expert: int | None = None, shared: bool = False):
        """`expert`: expert e of a routed layer (its slices of ffn_{gate,up,down}_exps); `shared`:
        its shared expert (ffn_{gate,up,down}_shexp); else the layer's dense FFN."""
        p = f"blk.{layer}."
        self.gate_mode = gate_mode  # "none": gate is the up matrix, read once (sparsecore.ffn.GATE_MODES)
        if shared:
            self.down_t = False
            self.gate, self.up, self.down = (FileMatrix(store.info(p + n)) for n in (
                "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"))
        elif expert is not None:
            self.down_t = False
            self.gate, self.up, self.down = (FileMatrix(store.expert(p + n, expert)) for n in (
                "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"))
        else:
            # PowerInfer files hold down transposed (ffn_down_t): a neuron's down column is a row
            # of blocks, read only when the neuron is active.
            self.down_t = store.has(p + "ffn_down_t.weight")
            down = "ffn_down_t.weight" if self.down_t else "ffn_down.weight"
            self.gate, self.up, self.down = (FileMatrix(store.info(p + n)) for n in ("ffn_gate.weight",
                                                                                     "ffn_up.weight", down))
        self.own, self.fast, self.scratch = own, fast, scratch
        cache = layout_cache.active
        before = len(cache.maps) if cache is not None else 0
        self.idx = np.arange(own.start, own.stop)
        if not self.down_t:  # a share of the neurons reads a part of every down row: hold that part
            self.down = columns_for(self.down, own, fast)  # interleaved where fast mode interleaves it
        # Fast mode's products on rows interleaved 16 by 16 (FileMatrix.interleave), each matrix
        # as its own 16-aligned part: down's always (every step reads all its rows); gate's
        # where no predictor picks rows (`row_layout` "gate": dense and threshold steps read
        # every gate row); up's too where the engine only decodes densely ("gate+up"). Rows the
        # step picks one by one (threshold steps' up rows, predictors' gate and up rows,
        # PowerInfer files' too) have their blocks interleaved instead (for_row_products), and
        # PowerInfer's down rows (an axpy each) are held as they are (held_copy).
        if fast:
            if self.down_t:
                self.down = self.down.keep_rows(own).held_copy()
            else:
                if row_layout in ("gate", "gate+up"):
                    self.gate = self.gate.for_fast_products(own)
                if gate_mode != "none" and row_layout == "gate+up" and self.gate.interleaved:
                    self.up = self.up.for_fast_products(own)  # up's rows alone cannot be: ffn_token
            if not self.gate.interleaved:
                self.gate = self.gate.for_row_products(own)
            self.up = self.gate if gate_mode == "none" else self.up if self.up.interleaved else \
                self.up.for_row_products(own)
        # this layer's products mapped from the layout cache where the memory plan left it on
        # disk (layout_cache.LayoutCache.maps): a routed layer reads a chosen expert's ahead once
        # a token is routed (ExpertsLayer); a dense one's the layer before reads (Lockstep), where
        # the disk's readahead is large (LayoutCache.reads_layers_ahead)
        self.cold_maps = cache.maps[before:] if cache is not None else []
        self.reads_ahead = bool(self.cold_maps) and cache.reads_layers_ahead

    def read_ahead(self) -> None:
        """Start reading all of this layer's products that are mapped from disk (they then come
        while the layers before it compute)."""
        layout_cache.read_ahead(self.cold_maps)

    @property
    def tiled_prefill(self) -> bool:
        return self.fast and min(m.block for m in (self.gate, self.up, self.down)) >= 32

    def add_twins(self, add) -> None:
        """Input-major twins (sparsecore/input_sparsity.py): add(matrix, rows, cols, site) gives
        the matrix carrying one, or the matrix itself. Gate and up over the owned neurons' rows
        (input "ffn_in"; one fused twin, gate's rows then up's, where add has `fused`), down over
        their columns (input "ffn_h": a skipped neuron skips its whole down row); PowerInfer's
        down_t is neuron-major already and keeps its rows."""
        if self.down_t:
            return
        fused = getattr(add, "fused", None)
        if fused is not None and self.gate_mode != "none":  # gate's rows then up's: one twin (ffn_teal)
            self.gate, self.up = fused([(self.gate, self.own), (self.up, self.own)], None, "ffn_in")
        else:
            self.gate = add(self.gate, self.own, None, "ffn_in")
            self.up = self.gate if self.gate_mode == "none" else add(self.up, self.own, None, "ffn_in")
        self.down = add(self.down, None, self.own, "ffn_h")

    @staticmethod
    def down_name(store: TensorStore, layer: int) -> str:
        for n in ("ffn_down_t", "ffn_down_exps"):
            if store.has(f"blk.{layer}.{n}.weight"):
                return f"blk.{layer}.{n}.weight"
        return f"blk.{layer}.ffn_down.weight"

    @staticmethod
    def align(store: TensorStore, layer: int) -> int:
        """Where this layer's owned neurons may start for the kernels (down's block, 1 for down_t)."""
        name = FileLayer.down_name(store, layer)
        if not store.has(name):
            return 32
        return neuron_align(store.info(name).tensor_type, name.endswith("ffn_down_t.weight"))

    @staticmethod
    def fits(store: TensorStore, layer: int, own: range | None) -> bool:
        """Whether the kernels can run this layer's neurons `own` (None: not a range) in place."""
        down = FileLayer.down_name(store, layer)
        routed = down.endswith("_exps.weight")
        names = [f"blk.{layer}.{n}.weight" for n in (("ffn_gate_exps", "ffn_up_exps") if routed else
                                                       ("ffn_gate", "ffn_up"))] + [down]
        # as the kernels will read them: a type they cannot read comes converted (an expert's slice
        # converts alone: expert 0 stands for all, the stacked tensor has one type)
        info = (lambda n: store.expert(n, 0)) if routed else store.info
        return own is not None and all(store.has(n) and supports(info(n).tensor_type) for n in names)

    @property
    def nbytes(self) -> int:
        """Bytes of the file a dense step reads (the rows are not held: they are mapped)."""
        n = len(self.own)
        down = n * self.down.row_bytes if self.down_t else self.down.row_bytes * n // self.down.cols * self.down.rows
        up = 0 if self.gate_mode == "none" else self.up.row_bytes
        return n * (self.gate.row_bytes + up) + down

    def token_into(self, x: np.ndarray, activation: str, active: np.ndarray | None, threshold: float | None,
                   out: np.ndarray) -> int:
        """One token, written straight into `out` (the process's output slot): no tensor round trip."""
        return ffn_token(self.gate, self.up, self.down, x, self.own, activation, self.scratch, threshold, active,
                         self.fast, self.down_t, out, self.gate_mode)[1]

    def token_call(self, x: np.ndarray, activation: str, out: np.ndarray) -> FfnCall:
        """token_into's kernel record for this x and out, resolved once (kernels.ffn_token_call:
        dense until its threshold is set; no mask)."""
        return ffn_token_call(self.gate, self.up, self.down, x, self.own, activation, self.scratch, self.fast,
                              self.down_t, out, self.gate_mode)

    def batch_into(self, x: np.ndarray, activation: str, active: np.ndarray | None, threshold: float | None,
                   out: np.ndarray) -> int:
        """A small batch x (T, hidden), T <= MAX_SMALL_BATCH, written straight into `out` (T, hidden)."""
        return ffn_batch(self.gate, self.up, self.down, x, self.own, activation, self.scratch, threshold, active,
                         self.fast, self.down_t, out, self.gate_mode)[1]

    def step(self, x: np.ndarray, activation: str, active: np.ndarray | None,
             threshold: float | None) -> tuple[np.ndarray, int]:
        """x (T, hidden) float32 -> (this shard's partial output (T, hidden), active pairs)."""
        xs = np.ascontiguousarray(x, dtype=np.float32)
        if len(xs) == 1:
            y, n = ffn_token(self.gate, self.up, self.down, xs[0], self.own, activation, self.scratch,
                             threshold, active, self.fast, self.down_t, gate_mode=self.gate_mode)
            return y.copy()[None], n
        if len(xs) <= MAX_SMALL_BATCH or self.tiled_prefill:
            # small batches, and with fast arithmetic any batch: MAX_SMALL_BATCH tokens at a time
            # through the integer kernels (see FileRows.tiled_prefill)
            y, n_active = np.empty_like(xs), 0
            for a in range(0, len(xs), MAX_SMALL_BATCH):
                part, n = ffn_batch(self.gate, self.up, self.down, xs[a:a + MAX_SMALL_BATCH], self.own, activation,
                                    self.scratch, threshold, active, self.fast, self.down_t,
                                    gate_mode=self.gate_mode)
                y[a:a + len(part)] = part
                n_active += n
            return y, n_active
        # A prompt: dequantize a chunk of owned neurons at a time into reused tiles and let
        # numpy's float32 GEMM run (down as read: (hidden, chunk) columns, used transposed).
        act = _np_activation(activation)
        y, n_active = np.zeros_like(xs), 0
        tiles = self.scratch.batch_tiles(PREFILL_CHUNK)
        hidden = self.gate.cols
        for a in range(self.own.start, self.own.stop, PREFILL_CHUNK):
            rows = range(a, min(a + PREFILL_CHUNK, self.own.stop))
            n = len(rows) * hidden
            gate = self.gate.dequantize(rows, out=tiles[0][:n]).reshape(len(rows), hidden)
            g = act(_gemm(xs, gate.T))  # (T, chunk)
            if threshold is not None:  # CATS: |act(gate x)| > threshold (sparsecore.ffn.is_active)
                keep = np.abs(g) > threshold
                k = int(keep.sum())
            else:
                keep = None if active is None else active[rows.start:rows.stop].astype(bool)[None, :]
                k = len(rows) * len(xs) if keep is None else int(keep.sum()) * len(xs)
            if k == 0:
                continue
            if self.gate_mode != "none":
                up = self.up.dequantize(rows, out=tiles[1][:n]).reshape(len(rows), hidden)
                u = _gemm(xs, up.T)
                g = g * (act(u) if self.gate_mode == "sym" else u)
            if keep is not None:
                g = g * keep
            if self.down_t:
                down_t = self.down.dequantize(rows, out=tiles[2][:n]).reshape(len(rows), hidden)
                y += _gemm(g, down_t)
            else:
                down = self.down.dequantize(cols=rows, out=tiles[2][:n]).reshape(hidden, len(rows))
                y += _gemm(g, down.T)
            n_active += k
        return y, n_active
