"""`FfnShard`: the FFN neurons one process owns, in every layer, and the step that computes them.

The same class serves the CPU workers, the GPU worker and the coordinator's own share: each
memory-maps the model file and keeps only its rows (workers never receive weights over the
wire). Per layer it holds the gate and up rows of its neurons and the matching down columns
stored as rows (down_t), so both dense and sparse steps are row operations:
    y = down_t[A]^T @ (act(gate[A] @ x) * (up[A] @ x))
Summing y over the shards gives the full FFN with inactive neurons zeroed. A shard may also own
a range of the lm_head's vocabulary rows (`head`), which the CPU-only setup splits too.

`serve` is the one glue between a posted step in shared memory and `step`: read x, the mask or
the layer's threshold, compute, write the partial output into the process's slot.
"""
from __future__ import annotations

import time
from os import PathLike

import numpy as np
import torch

from protocol.doorbell import Request
from protocol.shm_layout import HEAD_LAYER, SharedBuffers

from .config import read_config
from .ffn import Rows, ffn_partial, ffn_partial_threshold, quantize_rows, rows_nbytes
from .gguf_file import open_gguf
from .lm_head import HeadRows, head_tensor_name
from .tensors import TensorStore


class LayerRows:
    """One layer's owned neurons: gate/up rows and down columns (as rows) on the device, in the
    weight format `weights` (sparsecore.ffn.WEIGHT_FORMATS), converted once from the file."""

    def __init__(self, store: TensorStore, layer: int, idx: np.ndarray, device: torch.device, weights: str):
        self.idx = idx
        p = f"blk.{layer}."
        conv = lambda a, down=False: quantize_rows(torch.from_numpy(np.ascontiguousarray(a)).to(device),
                                                   weights, for_h_w=down)
        self.gate: Rows = conv(store.rows(p + "ffn_gate.weight", idx))
        self.up: Rows = conv(store.rows(p + "ffn_up.weight", idx))
        if store.has(p + "ffn_down_t.weight"):  # PowerInfer stores down transposed: rows are neurons
            self.down_t: Rows = conv(store.rows(p + "ffn_down_t.weight", idx), down=True)
        else:
            self.down_t = conv(store.columns(p + "ffn_down.weight", idx), down=True)

    @property
    def nbytes(self) -> int:
        return sum(rows_nbytes(w) for w in (self.gate, self.up, self.down_t))


class FfnShard:
    def __init__(self, layers: dict[int, LayerRows], activation: str, device: torch.device,
                 head: HeadRows | None = None):
        self.layers, self.activation, self.device, self.head = layers, activation, device, head

    @classmethod
    def load(cls, model_path: str | PathLike, neurons: list[np.ndarray], device: torch.device | str = "cpu",
             weights: str = "f32", head_rows: tuple[int, int] | None = None,
             store: TensorStore | None = None) -> "FfnShard":
        """Rows of `neurons[layer]` (global neuron indices) of every layer, and optionally the
        lm_head's vocabulary rows [start, stop). `store`: an open TensorStore of the same file."""
        if store is None:
            store = TensorStore(model_path, open_gguf(model_path))
        cfg = read_config(model_path, store.reader)
        device = torch.device(device)
        layers = {layer: LayerRows(store, layer, np.asarray(idx, dtype=np.int64), device, weights)
                  for layer, idx in enumerate(neurons) if len(idx)}
        head = HeadRows(store, head_tensor_name(cfg.tied_embeddings), *head_rows) if head_rows else None
        return cls(layers, cfg.activation, device, head)

    @property
    def n_neurons(self) -> int:
        return sum(len(w.idx) for w in self.layers.values())

    @property
    def nbytes(self) -> int:
        """FFN weight bytes held (the head's rows are not counted: they are the lm_head's)."""
        return sum(w.nbytes for w in self.layers.values())

    def takes_part(self, layer: int) -> bool:
        return self.head is not None if layer == HEAD_LAYER else layer in self.layers

    def step(self, layer: int, x: torch.Tensor, active: np.ndarray | None = None,
             threshold: float | None = None) -> tuple[torch.Tensor, int]:
        """This shard's partial FFN output for x (T, hidden) and the active neuron-token pairs.
        Dense unless `active` (a mask over all n_ff neurons of the layer, a predictor's choice)
        or `threshold` (CATS: neurons whose |act(gate x)| exceeds it) is given."""
        w = self.layers[layer]
        if threshold is not None:
            return ffn_partial_threshold(x, w.gate, w.up, w.down_t, self.activation, threshold)
        if active is None:
            return ffn_partial(x, w.gate, w.up, w.down_t, self.activation), len(w.idx) * x.shape[0]
        own = torch.from_numpy(np.flatnonzero(active[w.idx])).to(self.device)
        return ffn_partial(x, w.gate, w.up, w.down_t, self.activation, own), int(own.numel()) * x.shape[0]

    def serve(self, buf: SharedBuffers, slot: int, req: Request) -> tuple[int, int]:
        """Compute the posted step `req` from shared memory into output slot `slot`.
        Returns (active neuron-token pairs, ns taken)."""
        t0 = time.perf_counter()
        if req.layer == HEAD_LAYER:  # x[0] -> this shard's logits, flat at the start of the slot
            logits = self.head(buf.x[:1])
            buf.out[slot].reshape(-1)[: len(logits)] = logits
            return 0, int((time.perf_counter() - t0) * 1e9)
        x = torch.from_numpy(buf.x[:req.n_tokens]).to(self.device)
        threshold = float(buf.thresholds[req.layer]) if req.threshold else None
        y, n_active = self.step(req.layer, x, None if req.dense or req.threshold else buf.mask, threshold)
        buf.out[slot, :req.n_tokens] = y.cpu().numpy()
        return n_active, int((time.perf_counter() - t0) * 1e9)
