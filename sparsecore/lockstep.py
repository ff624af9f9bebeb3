"""`Lockstep`: every layer of a decode step run by each process at once, with no round trip
through the coordinator between layers.

A layer split across processes is two all-reduces: each process computes its heads' share
of the attention output and its neurons' share of the FFN, and the layer needs the sum. In the
posted protocol (coordinator/runtime/attention_split.py, coordinator/runtime/sparse_ffn.py) the coordinator
sums the shares, adds the residual, normalizes and posts the next step, while every worker
waits: 30-40 us a layer of Python on the critical path (the 1.1B shape: 0.8 ms of a 19 ms
token). Here each process keeps its own copy of the residuals and, per phase:
  1. computes its share into its output slot and raises its phase word;
  2. waits for every other participant's phase word;
  3. adds all the shares to its residual (through the layer's output norm and residual scale
     where the architecture has them) and normalizes (_kernels.residual_norm).
In a parallel block (falcon: attention and FFN both read the layer's input) the FFN's input is
the norm of the residual before the attention phase: the exchange that ends the previous layer
(or the step's start, for layer 0) normalizes with this layer's FFN norm, the attention phase's
exchange adds the shares alone, and the FFN reads what the earlier one left (RMSNorm or
LayerNorm: the norm's bias says which).
Every process sums the same shares in the same order (ascending slots) with the same kernel,
so all hold the same floats, and the coordinator's copy is what the rest of the model sees.
Where the lm_head's vocabulary rows are split across the same processes, the step ends with one
more phase (`head`): the last exchange normalizes with the output norm, each process writes its
rows' logits into its slot and announces them, and the coordinator gathers them; a decoded token
is then one post for every layer and its logits.

Shares alternate between two halves of each slot (phase parity): a process writes phase k+2
only after it saw every peer reach k+1, and a peer reaches k+1 only after it read phase k, so
no share is overwritten while it is read. The phase word of slot s is slots[s, SLOT_PHASE] =
step * PHASE_STRIDE + k (k = 1 .. 2 * layers), increasing across steps; words are written after
the share they announce (x86-TSO, like every doorbell word: protocol/doorbell.py).

The step is used where every participant spins on a core of its own (the waits here are
spins); a process whose peer is gone or whose step was replaced stops through `check`.
"""
from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np

from protocol.doorbell import Request
from protocol.shm_layout import REQ_PARTS, SLOT_PHASE, SharedBuffers

from .config import ModelConfig
from .kernels import (MAX_SMALL_BATCH, AttentionStep, _kernels, ptr,
                      residual_norm_args)
from .kv_pool import KvPool
from .expert_thresholds import step_threshold
from .experts import ExpertsLayer
from .file_layer import FileLayer
from .tensors import TensorStore

NO_NORM = (0, 0)  # an exchange that normalizes nothing: (weights, bias) addresses
PHASE_STRIDE = 1 << 12  # phases per step: 2 per layer, so at most 2047 layers
CHECK_SPINS = 2048  # a waiting process calls `check` this often (a spin is about 0.1 us)
YIELD_AFTER_S = 0.002  # a wait this long means a peer lost its core: yield ours between checks
SLEEP_AFTER_S = 0.05  # and this long, that the peer stopped (Ctrl-C): sleep between checks


class Abandoned(Exception):
    """The step a process was computing is no longer wanted (the coordinator posted another, or
    stopped); the process drops it. Raised by `check`."""


class Lockstep:
    """One process's part of a lockstep decode step: query heads `heads` of every layer's attention
    (`attn`), its FFN neurons (`ffn[layer]`, a FileLayer) and the FFN norms; `slot` is its
    output slot. Which slots take part comes with each step (a bitmask: `run`, `serve`)."""

    def __init__(self, buffers: SharedBuffers, slot: int, attn: list[AttentionStep], heads: tuple[int, int],
                 ffn: dict, activation: str, ffn_norms: list[np.ndarray], eps: float, predict: dict | None = None,
                 post_ffn_norms: list[np.ndarray | None] | None = None, residual_scale: float | None = None,
                 head=None, out_norm: np.ndarray | None = None, norm_biases: list[np.ndarray | None] | None = None,
                 out_norm_bias: np.ndarray | None = None, parallel: bool = False):
        """post_ffn_norms: per layer the norm of the FFN's output before the residual (gemma3), or
        None; the attention's own (and the residual scale) come with its steps' extras. `head`:
        this process's lm_head rows (sparsecore.lm_head.HeadRows) and `out_norm` the model's
        output norm weights, where steps end with the logits (`head_fits`). norm_biases (per
        layer) and out_norm_bias: the FFN norms' and output norm's biases where they are
        LayerNorms (falcon). `parallel`: the FFN reads the layer's input (module doc)."""
        n_layers = len(attn)
        if set(ffn) != set(range(n_layers)) or len(ffn_norms) != n_layers:
            raise ValueError("a lockstep process needs a share of every layer's attention and FFN")
        self.buffers, self.slot, self.attn, self.heads, self.ffn = buffers, slot, attn, heads, ffn
        self.activation, self.eps, self.predict = activation, float(eps), predict or {}
        f32 = lambda a: None if a is None else np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
        self.norms = [f32(w) for w in ffn_norms]
        self.norm_biases = [f32(b) for b in (norm_biases or [None] * n_layers)]
        self.parallel = parallel
        hidden = buffers.layout.hidden
        self.half = min(MAX_SMALL_BATCH, buffers.layout.max_tokens // 2)  # rows of one phase parity
        self.h = np.empty((self.half, hidden), np.float32)  # this process's copy of the residuals
        self.x = np.empty((self.half, hidden), np.float32)  # the FFN's normed input
        # smallthinker: the layers' inputs, copied before the attention phase adds to them, which
        # their routers score (ExpertsLayer.router_reads_layer_input); None where no router does
        self.router_in = np.empty((self.half, hidden), np.float32) if any(
            isinstance(w, ExpertsLayer) and w.router_reads_layer_input for w in ffn.values()) else None
        out = buffers.out
        self.mine = [out[slot, p * self.half:(p + 1) * self.half] for p in (0, 1)]
        self.words = buffers.slots
        self._plans: dict[int, tuple[list[int], list[np.ndarray]]] = {}
        # One token's kernels' arguments, resolved once (the Python of a layer's checks and
        # addresses was 20-30 us of a 0.45 ms layer at 0.7 sparsity): the norms' addresses here
        # (weights, bias or 0), the FFN's and attention's per layer on first use (_one_token_args).
        self._ptrs = (ptr(self.h), ptr(self.x), [(ptr(w), 0 if b is None else ptr(b))
                                                 for w, b in zip(self.norms, self.norm_biases)])
        # What the exchanges apply to the summed shares before the residual, per layer: the
        # attention's output norm and the FFN's (addresses, 0: none), and the residual scale.
        self.post_ffn = [None if w is None else np.ascontiguousarray(w, dtype=np.float32)
                         for w in (post_ffn_norms or [None] * n_layers)]
        self.post = [(ptr(a.extra_arrays["post_norm"]) if "post_norm" in a.extra_arrays else 0,
                      0 if f is None else ptr(f)) for a, f in zip(attn, self.post_ffn)]
        self.scale = float(residual_scale or 0.0)
        self.head = head
        self.out_norm, self.out_norm_bias = f32(out_norm), f32(out_norm_bias)
        if head is not None and self.out_norm is None:
            raise ValueError("a lockstep part with lm_head rows needs the output norm")
        self._out_ptrs = NO_NORM if out_norm is None else (ptr(self.out_norm), 0 if out_norm_bias is None
                                                           else ptr(self.out_norm_bias))
        self._one: list[tuple | None] = [None] * n_layers
        # Dense layers the memory plan left on disk, where the disk's readahead is large: each
        # is read ahead as the layer before it starts (FileLayer.read_ahead), the first two as
        # the step starts. A routed layer's chosen experts are read once its token is routed.
        self.cold_reads = [ffn[i].read_ahead if isinstance(ffn[i], FileLayer) and ffn[i].reads_ahead else None
                           for i in range(n_layers)]
        self.reads_ahead = any(r is not None for r in self.cold_reads)

    def _read_ahead(self, i: int) -> None:
        """Layer i starts: the cold layer after it (and at the first layer, itself) is asked for."""
        for j in (0, 1) if i == 0 else (i + 1,):
            if j < len(self.cold_reads) and self.cold_reads[j] is not None:
                self.cold_reads[j]()

    def _plan(self, parts: int) -> tuple[list[int], list[np.ndarray]]:
        """For the participants' slot bitmask: the peers to wait for, and per parity the
        addresses of every participant's shares in ascending slot order (the summing order)."""
        plan = self._plans.get(parts)
        if plan is None:
            slots = [s for s in range(self.buffers.layout.n_slots) if parts >> s & 1]
            if self.slot not in slots:
                raise ValueError(f"a lockstep step of slots {slots} without this process's slot {self.slot}")
            out, h = self.buffers.out, self.half
            sums = [residual_norm_args([out[s, p * h:(p + 1) * h] for s in slots]) for p in (0, 1)]
            plan = self._plans[parts] = ([s for s in slots if s != self.slot], [(ptr(a), len(a)) for a in sums], sums)
        return plan

    def _one_token_args(self, i: int) -> tuple:
        """Layer i's prepared one-token calls: (its matrices and step head, the attention's
        arguments per phase parity and the index of their position address, the FFN's per
        parity), made again where a matrix or the step's head changed (twins attached)."""
        w, attn, (h0, h1) = self.ffn[i], self.attn[i], self.heads
        held = self._one[i]
        routed = isinstance(w, ExpertsLayer)  # its kernel calls depend on the token's experts: none kept
        key = (attn.head, attn.part_head) if routed else (w.gate, w.up, w.down, w.scratch, attn.head, attn.part_head)
        if held is None or any(a is not b for a, b in zip(held[0], key)):
            x1 = self.x[0]
            att = [attn.part_args(self.h[:1], h0, h1, self.mine[p][:1]) for p in (0, 1)]
            ffn = None if routed else [w.token_call(x1, self.activation, self.mine[p][0]) for p in (0, 1)]
            held = self._one[i] = (key, att, ffn)
        return held

    @classmethod
    def build(cls, buffers: SharedBuffers, slot: int, attn: list[AttentionStep] | None, heads: tuple[int, int],
              shard, store: TensorStore, cfg: ModelConfig) -> "Lockstep | None":
        """A process's part, or None when it cannot take one: it needs native attention heads and
        neurons of every layer left in the file's blocks (shard: an FfnShard)."""
        if (not attn or not cfg.native_attention
                or set(shard.layers) != set(range(cfg.n_layers))
                or not all(isinstance(w, (FileLayer, ExpertsLayer)) for w in shard.layers.values())
                or buffers.layout.max_tokens < 2):
            return None
        # a parallel block's FFN reads attn_norm (falcon 40B's attention its attn_norm_2)
        names = [f"blk.{i}.{'attn_norm' if cfg.parallel else 'ffn_norm'}" for i in range(cfg.n_layers)]
        bias = lambda name: store.matrix(name + ".bias") if store.has(name + ".bias") else None  # noqa: E731
        post = [store.matrix(f"blk.{i}.post_ffw_norm.weight") if cfg.post_norms else None for i in range(cfg.n_layers)]
        norms = [store.matrix(n + ".weight") for n in names]
        return cls(buffers, slot, attn, heads, shard.layers, shard.activation, norms, cfg.rms_eps, shard.predict,
                   post, cfg.residual_scale, shard.head, store.matrix("output_norm.weight"),
                   [bias(n) for n in names], bias("output_norm"), cfg.parallel)

    def fits(self, n_tokens: int) -> bool:
        return 1 <= n_tokens <= self.half

    def head_fits(self, n_tokens: int, rows: int | None = None) -> bool:
        """Whether a step of n_tokens ends with the logits of `rows` vocabulary rows (default:
        this process's) in one half of an output slot; the coordinator asks it of every part."""
        rows = (self.head.stop - self.head.start if self.head is not None else 0) if rows is None else rows
        return rows > 0 and n_tokens * rows <= self.half * self.h.shape[1]

    def head_share(self, n_tokens: int) -> np.ndarray:
        """Where a step of n_tokens leaves this process's logits: (n_tokens, rows), in its slot."""
        return self.head_share_of(self.mine[self.head_half], n_tokens, self.head.stop - self.head.start)

    @staticmethod
    def head_share_of(half: np.ndarray, n_tokens: int, rows: int) -> np.ndarray:
        """The logits a part left in `half` (of its output slot): (n_tokens, rows)."""
        return half.reshape(-1)[: n_tokens * rows].reshape(n_tokens, rows)

    @property
    def head_half(self) -> int:
        """Which half of an output slot a step's logits go to: the parity of its last phase."""
        return (2 * len(self.attn) + 1) & 1

    def run(self, step: int, parts: int, h: np.ndarray, pos: np.ndarray, kp: np.ndarray, vp: np.ndarray,
            layer_bytes: int, threshold: bool, predict: bool, check: Callable[[], None]) -> int:
        """The whole decode step for the B rows of h (B, hidden), the residuals entering layer 0,
        updated in place to those leaving the last layer, with the processes of bitmask `parts`
        (one bit per output slot, this one's included). pos, kp, vp: as for
        AttentionStep.part, for layer 0 (layer i adds i * layer_bytes). `threshold`: CATS
        thresholds from shared memory; `predict`: each process scores its own neurons (one
        token). Where head_fits, the step ends with this process's logits (head_share): a worker's
        are read once it has marked the step done. Returns the active neuron-token pairs this
        process computed."""
        B = len(h)
        if not self.fits(B) or (predict and B != 1):
            raise ValueError(f"a lockstep step of {B} tokens (at most {self.half}; predictors one at a time)")
        peers, sums, _ = self._plan(parts)
        self.h[:B] = h  # this process's copy of the residuals
        base = step * PHASE_STRIDE
        head = self.head_fits(B)
        last_norm = self._out_ptrs if head else NO_NORM  # the last exchange: the head's input
        if self.parallel:  # layer 0's FFN input: the norm of the step's residuals (module doc)
            self._norm_only(B, self._ptrs[2][0])
        if B == 1 and not predict:  # the decode step of one sequence: prepared calls
            n_active = self._run_one(base, peers, sums, h, pos, kp, vp, layer_bytes, threshold, check, last_norm)
        else:
            n_active = self._run_layers(base, peers, sums, h, pos, kp, vp, layer_bytes, threshold, predict, check,
                                        last_norm)
        if head:  # the last phase: this process's logits, written into the half no peer reads now
            self.head_share(B)[:] = self.head(self.x[:B]).reshape(B, -1)
            self.words[self.slot, SLOT_PHASE] = base + 2 * len(self.attn) + 1
        return n_active

    def _run_layers(self, base: int, peers: list[int], sums: list[tuple[int, int]], h: np.ndarray, pos: np.ndarray,
                    kp: np.ndarray, vp: np.ndarray, layer_bytes: int, threshold: bool, predict: bool,
                    check: Callable[[], None], last_norm: tuple[int, int]) -> int:
        """run's layers for any rows (a continuous batch, predictors)."""
        B = len(h)
        mine, hh, x = self.mine, self.h[:B], self.x[:B]
        n_active, phase = 0, 0
        for i, attn in enumerate(self.attn):
            if self.reads_ahead:
                self._read_ahead(i)
            phase += 1
            off = i * layer_bytes
            # a predictor reads the residual before the FFN norm: a parallel block's is the layer's input
            active = self.predict[i].mask_for(hh[0]) if predict and self.parallel else None
            w = self.ffn[i]
            routing = {}
            if self.router_in is not None and w.router_reads_layer_input:  # before the exchange adds to hh
                self.router_in[:B] = hh
                routing = {"router_x": self.router_in[0] if B == 1 else self.router_in[:B]}
            attn.part(hh, pos, kp + off, vp + off, *self.heads, mine[phase & 1][:B])
            self._exchange(base + phase, peers, sums[phase & 1], B, self._attn_norm(i), check, self.post[i][0])
            if predict and not self.parallel:
                active = self.predict[i].mask_for(hh[0])
            t = step_threshold(w, self.buffers, i) if threshold else None
            phase += 1
            if B == 1:
                n_active += w.token_into(x[0], self.activation, active, t, mine[phase & 1][0], **routing)
            else:
                n_active += w.batch_into(x, self.activation, active, t, mine[phase & 1][:B], **routing)
            self._exchange(base + phase, peers, sums[phase & 1], B, self._ffn_norm(i, last_norm), check,
                           self.post[i][1])
        h[:] = hh
        return n_active

    def _run_one(self, base: int, peers: list[int], sums: list[tuple[int, int]], h: np.ndarray, pos: np.ndarray,
                 kp: np.ndarray, vp: np.ndarray, layer_bytes: int, threshold: bool, check: Callable[[], None],
                 last_norm: tuple[int, int]) -> int:
        """run's steps for one row with every kernel's arguments prepared (_one_token_args):
        the same calls, the same floats."""
        n = len(self.attn)
        # every layer's position and cache addresses for this step at once (int64 each)
        addr = np.empty((n, 3), np.int64)
        addr[:, 0] = pos[0]
        offs = np.arange(n, dtype=np.int64) * layer_bytes
        addr[:, 1] = kp[0] + offs
        addr[:, 2] = vp[0] + offs
        a0 = ptr(addr)
        thresholds = self.buffers.thresholds
        n_active, phase = 0, 0
        for i in range(n):
            if self.reads_ahead:
                self._read_ahead(i)
            _, att, ffn = self._one_token_args(i)
            phase += 1
            args, k = att[phase & 1]
            args[k], args[k + 1], args[k + 2] = a0 + 24 * i, a0 + 24 * i + 8, a0 + 24 * i + 16
            routing = {}
            if ffn is None and self.router_in is not None and self.ffn[i].router_reads_layer_input:
                self.router_in[0] = self.h[0]  # the layer's input, before the exchange adds to it
                routing = {"router_x": self.router_in[0]}
            _kernels.attn_part(*args)
            self._exchange(base + phase, peers, sums[phase & 1], 1, self._attn_norm(i), check, self.post[i][0])
            phase += 1
            if ffn is None:  # routed experts: every process routes the token itself (ExpertsLayer)
                t = step_threshold(self.ffn[i], self.buffers, i) if threshold else None
                n_active += self.ffn[i].token_into(self.x[0], self.activation, None, t, self.mine[phase & 1][0],
                                                   **routing)
            else:
                call = ffn[phase & 1]
                call.threshold = float(thresholds[i]) if threshold else -1.0
                n_active += _kernels.ffn_token(call.address)
            self._exchange(base + phase, peers, sums[phase & 1], 1, self._ffn_norm(i, last_norm), check,
                           self.post[i][1])
        h[0] = self.h[0]
        return n_active

    def _attn_norm(self, i: int) -> tuple[int, int]:
        """The norm layer i's attention exchange applies: its FFN's, unless the FFN reads the
        layer's input (parallel: already in x)."""
        return NO_NORM if self.parallel else self._ptrs[2][i]

    def _ffn_norm(self, i: int, last_norm: tuple[int, int]) -> tuple[int, int]:
        """The norm layer i's FFN exchange applies: the head's input after the last layer
        (`last_norm`), else the next layer's FFN input where that is read before its attention."""
        if i == len(self.attn) - 1:
            return last_norm
        return self._ptrs[2][i + 1] if self.parallel else NO_NORM

    def _exchange(self, phase: int, peers: list[int], shares: tuple[int, int], B: int, norm: tuple[int, int],
                  check: Callable[[], None], post: int = 0) -> None:
        """Announce this process's share of `phase`, wait for every peer's, add them all (shares:
        the address and count of their addresses) to the residuals, through the output norm at
        address `post` and the residual scale where there are, and normalize them into self.x
        with the norm at `norm` (addresses of its weights and bias; NO_NORM: none)."""
        self.announce_and_wait(phase, peers, check)
        sh, n_sh = shares
        _kernels.residual_norm(self._ptrs[0], sh, n_sh, self.h.shape[1], B, *norm, self.eps, self._ptrs[1], post,
                               self.scale)

    def _norm_only(self, B: int, norm: tuple[int, int]) -> None:
        """self.x = the norm of the residuals alone (no shares): a parallel step's first FFN input."""
        _kernels.residual_norm(self._ptrs[0], 0, 0, self.h.shape[1], B, *norm, self.eps, self._ptrs[1], 0, 0.0)

    def announce_and_wait(self, phase: int, peers: list[int], check: Callable[[], None]) -> None:
        """Announce this process's share of `phase` and wait for every peer's."""
        words = self.words
        words[self.slot, SLOT_PHASE] = phase  # after the share: peers read it once they see this
        end = phase - phase % PHASE_STRIDE + PHASE_STRIDE  # the first phase of any later step
        for s in peers:
            if phase <= words[s, SLOT_PHASE] < end:
                continue
            n, t0 = 0, 0.0
            while words[s, SLOT_PHASE] < phase:
                n += 1
                if n % CHECK_SPINS == 0:
                    check()
                    now = time.perf_counter()
                    if not t0:
                        t0 = now
                    elif now - t0 > SLEEP_AFTER_S:
                        time.sleep(0.001)
                    elif now - t0 > YIELD_AFTER_S:
                        os.sched_yield()
            if words[s, SLOT_PHASE] >= end:  # the peer is in a later step: ours was dropped
                raise Abandoned(f"phase {phase}")


    def serve(self, req: Request, pool: KvPool, check: Callable[[], None]) -> tuple[int, int]:
        """A worker's part of the posted lockstep step `req`: the residuals are in x[:T], the
        (position, cache) of each row in seq[:T], the participants in request[REQ_PARTS].
        Returns (active neuron-token pairs, ns taken); raises Abandoned through `check`."""
        t0 = time.perf_counter()
        buf, B = self.buffers, req.n_tokens
        if not self.fits(B):
            raise ValueError(f"a lockstep step of {B} tokens, at most {self.half}")
        parts = int(buf.request[REQ_PARTS])
        pos, caches = buf.seq[:B, 0].copy(), buf.seq[:B, 1].copy()
        kp, vp = pool.addresses(0, caches)
        n = self.run(req.step, parts, buf.x[:B].copy(), pos, kp, vp, pool.shape.layer_bytes, req.threshold,
                     req.predict, check)
        return n, int((time.perf_counter() - t0) * 1e9)
