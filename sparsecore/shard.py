"""`FfnShard`: the FFN neurons one process owns, in every layer, and the step that computes them.

The same class serves the CPU workers, the GPU worker and the coordinator's own share: each
memory-maps the model file and keeps only its rows (workers never receive weights over the
wire). Per layer it holds the gate and up rows of its neurons and the matching down columns
stored as rows (down_t), so both dense and sparse steps are row operations:
    y = down_t[A]^T @ (act(gate[A] @ x) * (up[A] @ x))
Summing y over the shards gives the full FFN with inactive neurons zeroed. A shard may also own
a range of the lm_head's vocabulary rows (`head`), which the CPU-only setup splits too.

A dense layer's rows on the file's blocks are a FileLayer (sparsecore/file_layer.py); a routed
layer's, an ExpertsLayer of FileLayers (here).

`serve` is the one glue between a posted step in shared memory and `step`: read x, the mask or
the layer's threshold, compute, write the partial output into the process's slot.
"""
from __future__ import annotations

import ctypes
import time
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from protocol.doorbell import Request
from protocol.messages import ROW_LAYOUTS
from protocol.shm_layout import SharedBuffers, StepKind

from .config import read_config
from .expert_thresholds import of_expert, per_expert, step_threshold
from .gguf_file import open_gguf
from .kernels import MAX_SMALL_BATCH, FfnScratch, FileMatrix, Mat, _kernels, ffn_token_call, mat_record, ptr
from .kernels import layout_cache
from .file_layer import FileLayer
from .lm_head import HeadRows, head_tensor_name
from .predictor_rows import PredictorRows, native_predictor, predictor_thresholds
from .tensors import TensorStore

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


def route(router: FileMatrix, x: np.ndarray, k: int, renormalize: bool,
          probs: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The k experts of each row of x (T, hidden) and their weights, (T, k) int32 and float32,
    by the kernel the token step routes with (moe_step.c moe_route): what a process computes,
    and what `sparseinfer profile` counts. router: ffn_gate_inp, one row per expert."""
    T, E = len(x), router.rows
    xs = np.ascontiguousarray(x, dtype=np.float32)
    if xs.ndim != 2 or xs.shape[1] != router.cols or not 1 <= k <= E:
        raise ValueError(f"routing {xs.shape} inputs over {E} experts of width {router.cols}, top {k}")
    probs = np.empty(E, np.float32) if probs is None else probs
    ids, weights = np.empty((T, k), np.int32), np.empty((T, k), np.float32)
    for t in range(T):
        _kernels.moe_route(*router.args, ptr(xs[t]), xs.shape[1], E, k, int(renormalize), ptr(probs), ptr(ids[t]),
                           ptr(weights[t]))
    return ids, weights


class ExpertsLayer:
    """One routed layer's owned neurons (sparsecore/arch.py FFN_KINDS): the range `own` of every
    expert's neurons, each expert a FileLayer over its slices of the stacked ffn_*_exps tensors,
    and the router. Every process routes each token itself, with the same native kernel on the
    same FFN input (so all choose the same experts: no routing crosses the wire), and computes
    its share of the chosen experts, each times its weight:
        y = sum over the token's k experts e of w_e * down_e[:, own] (act(gate_e[own] x) * up_e[own] x)
    Routing as llama.cpp's build_moe_ffn: softmax of router . x, the top k (ties to the lower
    index), renormalized to sum 1 where the architecture says (qwen3moe)."""

    def __init__(self, store: TensorStore, layer: int, own: range, fast: bool, scratch: FfnScratch, cfg,
                 row_layout: str = "", cold: np.ndarray | None = None):
        self.router = FileMatrix(store.info(f"blk.{layer}.ffn_gate_inp.weight"))
        if self.router.rows != cfg.n_experts:
            raise ValueError(f"blk.{layer}.ffn_gate_inp.weight scores {self.router.rows} experts, the file says "
                             f"{cfg.n_experts}")
        self.k, self.renormalize = cfg.n_experts_used, cfg.expert_norm
        self.experts = []
        # cold experts' layouts stay mapped from the layout cache: their maps, per expert, are read
        # ahead once a token has chosen them (token_into)
        self.cold_maps: dict[int, list] = {}
        cache = layout_cache.active
        for e in range(cfg.n_experts):
            before = len(cache.maps) if cache is not None else 0
            with layout_cache.placing(cold is None or not cold[e]):
                self.experts.append(FileLayer(store, layer, own, fast, scratch, cfg.ffn_gate, row_layout, expert=e))
            if cache is not None and len(cache.maps) > before:
                self.cold_maps[e] = cache.maps[before:]
        self.own, self.idx, self.gate_mode = own, np.arange(own.start, own.stop), cfg.ffn_gate
        self.part = np.empty((MAX_SMALL_BATCH, self.router.cols), np.float32)  # one expert's share
        self.probs = np.empty(cfg.n_experts, np.float32)
        self._flat = np.empty(cfg.n_experts, np.float32)  # one threshold for every expert (per_expert)
        # The shared expert (qwen2moe): the same multiple of this range of its neurons, every token,
        # times sigmoid(gate . x), which each process computes alike and applies to its own share.
        self.shared = self.shared_gate = None
        if cfg.n_ff_shared:
            m = cfg.n_ff_shared // cfg.n_ff
            own_shared = range(m * own.start, m * own.stop)
            self.shared = FileLayer(store, layer, own_shared, fast, FfnScratch(self.router.cols, len(own_shared)),
                                    cfg.ffn_gate, row_layout, shared=True)
            self.shared_gate = np.ascontiguousarray(
                store.matrix(f"blk.{layer}.ffn_gate_inp_shexp.weight").reshape(-1), dtype=np.float32)
        self.ids, self.weights = np.empty(self.k, np.int32), np.empty(self.k, np.float32)
        self._tabulate()

    def _tabulate(self) -> None:
        """Every expert's gate, up and down as mat records, looked up by the native token step."""
        self.table = (Mat * (3 * len(self.experts)))(*(mat_record(m) for e in self.experts
                                                       for m in (e.gate, e.up, e.down)))
        self._head = (ctypes.addressof(self.table), len(self.experts), self.k, int(self.renormalize), *self.router.args,
                      ptr(self.probs), ptr(self.ids), ptr(self.weights))
        self._calls: dict[tuple[int, int], tuple] = {}  # (x, out) addresses -> the call's arguments, its record

    def add_twins(self, add) -> None:
        """Each expert's twins as its FileLayer makes them (sparsecore/input_sparsity.py): with
        CATS ("down") a down twin over the owned neurons, so that a chosen expert's skipped
        neuron skips its whole down row as a dense layer's does (down's file rows hold 32
        neurons a block: at 50 % of neurons active nearly every block has one)."""
        for e in self.experts:
            e.add_twins(add)
        self._tabulate()

    @property
    def nbytes(self) -> int:
        """Bytes of the file a token reads here: its k experts' owned rows, the shared expert's
        and the router."""
        shared = 0 if self.shared is None else self.shared.nbytes
        return self.k * self.experts[0].nbytes + shared + self.router.rows * self.router.row_bytes

    def _shared_scale(self, x: np.ndarray) -> np.ndarray:
        """sigmoid(gate . x) per row of x (T, hidden): a float64 dot a row, the same whatever
        the batch (a matrix product may sum in another order), every process alike."""
        g64 = self.shared_gate.astype(np.float64)
        g = np.array([np.dot(row, g64) for row in x.astype(np.float64)])
        return (1.0 / (1.0 + np.exp(-g))).astype(np.float32)

    def _read_ahead(self, ids: np.ndarray) -> None:
        """Start reading the chosen experts that are mapped from disk (all of them, then compute):
        one fault at a time would read them one after the other, a token's few hundred KB each."""
        for e in ids:
            maps = self.cold_maps.get(int(e))
            if maps:
                layout_cache.read_ahead(maps)

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The experts of each row of x (T, hidden) and their weights: (T, k) int32, (T, k) float32."""
        return route(self.router, x, self.k, self.renormalize, self.probs)

    def token_into(self, x: np.ndarray, activation: str, active: np.ndarray | None, threshold,
                   out: np.ndarray) -> int:
        """One token into `out` (hidden,): the weighted sum of its experts' shares, each chosen
        expert dense or, with `threshold` (expert_thresholds.per_expert), at its own threshold."""
        thr = per_expert(threshold, self._flat, active)
        if self.cold_maps:  # route here first, to have the chosen cold experts' reads start together
            self._read_ahead(self.route(x[None])[0][0])
        key = (x.ctypes.data, out.ctypes.data)
        args, ffn = self._calls.get(key, (None, None))
        if args is None:  # checked and resolved once per pair of buffers (a slot, lockstep's rows)
            e = self.experts[0]
            ffn = ffn_token_call(e.gate, e.up, e.down, x, self.own, activation, e.scratch, e.fast, False, self.part[0],
                                 self.gate_mode)
            if out.dtype != np.float32 or out.shape != x.shape or not out.flags.c_contiguous:
                raise ValueError(f"out must be {x.shape[0]} contiguous float32 values")
            args = [*self._head, ptr(out), ffn.address, 0]
            self._calls[key] = (args, ffn)  # the record lives as long as its address is kept
            if len(self._calls) > 64:  # buffers of calls gone by: keep the latest
                self._calls = {key: self._calls[key]}
        # a sparse step: the record's threshold >= 0 says so, the kernel takes each chosen expert's
        ffn.threshold, args[-1] = (-1.0, 0) if thr is None else (0.0, thr.ctypes.data)
        n = _kernels.moe_token(*args)
        if self.shared is not None:  # its share of the shared expert (dense: no thresholds calibrated), scaled by the gate
            part = self.part[0]
            n += self.shared.token_into(x, activation, None, None, part)
            out += self._shared_scale(x[None])[0] * part
        return n

    def batch_into(self, x: np.ndarray, activation: str, active: np.ndarray | None, threshold,
                   out: np.ndarray) -> int:
        """A small batch (T, hidden), T <= MAX_SMALL_BATCH, into out (T, hidden), the tokens
        grouped by expert: each chosen expert's rows are read once for every token that chose it
        (ffn_batch gives each token what ffn_token gives it alone, at the expert's threshold),
        then each token's shares are summed in its own order of experts, as moe_token sums
        them: a row is what token_into gives, bit for bit (continuous batching must not change a
        reply)."""
        B, thr = len(x), per_expert(threshold, self._flat, active)
        if B == 1:
            return self.token_into(x[0], activation, None, threshold, out[0])
        xs = np.ascontiguousarray(x, dtype=np.float32)
        ids, weights = self.route(xs)
        self._read_ahead(np.unique(ids))
        parts = np.empty((B, self.k, xs.shape[1]), np.float32)
        n = 0
        for e in np.unique(ids):
            rows, slot = np.nonzero(ids == e)
            share = self.part[:len(rows)]
            n += self.experts[e].batch_into(np.ascontiguousarray(xs[rows]), activation, None,
                                            of_expert(thr, e), share)
            parts[rows, slot] = share
        out[:B] = 0.0
        for j in range(self.k):
            out[:B] += weights[:, j, None] * parts[:, j]
        if self.shared is not None:
            share = self.part[:B]
            n += self.shared.batch_into(xs, activation, None, None, share)
            out[:B] += self._shared_scale(xs)[:, None] * share
        return n

    def step(self, x: np.ndarray, activation: str, active: np.ndarray | None,
             threshold) -> tuple[np.ndarray, int]:
        """x (T, hidden) -> (this shard's partial output (T, hidden), active pairs): the tokens
        grouped by expert, each expert's tokens in one batched step (FileLayer.step) at its
        threshold (expert_thresholds.per_expert), weighted."""
        xs, thr = np.ascontiguousarray(x, dtype=np.float32), per_expert(threshold, self._flat, active)
        if len(xs) == 1:
            y = np.empty_like(xs)
            return y, self.token_into(xs[0], activation, None, threshold, y[0])
        ids, weights = self.route(xs)
        self._read_ahead(np.unique(ids))
        y, n = np.zeros_like(xs), 0
        for e in np.unique(ids):
            rows, slot = np.nonzero(ids == e)
            part, k = self.experts[e].step(xs[rows], activation, None, of_expert(thr, e))
            y[rows] += weights[rows, slot][:, None] * part
            n += k
        if self.shared is not None:
            part, k = self.shared.step(xs, activation, None, None)
            y += self._shared_scale(xs)[:, None] * part
            n += k
        return y, n


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
             cold: np.ndarray | None = None) -> "FfnShard":
        """Rows of `neurons[layer]` (global neuron indices) of every layer, and optionally the
        lm_head's vocabulary rows [start, stop). `store`: an open TensorStore of the same file.
        `predictor_path`: a file with blk.N.fc1/fc2 (the model itself or a predictor file):
        layers kept in the file's blocks score their own neurons with it (PredictorRows).
        weights "gguf": on the CPU, layers whose neurons are a 32-aligned range of types the
        kernels read stay in the file's blocks (FileLayer); others, and a CUDA device, are
        converted once (float32 on the CPU, float16 on a GPU). `row_layout`: with `fast`, which
        rows are interleaved (protocol.messages.ROW_LAYOUTS, FileLayer). `cold`: (n_layers, units)
        1 where a unit's (a layer's, an expert's) layouts stay mapped from the process's layout
        cache (layout_cache.active) instead of held in memory; None: all held."""
        if row_layout not in ROW_LAYOUTS:
            raise ValueError(f"interleaved rows {row_layout!r}: one of {ROW_LAYOUTS}")
        if store is None:
            store = TensorStore(model_path, open_gguf(model_path))
        cfg = read_config(model_path, store.reader)
        device_type = str(device).split(":")[0]  # a torch.device only where float copies are made
        layers: dict[int, LayerRows | FileLayer] = {}
        ranges = [as_range(np.asarray(idx, dtype=np.int64), FileLayer.align(store, layer))
                  for layer, idx in enumerate(neurons)]
        scratch = FfnScratch(cfg.hidden, max((len(r) for r in ranges if r is not None), default=0))
        for layer, idx in enumerate(neurons):
            if not len(idx):
                continue
            if cfg.routed:  # experts stay in the file's blocks (the engine refuses other formats for them)
                if not (device_type == "cpu" and FileLayer.fits(store, layer, ranges[layer])):
                    raise ValueError(f"layer {layer}: routed experts run on the file's blocks on the CPU, as a "
                                     f"{FileLayer.align(store, layer)}-aligned range of each expert's neurons")
                if cfg.expert_bias:  # gpt-oss: biases, its gating and clamped SwiGLU (sparsecore/oai_experts.py)
                    from .oai_experts import OaiExpertsLayer
                    layers[layer] = OaiExpertsLayer(store, layer, ranges[layer], fast, scratch, cfg, row_layout)
                else:
                    layers[layer] = ExpertsLayer(store, layer, ranges[layer], fast, scratch, cfg, row_layout,
                                                 None if cold is None else cold[layer])
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
        if isinstance(w, (FileLayer, ExpertsLayer)):
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
        if req.n_tokens == 1 and isinstance(w, (FileLayer, ExpertsLayer)):  # a decoded token: the kernel writes the slot
            n_active = w.token_into(buf.x[0], self.activation, active, threshold, buf.out[slot, 0])
            return n_active, int((time.perf_counter() - t0) * 1e9)
        if req.n_tokens <= MAX_SMALL_BATCH and isinstance(w, (FileLayer, ExpertsLayer)):  # sequences decoded together: the same
            n_active = w.batch_into(buf.x[:req.n_tokens], self.activation, active, threshold,
                                    buf.out[slot, :req.n_tokens])
            return n_active, int((time.perf_counter() - t0) * 1e9)
        if isinstance(w, (FileLayer, ExpertsLayer)):  # a prompt: numpy's GEMM or integer tiles, no torch
            y, n_active = w.step(buf.x[:req.n_tokens], self.activation, active, threshold)
            buf.out[slot, :req.n_tokens] = y
            return n_active, int((time.perf_counter() - t0) * 1e9)
        import torch

        x = torch.from_numpy(buf.x[:req.n_tokens]).to(self.device)
        y, n_active = self.step(req.layer, x, active, threshold)
        buf.out[slot, :req.n_tokens] = y.cpu().numpy()
        return n_active, int((time.perf_counter() - t0) * 1e9)
