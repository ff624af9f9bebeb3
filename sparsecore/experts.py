"""A routed layer's share (sparsecore/arch.py FFN_KINDS): `ExpertsLayer`, the range of every
expert's neurons one process owns, each expert a FileLayer (sparsecore/file_layer.py), and
`route`, the routing every process computes alike (and `sparseinfer profile` counts). gpt-oss's
variant with biases and its own gating is sparsecore/oai_experts.py; sparsecore/shard.py holds a
process's layers of both kinds.
"""
from __future__ import annotations

import ctypes

import numpy as np

from .expert_thresholds import of_expert, per_expert
from .file_layer import FileLayer
from .kernels import (MAX_SMALL_BATCH, FfnScratch, FileMatrix, Mat, _kernels, ffn_batch_call, ffn_token_call,
                      mat_record, ptr)
from .kernels import layout_cache
from .tensors import TensorStore


# moe_step.c's routing flags, and where in them moe_token finds a dealt share (deal_flags)
MOE_RENORM, MOE_SIGMOID, MOE_ROUTED, MOE_SOFTMAX_WEIGHT = 1, 2, 4, 8
MOE_DEAL_SHIFT = 8
MAX_DEALERS = 255


def deal_flags(deal: tuple[int, int] | None) -> int:
    """moe_token's flags for a dealt share (ExpertsLayer `deal`): of each token's chosen experts
    that the process owns, every `dealers`-th from `phase`, in order of probability."""
    if deal is None:
        return 0
    phase, dealers = deal
    if not 0 <= phase < dealers <= MAX_DEALERS:
        raise ValueError(f"a dealt share is a phase in [0, dealers) of at most {MAX_DEALERS} dealers, got {deal}")
    return (phase << MOE_DEAL_SHIFT) | (dealers << (MOE_DEAL_SHIFT + 8))


def dealt(ids: np.ndarray, owned: np.ndarray, deal: tuple[int, int] | None) -> np.ndarray:
    """(T, k) bool: the token's choices `ids` (T, k) that a process owning `owned` (E,) computes
    with `deal` (None: every owned one): moe_token's rule, for the batch paths."""
    mine = owned[ids]
    if deal is None:
        return mine
    turn = np.cumsum(mine, axis=1) - 1  # each owned choice's place among the token's owned ones
    return mine & (turn % deal[1] == deal[0])


GATINGS = {"softmax": 0, "sigmoid": MOE_SIGMOID, "softmax_weight": MOE_SOFTMAX_WEIGHT}


def route_flags(renormalize: bool, gating: str = "softmax") -> int:
    """moe_route's flags for a model's routing (ModelConfig.expert_norm, .expert_gating):
    softmax, sigmoid, or softmax_weight (gpt-oss: the top k logits, then their softmax)."""
    if gating not in GATINGS:
        raise ValueError(f"the routing kernel computes {', '.join(GATINGS)} gating, not {gating!r}")
    return (MOE_RENORM if renormalize else 0) | GATINGS[gating]


def router_bias(store: TensorStore, layer: int, cfg) -> np.ndarray | None:
    """Layer `layer`'s router bias (gpt-oss: ModelConfig.expert_bias) as float32, else None."""
    if not cfg.expert_bias:
        return None
    return np.ascontiguousarray(store.matrix(f"blk.{layer}.ffn_gate_inp.bias").reshape(-1), dtype=np.float32)


def route(router: FileMatrix, x: np.ndarray, k: int, renormalize: bool,
          probs: np.ndarray | None = None, gating: str = "softmax",
          bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The k experts of each row of x (T, hidden) and their weights, (T, k) int32 and float32,
    by the kernel the token step routes with (moe_step.c moe_route): what a process computes,
    and what `sparseinfer profile` counts. router: ffn_gate_inp, one row per expert; x: what it
    scores (the FFN's input, or smallthinker's layer input); gating: route_flags'; bias: the
    router's (E float32, gpt-oss), or None."""
    T, E = len(x), router.rows
    xs = np.ascontiguousarray(x, dtype=np.float32)
    if xs.ndim != 2 or xs.shape[1] != router.cols or not 1 <= k <= E:
        raise ValueError(f"routing {xs.shape} inputs over {E} experts of width {router.cols}, top {k}")
    if bias is not None and (bias.dtype != np.float32 or bias.shape != (E,) or not bias.flags.c_contiguous):
        raise ValueError(f"a router bias is {E} contiguous float32 values")
    probs = np.empty(E, np.float32) if probs is None else probs
    ids, weights = np.empty((T, k), np.int32), np.empty((T, k), np.float32)
    flags = route_flags(renormalize, gating)
    for t in range(T):
        _kernels.moe_route(*router.args, 0 if bias is None else ptr(bias), ptr(xs[t]), xs.shape[1], E, k, flags,
                           ptr(probs), ptr(ids[t]), ptr(weights[t]))
    return ids, weights


def shared_scale(gate: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The shared expert's scale (qwen2moe), sigmoid(gate . x) per row of x (T, hidden): a float64
    dot a row, the same whatever the batch (a matrix product may sum in another order), in every
    process and on every device alike."""
    g64 = gate.astype(np.float64)
    g = np.array([np.dot(row, g64) for row in x.astype(np.float64)])
    return (1.0 / (1.0 + np.exp(-g))).astype(np.float32)


class ExpertsLayer:
    """One routed layer's owned neurons (sparsecore/arch.py FFN_KINDS): the range `own` of each
    owned expert's neurons (`owned`: every expert by default; under --vram-budget the GPU worker
    owns all of the most-routed experts and the other processes ranges of the rest), each expert
    a FileLayer over its slices of the stacked ffn_*_exps tensors, and the router. Every process
    routes each token itself, with the same native kernel on the same FFN input (so all choose
    the same experts: no routing crosses the wire), and computes its share of the chosen experts
    it owns, each times its weight:
        y = sum over the token's k experts e, owned, of w_e * down_e[:, own] (act(gate_e[own] x) * up_e[own] x)
    Routing as llama.cpp's build_moe_ffn: softmax (or sigmoid: smallthinker's file may say) of
    router . x, the top k (ties to the lower index), renormalized to sum 1 where the architecture
    says (qwen3moe). smallthinker's router scores the layer's input instead of x (`router_x` of
    the steps, which the caller must then pass: x cannot stand in for it).
    `counts` (E int64) counts the chosen experts computed here, token by token: the measured
    routed share (count_into points it at the process's row of shared memory).
    Dealt (`deal` = (phase, dealers)): the process holds its owned experts whole and computes,
    of each token's chosen experts it owns, every dealers-th from `phase` in order of probability
    (the other processes the rest): each of two processes computes 4 of a token's 8 experts
    whole, where ranges of K-quant experts (768 neurons, cut on blocks of 256) gave one 2/3 of
    every expert. The engine deals where the processes' layouts are mapped from the same layout
    cache files (one copy in memory for all); `own` then still splits the shared expert."""

    def __init__(self, store: TensorStore, layer: int, own: range, fast: bool, scratch: FfnScratch, cfg,
                 row_layout: str = "", cold: np.ndarray | None = None, owned: np.ndarray | None = None,
                 with_shared: bool = True, deal: tuple[int, int] | None = None):
        """`owned`: (E,) bool, the experts this process holds the range `own` of (None: all);
        `with_shared`: it holds the same multiple of that range of the shared expert (qwen2moe);
        `deal`: (phase, dealers), it holds its owned experts whole and computes its dealt share
        of each token's (None: the range `own` of each)."""
        self.router = FileMatrix(store.info(f"blk.{layer}.ffn_gate_inp.weight"))
        if self.router.rows != cfg.n_experts:
            raise ValueError(f"blk.{layer}.ffn_gate_inp.weight scores {self.router.rows} experts, the file says "
                             f"{cfg.n_experts}")
        self.k, self.renormalize, self.gating = cfg.n_experts_used, cfg.expert_norm, cfg.expert_gating
        self.router_reads_layer_input = cfg.router_reads_layer_input
        self.router_bias = router_bias(store, layer, cfg)  # gpt-oss's, else None
        self._bias_ptr = 0 if self.router_bias is None else ptr(self.router_bias)  # the kernels' argument
        # moe_route's and moe_token's flags (MOE_ROUTED added below where token_into routes first)
        self.flags = route_flags(self.renormalize, self.gating)
        self.owned = np.ones(cfg.n_experts, bool) if owned is None else np.asarray(owned, bool)
        if self.owned.shape != (cfg.n_experts,):
            raise ValueError(f"layer {layer}: an ownership of {self.owned.shape} experts, the file has {cfg.n_experts}")
        self.counts = np.zeros(cfg.n_experts, np.int64)
        self.deal = deal
        self.flags |= deal_flags(deal)
        routed = range(0, cfg.n_ff) if deal is not None else own  # each owned expert's neurons held here
        if deal is not None and scratch.n_own < cfg.n_ff:  # a caller's scratch for a range (FfnShard sizes its own)
            scratch = FfnScratch(self.router.cols, cfg.n_ff)
        self.experts: list[FileLayer | None] = [None] * cfg.n_experts  # None: an expert another process computes
        # Dealt processes convert the same layouts: each starts at its own part of the experts, so
        # that on a first start each makes its part and reads the others' from the cache.
        first = 0 if deal is None else deal[0] * cfg.n_experts // deal[1]
        for e in np.roll(np.arange(cfg.n_experts), -first):
            if self.owned[e]:
                with layout_cache.placing(cold is None or not cold[e]):
                    self.experts[e] = FileLayer(store, layer, routed, fast, scratch, cfg.ffn_gate, row_layout,
                                                expert=int(e))
        # cold experts' layouts stay mapped from the layout cache: read ahead, per expert, once a
        # token has chosen them (token_into)
        self.cold_maps = {e: f.cold_maps for e, f in enumerate(self.experts) if f is not None and f.cold_maps}
        # token_into routes a token itself, into the arrays moe_token reads, which then runs the
        # experts chosen (MOE_ROUTED): where the router reads the layer's input, and where
        # chosen cold experts are read ahead before any of them is computed (routed once)
        self.routes_first = self.router_reads_layer_input or bool(self.cold_maps)
        if self.routes_first:
            self.flags |= MOE_ROUTED
        self.own, self.idx, self.gate_mode = routed, np.arange(routed.start, routed.stop), cfg.ffn_gate
        self.part = np.empty((MAX_SMALL_BATCH, self.router.cols), np.float32)  # one expert's share
        self.probs = np.empty(cfg.n_experts, np.float32)
        self._flat = np.empty(cfg.n_experts, np.float32)  # one threshold for every expert (per_expert)
        # The shared expert (qwen2moe): the same multiple of this range of its neurons, every token,
        # times sigmoid(gate . x), which each process computes alike and applies to its own share.
        self.shared = self.shared_gate = None
        if cfg.n_ff_shared and with_shared:  # split by the range `own`, dealt or not
            m = cfg.n_ff_shared // cfg.n_ff
            own_shared = range(m * own.start, m * own.stop)
            self.shared = FileLayer(store, layer, own_shared, fast, FfnScratch(self.router.cols, len(own_shared)),
                                    cfg.ffn_gate, row_layout, shared=True)
            self.shared_gate = np.ascontiguousarray(
                store.matrix(f"blk.{layer}.ffn_gate_inp_shexp.weight").reshape(-1), dtype=np.float32)
        self.ids, self.weights = np.empty(self.k, np.int32), np.empty(self.k, np.float32)
        # an owned expert (any: they share shapes and types; its record sets up the token step), or
        # None where the process holds only a share of the shared expert here
        self.first: FileLayer | None = next((e for e in self.experts if e is not None), None)
        self._tabulate()

    def _tabulate(self) -> None:
        """Every expert's gate, up and down as mat records, looked up by the native token step;
        an expert owned elsewhere has empty records, which the step skips."""
        records = []
        for e in self.experts:
            records += [Mat(), Mat(), Mat()] if e is None else [mat_record(m) for m in (e.gate, e.up, e.down)]
        self.table = (Mat * len(records))(*records)
        self._head = (ctypes.addressof(self.table), len(self.experts), self.k, self.flags, *self.router.args,
                      self._bias_ptr, ptr(self.probs), ptr(self.ids), ptr(self.weights))
        self._calls: dict[tuple[int, int], tuple] = {}  # (x, out) addresses -> the call's arguments, its record
        self._batch: tuple | None = None  # batch_into's record and buffers, made on the first batch

    def _biased(self, ffn):
        """The FFN record the native steps read, given what its activation reads besides the
        matrices (gpt-oss's biases: OaiExpertsLayer); here nothing: the record itself."""
        return ffn

    def count_into(self, counts: np.ndarray) -> None:
        """Count the chosen experts computed here into `counts` (E int64, this process's row of
        shared memory for this layer: the coordinator reads every process's) from now on."""
        if counts.shape != self.counts.shape or counts.dtype != np.int64 or not counts.flags.c_contiguous:
            raise ValueError(f"route counts {counts.shape} {counts.dtype}: {len(self.counts)} contiguous int64")
        self.counts = counts
        self._calls, self._batch = {}, None  # the steps' arguments hold the counts' address

    def add_twins(self, add) -> None:
        """Each expert's twins as its FileLayer makes them (sparsecore/input_sparsity.py): with
        CATS ("down") a down twin over the owned neurons, so that a chosen expert's skipped
        neuron skips its whole down row as a dense layer's does (down's file rows hold 32
        neurons a block: at 50 % of neurons active nearly every block has one)."""
        for e in self.experts:
            if e is not None:
                e.add_twins(add)
        self._tabulate()

    @property
    def nbytes(self) -> int:
        """Bytes of the file a token reads here at most: k owned experts' rows (dealt: its
        share of them), the shared expert's and the router."""
        shared = 0 if self.shared is None else self.shared.nbytes
        one = 0 if self.first is None else self.first.nbytes
        n = min(self.k, int(self.owned.sum()))
        if self.deal is not None:
            n = -(-n // self.deal[1])
        return n * one + shared + self.router.rows * self.router.row_bytes

    def _read_ahead(self, ids: np.ndarray) -> None:
        """Start reading the chosen experts that are mapped from disk (all of them, then compute):
        one fault at a time would read them one after the other, a token's few hundred KB each."""
        for e in ids:
            maps = self.cold_maps.get(int(e))
            if maps:
                layout_cache.read_ahead(maps)

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The experts of each row of x (T, hidden), the rows the router scores, and their
        weights: (T, k) int32, (T, k) float32."""
        return route(self.router, x, self.k, self.renormalize, self.probs, self.gating, self.router_bias)

    def _scored(self, x: np.ndarray, router_x: np.ndarray | None) -> np.ndarray:
        """What the router scores for the FFN inputs x: x, or the layer's inputs router_x
        (smallthinker), which must then be given."""
        if not self.router_reads_layer_input:
            return x
        if router_x is None or router_x.shape != x.shape:
            raise ValueError(f"this router scores the layer's input: {x.shape} FFN inputs need as many layer inputs, "
                             f"got {None if router_x is None else router_x.shape}")
        return np.ascontiguousarray(router_x, dtype=np.float32)

    def token_into(self, x: np.ndarray, activation: str, active: np.ndarray | None, threshold,
                   out: np.ndarray, router_x: np.ndarray | None = None) -> int:
        """One token into `out` (hidden,): the weighted sum of its experts' shares, each chosen
        expert dense or, with `threshold` (expert_thresholds.per_expert), at its own threshold.
        router_x: the token's layer input, where the router scores that (smallthinker)."""
        thr = per_expert(threshold, self._flat, active)
        if self.routes_first:  # into the arrays moe_token reads (MOE_ROUTED)
            rx = self._scored(x, router_x)
            _kernels.moe_route(*self.router.args, self._bias_ptr, ptr(rx), len(rx), len(self.experts), self.k,
                               self.flags, ptr(self.probs), ptr(self.ids), ptr(self.weights))
            if self.cold_maps:  # every chosen cold expert's reads start together
                self._read_ahead(self.ids)
        key = (x.ctypes.data, out.ctypes.data)
        args, ffn = self._calls.get(key, (None, None))
        if args is None:  # checked and resolved once per pair of buffers (a slot, lockstep's rows)
            e = self.first
            if e is None:  # no routed expert here, only a share of the shared one: nothing to route
                return self._shared_only(x, activation, out)
            ffn = self._biased(ffn_token_call(e.gate, e.up, e.down, x, self.own, activation, e.scratch, e.fast, False,
                                              self.part[0], self.gate_mode))
            if out.dtype != np.float32 or out.shape != x.shape or not out.flags.c_contiguous:
                raise ValueError(f"out must be {x.shape[0]} contiguous float32 values")
            args = [*self._head, 0, ptr(self.counts), ffn.address, ptr(out)]  # moe_token's, thresholds at [-4]
            self._calls[key] = (args, ffn)  # the record lives as long as its address is kept
            if len(self._calls) > 64:  # buffers of calls gone by: keep the latest
                self._calls = {key: self._calls[key]}
        # a sparse step: the record's threshold >= 0 says so, the kernel takes each chosen expert's
        ffn.threshold, args[-4] = (-1.0, 0) if thr is None else (0.0, thr.ctypes.data)
        n = _kernels.moe_token(*args)
        if self.shared is not None:  # its share of the shared expert (dense: no thresholds calibrated), scaled by the gate
            part = self.part[0]
            n += self.shared.token_into(x, activation, None, None, part)
            out += shared_scale(self.shared_gate, x[None])[0] * part
        return n

    def _shared_only(self, x: np.ndarray, activation: str, out: np.ndarray) -> int:
        """token_into where this process owns no routed expert of the layer, only a share of
        its shared expert."""
        out[:] = 0.0
        part = self.part[0]
        n = self.shared.token_into(x, activation, None, None, part)
        out += shared_scale(self.shared_gate, x[None])[0] * part
        return n

    def _count(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the distinct experts of `ids` (T, k) this process computes for some token, (T, k)
        bool: which choices it computes), those choices counted."""
        pick = dealt(ids, self.owned, self.deal)
        self.counts += np.bincount(ids[pick], minlength=len(self.counts))
        return np.unique(ids[pick]), pick

    def _batch_args(self, activation: str) -> tuple[list, object, np.ndarray, np.ndarray]:
        """moe_batch's arguments (its flags, thresholds, x, token count and out set per call), its
        batch record, and the (MAX_SMALL_BATCH, k) ids and weights it routes into: made once."""
        if self._batch is None or self._batch[0] != activation:
            e, hidden = self.first, self.router.cols
            xg, yg = (np.empty((MAX_SMALL_BATCH, hidden), np.float32) for _ in range(2))
            ffn = ffn_batch_call(e.gate, e.up, e.down, xg, self.own, activation, e.scratch, e.fast, yg,
                                 self.gate_mode)
            ids, weights = np.empty((MAX_SMALL_BATCH, self.k), np.int32), np.empty((MAX_SMALL_BATCH, self.k), np.float32)
            parts = np.empty((MAX_SMALL_BATCH, self.k, hidden), np.float32)
            self._biased(ffn)
            args = [ctypes.addressof(self.table), len(self.experts), self.k, self.flags, *self.router.args,
                    self._bias_ptr, ptr(self.probs), ptr(ids), ptr(weights), 0, ptr(self.counts), ffn.address, 0, 0,
                    ptr(xg), ptr(yg), ptr(parts), 0]
            self._batch = (activation, args, ffn, ids, weights, (xg, yg, parts))
        return self._batch[1:5]

    def batch_into(self, x: np.ndarray, activation: str, active: np.ndarray | None, threshold,
                   out: np.ndarray, router_x: np.ndarray | None = None) -> int:
        """A small batch (T, hidden), T <= MAX_SMALL_BATCH, into out (T, hidden), in one native
        call (moe_step.c moe_batch), the tokens grouped by expert: each chosen expert's rows are
        read once for every token that chose it (ffn_batch gives each token what ffn_token gives
        it alone, at the expert's threshold), then each token's shares are summed in its own
        order of experts, as moe_token sums them: a row is what token_into gives, bit for bit
        (continuous batching must not change a reply). Before, a Python loop called ffn_batch per
        chosen expert: 4 sequences on a layer of the 30B-A3B shape (Q4_0, dealt half, one core)
        took 3.35 ms that way, 2.71 ms in the one call (2.73 ms token by token).
        router_x: the layer's inputs (B, hidden) where the router scores them."""
        B, thr = len(x), per_expert(threshold, self._flat, active)
        if B == 1:
            return self.token_into(x[0], activation, None, threshold, out[0],
                                   None if router_x is None else router_x[0])
        xs = np.ascontiguousarray(x, dtype=np.float32)
        if self.first is None:  # only a share of the shared expert here
            out[:B] = 0.0
            n = 0
        else:  # one native call (moe_step.c moe_batch): routing, grouping, each expert's tokens, the sums
            args, ffn, ids, weights = self._batch_args(activation)
            if self.routes_first:  # routed here first: the router's own input, or cold experts read ahead
                ids[:B], weights[:B] = self.route(self._scored(xs, router_x))
                self._read_ahead(np.unique(ids[:B][dealt(ids[:B], self.owned, self.deal)]))
            if out.dtype != np.float32 or out.shape[1:] != xs.shape[1:] or len(out) < B or not out.flags.c_contiguous:
                raise ValueError(f"out must hold {B} contiguous float32 rows of {xs.shape[1]}")
            ffn.threshold = -1.0 if thr is None else 0.0
            args[-9], args[-6], args[-5], args[-1] = 0 if thr is None else thr.ctypes.data, ptr(xs), B, ptr(out)
            n = _kernels.moe_batch(*args)
        if self.shared is not None:
            share = self.part[:B]
            n += self.shared.batch_into(xs, activation, None, None, share)
            out[:B] += shared_scale(self.shared_gate, xs)[:, None] * share
        return n

    def step(self, x: np.ndarray, activation: str, active: np.ndarray | None,
             threshold, router_x: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """x (T, hidden) -> (this shard's partial output (T, hidden), active pairs): the tokens
        grouped by expert, each expert's tokens in one batched step (FileLayer.step) at its
        threshold (expert_thresholds.per_expert), weighted. router_x: as batch_into's."""
        xs, thr = np.ascontiguousarray(x, dtype=np.float32), per_expert(threshold, self._flat, active)
        if len(xs) == 1:
            y = np.empty_like(xs)
            return y, self.token_into(xs[0], activation, None, threshold, y[0],
                                      None if router_x is None else router_x[0])
        ids, weights = self.route(self._scored(xs, router_x))
        mine, pick = self._count(ids)
        self._read_ahead(mine)
        y, n = np.zeros_like(xs), 0
        for e in mine:
            rows, slot = np.nonzero((ids == e) & pick)
            part, k = self.experts[e].step(xs[rows], activation, None, of_expert(thr, e))
            y[rows] += weights[rows, slot][:, None] * part
            n += k
        if self.shared is not None:
            part, k = self.shared.step(xs, activation, None, None)
            y += shared_scale(self.shared_gate, xs)[:, None] * part
            n += k
        return y, n
