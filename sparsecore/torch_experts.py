"""`TorchExpertsLayer`: a routed layer's owned experts as float copies on a torch device: the GPU
worker's most-routed experts on CUDA (float16, dequantized once from the file's blocks, as
sparsecore/shard.py LayerRows holds a dense layer's rows there), or any process's with converted
weights (`--weights f32|f16|int8`: float32 on the CPU is how the tests run this path without a GPU).

Routing is the CPU kernel's, on the CPU (sparsecore/experts.py route over the file's router, on
the same FFN input every process reads from shared memory): every process picks the same experts,
whatever device computes them. Then each chosen expert this process owns runs in torch
(sparsecore/ffn.py ffn_partial, or ffn_partial_threshold at the expert's CATS threshold), times
its weight:
    y = sum over the token's k experts e, owned, of w_e * down_e[:, own] (act(gate_e[own] x) * up_e[own] x)
plus, where the process holds it, its share of the shared expert times sigmoid(gate . x).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .expert_thresholds import of_expert, per_expert
from .experts import route, shared_scale
from .kernels import FileMatrix
from .tensors import TensorStore

if TYPE_CHECKING:
    import torch


class TorchExpertsLayer:
    """One routed layer's owned experts in torch (module doc). `owned`: (E,) bool, the experts
    whose neurons `own` this process holds (None: all); `with_shared`: it holds the same multiple
    of that range of the shared expert; `fmt`: the weight format (sparsecore/ffn.py
    quantize_rows: f32, f16, int8). `counts` (E int64) counts the chosen experts computed here."""

    def __init__(self, store: TensorStore, layer: int, own: range, cfg, device: "torch.device", fmt: str,
                 owned: np.ndarray | None = None, with_shared: bool = True):
        import torch

        from .ffn import quantize_rows
        p = f"blk.{layer}."
        self.router = FileMatrix(store.info(p + "ffn_gate_inp.weight"))
        if self.router.rows != cfg.n_experts:
            raise ValueError(f"{p}ffn_gate_inp.weight scores {self.router.rows} experts, the file says {cfg.n_experts}")
        self.k, self.renormalize, self.gate_mode = cfg.n_experts_used, cfg.expert_norm, cfg.ffn_gate
        self.owned = np.ones(cfg.n_experts, bool) if owned is None else np.asarray(owned, bool)
        if self.owned.shape != (cfg.n_experts,):
            raise ValueError(f"layer {layer}: an ownership of {self.owned.shape} experts, the file has {cfg.n_experts}")
        self.own, self.idx, self.device = own, np.arange(own.start, own.stop), device
        self.counts = np.zeros(cfg.n_experts, np.int64)
        self.probs = np.empty(cfg.n_experts, np.float32)
        self._flat = np.empty(cfg.n_experts, np.float32)  # one threshold for every expert (per_expert)

        def rows(info, neurons: range):
            """gate/up rows and down's columns (as rows) of `neurons`, in `fmt` on the device."""
            gate, up, down = (FileMatrix(i) for i in info)
            conv = lambda a, h_w=False: quantize_rows(torch.from_numpy(np.ascontiguousarray(a)).to(device), fmt,  # noqa: E731
                                                      for_h_w=h_w)
            return (conv(gate.dequantize(rows=neurons)), conv(up.dequantize(rows=neurons)),
                    conv(down.dequantize(cols=neurons).T, True))

        names = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
        # None: an expert another process computes
        self.experts = [rows([store.expert(p + n, e) for n in names], own) if self.owned[e] else None
                        for e in range(cfg.n_experts)]
        self.shared = self.shared_gate = None
        if cfg.n_ff_shared and with_shared:  # qwen2moe: the same multiple of this range of its neurons
            m = cfg.n_ff_shared // cfg.n_ff
            self.shared = rows([store.info(p + n) for n in ("ffn_gate_shexp.weight", "ffn_up_shexp.weight",
                                                            "ffn_down_shexp.weight")],
                               range(m * own.start, m * own.stop))
            self.shared_width = m * len(own)
            self.shared_gate = np.ascontiguousarray(store.matrix(p + "ffn_gate_inp_shexp.weight").reshape(-1),
                                                    dtype=np.float32)

    def count_into(self, counts: np.ndarray) -> None:
        """As ExpertsLayer.count_into: count the chosen experts computed here into `counts`."""
        if counts.shape != self.counts.shape or counts.dtype != np.int64:
            raise ValueError(f"route counts {counts.shape} {counts.dtype}: {len(self.counts)} int64")
        self.counts = counts

    @property
    def nbytes(self) -> int:
        """Bytes of the weights held (every owned expert's, the shared expert's share)."""
        from .ffn import rows_nbytes
        held = [r for e in self.experts if e is not None for r in e] + list(self.shared or ())
        return sum(rows_nbytes(r) for r in held)

    def step(self, x: np.ndarray, activation: str, active: np.ndarray | None,
             threshold) -> tuple[np.ndarray, int]:
        """x (T, hidden) float32 on the CPU -> (this process's partial output (T, hidden) float32
        numpy, active neuron-token pairs): routed on the CPU, the owned chosen experts computed on
        the device, each expert's tokens together."""
        import torch

        from .ffn import ffn_partial, ffn_partial_threshold
        xs = np.ascontiguousarray(x, dtype=np.float32)
        thr = per_expert(threshold, self._flat, active)
        ids, weights = route(self.router, xs, self.k, self.renormalize, self.probs)
        self.counts += np.bincount(ids.reshape(-1), minlength=len(self.counts)) * self.owned
        xd = torch.from_numpy(xs).to(self.device)
        y = torch.zeros_like(xd)
        n = 0
        for e in np.unique(ids):
            if not self.owned[e]:
                continue
            rows, slot = np.nonzero(ids == e)
            at = torch.from_numpy(rows).to(self.device)
            gate, up, down = self.experts[e]
            t = of_expert(thr, int(e))
            xe = xd.index_select(0, at)
            if t is None:
                part, k = ffn_partial(xe, gate, up, down, activation, gate_mode=self.gate_mode), len(self.own) * len(rows)
            else:
                part, k = ffn_partial_threshold(xe, gate, up, down, activation, t, self.gate_mode)
            w = torch.from_numpy(np.ascontiguousarray(weights[rows, slot])).to(self.device)
            y.index_add_(0, at, w[:, None] * part.to(y.dtype))
            n += k
        if self.shared is not None:  # dense (no thresholds calibrated for it), scaled by its gate
            part = ffn_partial(xd, *self.shared, activation, gate_mode=self.gate_mode)
            y += torch.from_numpy(shared_scale(self.shared_gate, xs)).to(self.device)[:, None] * part.to(y.dtype)
            n += self.shared_width * len(xs)
        return y.cpu().numpy(), n
