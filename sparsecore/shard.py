"""`FfnShard`: the FFN neurons one process owns, in every layer, and the step that computes them.

The same class serves the CPU workers, the GPU worker and the coordinator's own share: each
memory-maps the model file and keeps only its rows (workers never receive weights over the
wire). Per layer it holds the gate and up rows of its neurons and the matching down columns
stored as rows (down_t), so both dense and sparse steps are row operations:
    y = down_t[A]^T @ (act(gate[A] @ x) * (up[A] @ x))
Summing y over the shards gives the full FFN with inactive neurons zeroed. A shard may also own
a range of the lm_head's vocabulary rows (`head`), which the CPU-only setup splits too.

A dense layer's rows on the file's blocks are a FileLayer (sparsecore/file_layer.py); a routed
layer's, an ExpertsLayer of FileLayers (sparsecore/experts.py; gpt-oss's, sparsecore/oai_experts.py),
or on a GPU (or with converted weights) a TorchExpertsLayer (sparsecore/torch_experts.py).

`serve` is the one glue between a posted step in shared memory and `step`: read x, the mask or
the layer's threshold, compute, write the partial output into the process's slot.
"""
from __future__ import annotations

import time
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from protocol.doorbell import Request
from protocol.messages import ROW_LAYOUTS
from protocol.shm_layout import SharedBuffers, StepKind

from .config import read_config
from .expert_thresholds import step_threshold
from .gguf_file import open_gguf
from .kernels import MAX_SMALL_BATCH, FfnScratch
from .kernels import layout_cache
from .experts import ExpertsLayer
from .oai_experts import OaiExpertsLayer
from .file_layer import FileLayer
from .lm_head import HeadRows, head_tensor_name
from .predictor_rows import PredictorRows, native_predictor, predictor_thresholds
from .tensors import TensorStore
from .torch_experts import TorchExpertsLayer

if TYPE_CHECKING:
    import torch

    from .ffn import Rows

# torch is imported only where a shard holds float copies (LayerRows: --weights f32/int8/f16, a
# GPU): a CPU worker computing on the file's blocks never imports it (a quarter of a GB resident
# and about a second of start-up per process).


class LayerRows:
    """One layer's owned neurons: gate/up rows and down columns (as rows) on the device, in the
    weight format `weights` (sparsecore.ffn.WEIGHT_FORMATS), converted once from the file."""

    def __init__(self, store: TensorStore, layer: int, idx: np.ndarray, device: "torch.device", weights: str,
                 gate_mode: str = "par"):
        import torch

        from .ffn import quantize_rows
        self.idx = idx
        p = f"blk.{layer}."
        conv = lambda a, down=False: quantize_rows(torch.from_numpy(np.ascontiguousarray(a)).to(device),
                                                   weights, for_h_w=down)
        self.gate: Rows = conv(store.rows(p + "ffn_gate.weight", idx))
        # no gate (falcon): the gate rows are the up rows, used once
        self.up: Rows = self.gate if gate_mode == "none" else conv(store.rows(p + "ffn_up.weight", idx))
        if store.has(p + "ffn_down_t.weight"):  # PowerInfer stores down transposed: rows are neurons
            self.down_t: Rows = conv(store.rows(p + "ffn_down_t.weight", idx), down=True)
        else:
            self.down_t = conv(store.columns(p + "ffn_down.weight", idx), down=True)

    @property
    def nbytes(self) -> int:
        from .ffn import rows_nbytes
        return sum(rows_nbytes(w) for w in {id(w): w for w in (self.gate, self.up, self.down_t)}.values())


def as_range(idx: np.ndarray, align: int) -> range | None:
    """idx as a contiguous range of neurons starting on a multiple of `align` (what the static
    plan hands out), or None."""
    if len(idx) == 0 or idx[0] % align or not np.array_equal(idx, np.arange(idx[0], idx[0] + len(idx))):
        return None
    return range(int(idx[0]), int(idx[0]) + len(idx))


class FfnShard:
    def __init__(self, layers: dict[int, LayerRows], activation: str, device: "torch.device | str",
                 head: HeadRows | None = None, gate_mode: str = "par", predict: dict[int, PredictorRows] | None = None):
        self.layers, self.activation, self.device, self.head = layers, activation, device, head
        self.gate_mode = gate_mode  # ModelConfig.ffn_gate
        self.predict = predict or {}  # per layer: this shard's share of the predictor (FLAG_PREDICT steps)

    @property
    def predicts(self) -> bool:
        """Every layer it owns neurons of can score them itself (FLAG_PREDICT)."""
        return bool(self.layers) and set(self.predict) == set(self.layers)

    @classmethod
    def load(cls, model_path: str | PathLike, neurons: list[np.ndarray], device: "torch.device | str" = "cpu",
             weights: str = "f32", head_rows: tuple[int, int] | None = None,
             store: TensorStore | None = None, fast: bool = False,
             predictor_path: str | PathLike | None = None, row_layout: str = "",
             cold: np.ndarray | None = None, experts: np.ndarray | None = None,
             deal: tuple[int, int] | None = None) -> "FfnShard":
        """Rows of `neurons[layer]` (global neuron indices) of every layer, and optionally the
        lm_head's vocabulary rows [start, stop). `store`: an open TensorStore of the same file.
        `predictor_path`: a file with blk.N.fc1/fc2 (the model itself or a predictor file):
        layers kept in the file's blocks score their own neurons with it (PredictorRows).
        weights "gguf": on the CPU, layers whose neurons are a 32-aligned range of types the
        kernels read stay in the file's blocks (FileLayer); others, and a CUDA device, are
        converted once (float32 on the CPU, float16 on a GPU). `row_layout`: with `fast`, which
        rows are interleaved (protocol.messages.ROW_LAYOUTS, FileLayer). `cold`: (n_layers, units)
        1 where a unit's (a layer's, an expert's) layouts stay mapped from the process's layout
        cache (layout_cache.active) instead of held in memory; None: all held. `experts`: a routed
        model's (n_layers, E [+ 1 where it has a shared expert]) bool, the experts whose range
        neurons[layer] this process owns (the last column: the shared expert's); None: all of them.
        Routed experts stay in the file's blocks on the CPU (ExpertsLayer); on CUDA, or with
        converted weights, they are float copies computed in torch (TorchExpertsLayer). `deal`:
        (phase, dealers), the CPU's routed layers hold their owned experts whole and compute
        this process's dealt share of each token's (ExpertsLayer); None: the ranges."""
        if row_layout not in ROW_LAYOUTS:
            raise ValueError(f"interleaved rows {row_layout!r}: one of {ROW_LAYOUTS}")
        if store is None:
            store = TensorStore(model_path, open_gguf(model_path))
        cfg = read_config(model_path, store.reader)
        device_type = str(device).split(":")[0]  # a torch.device only where float copies are made
        layers: dict[int, LayerRows | FileLayer] = {}
        ranges = [as_range(np.asarray(idx, dtype=np.int64), FileLayer.align(store, layer))
                  for layer, idx in enumerate(neurons)]
        # one scratch for every layer: a dealt routed layer computes whole experts (n_ff neurons)
        widest = max((len(r) for r in ranges if r is not None), default=0)
        scratch = FfnScratch(cfg.hidden, max(widest, cfg.n_ff) if deal is not None and cfg.routed else widest)
        for layer, idx in enumerate(neurons):
            if not len(idx):
                continue
            if cfg.routed:
                owned = None if experts is None else np.asarray(experts[layer, :cfg.n_experts], bool)
                with_shared = experts is None or not cfg.n_ff_shared or bool(experts[layer, cfg.n_experts])
                if cfg.expert_bias and owned is not None and not owned.all():
                    raise ValueError("gpt-oss's experts split by ranges of neurons only, not whole experts")
                if weights == "gguf" and device_type == "cpu":  # the file's blocks, the native kernels
                    if not FileLayer.fits(store, layer, ranges[layer]):
                        raise ValueError(f"layer {layer}: routed experts run on the file's blocks on the CPU, as a "
                                         f"{FileLayer.align(store, layer)}-aligned range of each expert's neurons")
                    if cfg.expert_bias:  # gpt-oss: biases, its gating and clamped SwiGLU (sparsecore/oai_experts.py)
                        layers[layer] = OaiExpertsLayer(store, layer, ranges[layer], fast, scratch, cfg, row_layout,
                                                        deal)
                    else:
                        layers[layer] = ExpertsLayer(store, layer, ranges[layer], fast, scratch, cfg, row_layout,
                                                     None if cold is None else cold[layer], owned, with_shared, deal)
                    continue
                import torch

                own = as_range(np.asarray(idx, dtype=np.int64), 1)
                if own is None or cfg.expert_bias or cfg.router_reads_layer_input:
                    raise ValueError(f"layer {layer}: routed experts in torch take a contiguous range of each "
                                     f"expert's neurons, and not gpt-oss's or smallthinker's routing")
                device = torch.device(device)
                fmt = weights if weights != "gguf" else ("f16" if device.type == "cuda" else "f32")
                layers[layer] = TorchExpertsLayer(store, layer, own, cfg, device, fmt, owned, with_shared)
            elif weights == "gguf" and device_type == "cpu" and FileLayer.fits(store, layer, ranges[layer]):
                with layout_cache.placing(cold is None or not cold[layer, 0]):
                    layers[layer] = FileLayer(store, layer, ranges[layer], fast, scratch, cfg.ffn_gate, row_layout)
            else:
                import torch

                device = torch.device(device)
                fmt = weights if weights != "gguf" else ("f16" if device.type == "cuda" else "f32")
                layers[layer] = LayerRows(store, layer, np.asarray(idx, dtype=np.int64), device, fmt, cfg.ffn_gate)
        head = None
        if head_rows:
            head = HeadRows(store, head_tensor_name(cfg.tied_embeddings), *head_rows, in_file=weights == "gguf",
                            fast=fast)
        predict = {}
        if predictor_path:
            same = Path(predictor_path).resolve() == Path(model_path).resolve()
            pstore = store if same else TensorStore(predictor_path, open_gguf(predictor_path))
            thresholds = predictor_thresholds(pstore.reader, cfg.n_layers)
            for layer, w in layers.items():
                if thresholds is not None and isinstance(w, FileLayer) and native_predictor(pstore, layer):
                    predict[layer] = PredictorRows.load(pstore, layer, w.own, thresholds[layer], fast)
        return cls(layers, cfg.activation, device, head, cfg.ffn_gate, predict)

    @property
    def n_neurons(self) -> int:
        return sum(len(w.idx) for w in self.layers.values())

    def experts_held(self, n_layers: int, n_experts: int) -> np.ndarray:
        """(n_layers, n_experts) uint8: 1 where this shard holds rows of that layer's routed expert."""
        held = np.zeros((n_layers, n_experts), np.uint8)
        for layer, w in self.layers.items():
            owned = getattr(w, "owned", None)
            if owned is not None:
                held[layer] = [e is not None for e in w.experts]
        return held

    def count_routes_into(self, counts: np.ndarray) -> None:
        """Count each routed layer's chosen experts computed here into counts[layer] (n_layers, E
        int64: this process's rows of the shared segment's route counts)."""
        for layer, w in self.layers.items():
            if isinstance(w, (ExpertsLayer, TorchExpertsLayer)):
                w.count_into(counts[layer])

    @property
    def nbytes(self) -> int:
        """FFN weight bytes held (the head's rows are not counted: they are the lm_head's)."""
        return sum(w.nbytes for w in self.layers.values())

    def takes_part(self, kind: StepKind, layer: int) -> bool:
        """Whether this shard computes anything of an FFN step of `layer` or of a head step."""
        return self.head is not None if kind is StepKind.HEAD else kind is StepKind.FFN and layer in self.layers

    def step(self, layer: int, x: "torch.Tensor", active: np.ndarray | None = None,
             threshold: float | None = None) -> tuple["torch.Tensor", int]:
        """This shard's partial FFN output for x (T, hidden) and the active neuron-token pairs.
        Dense unless `active` (a mask over all n_ff neurons of the layer, a predictor's choice)
        or `threshold` (CATS: neurons whose |act(gate x)| exceeds it) is given."""
        import torch

        from .ffn import ffn_partial, ffn_partial_threshold
        w = self.layers[layer]
        if isinstance(w, (FileLayer, ExpertsLayer, TorchExpertsLayer)):
            y, n = w.step(x.cpu().numpy(), self.activation, active, threshold)
            return torch.from_numpy(y), n
        if threshold is not None:
            return ffn_partial_threshold(x, w.gate, w.up, w.down_t, self.activation, threshold, self.gate_mode)
        if active is None:
            return (ffn_partial(x, w.gate, w.up, w.down_t, self.activation, gate_mode=self.gate_mode),
                    len(w.idx) * x.shape[0])
        own = torch.from_numpy(np.flatnonzero(active[w.idx])).to(self.device)
        return (ffn_partial(x, w.gate, w.up, w.down_t, self.activation, own, self.gate_mode),
                int(own.numel()) * x.shape[0])

    def serve(self, buf: SharedBuffers, slot: int, req: Request) -> tuple[int, int]:
        """Compute the posted step `req` from shared memory into output slot `slot`.
        Returns (active neuron-token pairs, ns taken)."""
        t0 = time.perf_counter()
        if req.kind is StepKind.HEAD:  # x[:T] -> this shard's logits (T, rows), flat at the start of the slot
            logits = self.head(buf.x[:req.n_tokens]).reshape(-1)
            flat = buf.out[slot].reshape(-1)
            if logits.size > flat.size:
                raise ValueError(f"{req.n_tokens} tokens of {self.head.stop - self.head.start} logits do not fit "
                                 f"an output slot of {flat.size} values")
            flat[: logits.size] = logits
            return 0, int((time.perf_counter() - t0) * 1e9)
        w = self.layers[req.layer]
        threshold = step_threshold(w, buf, req.layer) if req.threshold else None
        active = None if req.dense or req.threshold else buf.mask
        if req.predict:  # one token: score this shard's neurons from its pre-norm residual in x[1]
            if req.n_tokens != 1 or req.layer not in self.predict:
                raise ValueError(f"a predictor step of {req.n_tokens} tokens for layer {req.layer}, which this "
                                 f"shard {'cannot score' if req.layer not in self.predict else 'scores one at a time'}")
            active = self.predict[req.layer].mask_for(buf.x[1])
        # smallthinker's router scores the layer's inputs: the step carries them after the FFN's
        T = req.n_tokens
        routing = {"router_x": buf.x[T:2 * T]} if isinstance(w, ExpertsLayer) and w.router_reads_layer_input else {}
        if T == 1 and isinstance(w, (FileLayer, ExpertsLayer)):  # a decoded token: the kernel writes the slot
            one = {"router_x": buf.x[1]} if routing else {}
            n_active = w.token_into(buf.x[0], self.activation, active, threshold, buf.out[slot, 0], **one)
            return n_active, int((time.perf_counter() - t0) * 1e9)
        if req.n_tokens <= MAX_SMALL_BATCH and isinstance(w, (FileLayer, ExpertsLayer)):  # sequences decoded together: the same
            n_active = w.batch_into(buf.x[:req.n_tokens], self.activation, active, threshold,
                                    buf.out[slot, :req.n_tokens], **routing)
            return n_active, int((time.perf_counter() - t0) * 1e9)
        if isinstance(w, (FileLayer, ExpertsLayer, TorchExpertsLayer)):  # a prompt: numpy's GEMM or integer tiles;
            # torch's experts: routed here on the CPU, computed on their device
            y, n_active = w.step(buf.x[:req.n_tokens], self.activation, active, threshold, **routing)
            buf.out[slot, :req.n_tokens] = y
            return n_active, int((time.perf_counter() - t0) * 1e9)
        import torch

        x = torch.from_numpy(buf.x[:req.n_tokens]).to(self.device)
        y, n_active = self.step(req.layer, x, active, threshold)
        buf.out[slot, :req.n_tokens] = y.cpu().numpy()
        return n_active, int((time.perf_counter() - t0) * 1e9)
