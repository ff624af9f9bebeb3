"""THE per-layer FFN step, and the lm_head split: the coordinator's side of the exchange.

Per layer (`SparseFfn.__call__`, called by the model with the normed FFN input):
  1. mode: dense, thresholds (CATS, applied by whoever holds the gate rows), or a predictor's
     active set (written into the shared mask);
  2. x goes into shared memory and the doorbell rings (`exchange` -> CoordinatorBell.post);
  3. the coordinator computes its own share (an FfnShard, on CPU-only machines) meanwhile;
  4. it waits for the workers that own neurons of the layer (CoordinatorBell.wait);
  5. it sums the output slots.
`SplitHead` does the same for one token's lm_head when its vocabulary rows are split across
the processes (CPU-only machines): each computes its rows' logits, side by side they are the
whole head's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from protocol.doorbell import CoordinatorBell
from protocol.shm_layout import SharedBuffers, StepKind
from sparsecore.kernels import MAX_SMALL_BATCH
from sparsecore.shard import FfnShard
from sparsecore.tensors import TensorStore

from .posted_step import run_posted, sum_slots
from .worker_pool import WorkerPool

if TYPE_CHECKING:  # coordinator/model/predictor.py imports torch: only a run with predictors loads it
    from ..model.predictor import Predictors

# observer(layer, FFN input after ffn_norm (T, hidden), residual before it (T, hidden)[, the
# router's input (T, hidden): only where the router scores the layer's input, smallthinker]):
# calibration and profiling watch every FFN input through it (coordinator/tools/).
Observer = Callable[..., None]


@dataclass
class ExchangeStats:
    round_trip_us: list[float] = field(default_factory=list)
    overhead_us: list[float] = field(default_factory=list)  # round trip minus slowest process's compute
    active: dict[int, int] = field(default_factory=dict)  # layer -> (neuron, token) pairs computed
    tokens: dict[int, int] = field(default_factory=dict)  # layer -> tokens through that layer
    head_us: list[float] = field(default_factory=list)  # lm_head steps split across processes
    attn_us: list[float] = field(default_factory=list)  # attention steps split across processes
    lockstep_us: list[float] = field(default_factory=list)  # whole decode steps in lockstep (every layer)

    def clear_counts(self) -> None:
        self.active.clear()
        self.tokens.clear()

    def trim(self, keep: int = 50_000) -> None:
        """Forget all but the last `keep` timings of each kind: a server decodes for days, and
        these lists grow by one entry per layer and token. (Offline tools measure bounded runs
        by list index and never call this.)"""
        for timings in (self.round_trip_us, self.overhead_us, self.head_us, self.attn_us, self.lockstep_us):
            if len(timings) > 2 * keep:
                del timings[:-keep]


class SparseFfn:
    """The FFN of every layer, computed by the workers' shards and the coordinator's own.

    `own`: the coordinator's shard (None: it computes none) and `own_slot` its output slot.
    `participants[layer]`: the worker slots that own neurons of the layer; only they get the step."""

    def __init__(self, bell: CoordinatorBell, buffers: SharedBuffers, worker_neurons: list[list[np.ndarray]],
                 own: FfnShard | None = None, own_slot: int | None = None, predictors: Predictors | None = None):
        self.bell, self.buffers, self.own, self.own_slot = bell, buffers, own, own_slot
        self.predictors = predictors
        self.max_tokens = buffers.layout.max_tokens
        n_layers = buffers.layout.n_layers
        self.participants = [np.array([s for s, per_layer in enumerate(worker_neurons) if len(per_layer[layer])],
                                      dtype=np.intp) for layer in range(n_layers)]
        self.sum_slots = [p if own is None or layer not in own.layers else np.append(p, own_slot)
                          for layer, p in enumerate(self.participants)]
        self.stats = ExchangeStats()
        self.observer: Observer | None = None
        self.thresholds: bool = False  # CATS thresholds (in shared memory) apply to decoded tokens
        self.sparse_batches = False  # perplexity: apply thresholds/predictors to multi-token batches too
        # The predictors every process with neurons scores its own with (use_shard_predictors):
        # while they are self.predictors, a token's step carries its pre-norm residual, no mask.
        self.shard_predictors: Predictors | None = None

    @classmethod
    def over(cls, pool: WorkerPool, store: TensorStore | None = None, predictors: Predictors | None = None,
             weights: str = "f32", fast: bool = False) -> "SparseFfn":
        """The FFN over `pool`'s workers, with the coordinator's own shard (and its lm_head rows)
        loaded here when the plan gives it one. `store`: the model file, already open."""
        slot = pool.own_slot
        own = None if slot is None else FfnShard.load(pool.model_path, pool.plan.shards[slot].neurons, "cpu",
                                                      weights, pool.head_rows.get(slot), store, fast,
                                                      pool.predictor_path or None, pool.row_layout,
                                                      pool.cold_units, pool.plan.shards[slot].experts,
                                                      pool.deal.get(slot))
        if own is not None and pool.buffers.layout.n_experts:  # counted where the workers' counts are
            own.count_routes_into(pool.buffers.route_counts[slot])
        return cls(pool.bell, pool.buffers, [sh.neurons for sh in pool.proc_shards], own, slot, predictors)

    def use_shard_predictors(self, workers_predict: bool) -> None:
        """After the workers are ready: when every process that owns neurons loaded the
        predictors' rows (workers_predict: every worker with neurons said so in Ready), they
        score their own neurons in parallel instead of the coordinator scoring all of them."""
        own_ok = self.own is None or not self.own.layers or self.own.predicts
        room = self.max_tokens >= 2  # the pre-norm residual goes in x[1]
        self.shard_predictors = self.predictors if workers_predict and own_ok and room else None

    def set_thresholds(self, per_layer: list[float] | None) -> None:
        """Use these per-layer thresholds from now on (None: dense)."""
        if per_layer is not None:
            self.buffers.thresholds[:] = per_layer
        self.thresholds = per_layer is not None

    def __call__(self, layer: int, xs: np.ndarray, pre_norm: np.ndarray, decode: bool | None = None,
                 router_in: np.ndarray | None = None) -> np.ndarray:
        """The FFN output of `layer` for xs (T, hidden), the normed input, a new array;
        `pre_norm` is the residual before ffn_norm, which PowerInfer's predictors read.
        `decode`: the rows are decoded tokens of several sequences (None: one row is, several
        are a prompt). `router_in`: the layer's inputs (T, hidden) where the router scores them
        (smallthinker): a step of n tokens carries them in x[n:2n], after the FFN's inputs."""
        if self.observer is not None:
            self.observer(layer, xs, pre_norm, *(() if router_in is None else (router_in,)))
        # Decoding is sparse when thresholds or predictors are set (each token its own active
        # set); prefill stays dense (a long prompt's tokens together activate nearly every
        # neuron) unless perplexity asks otherwise.
        sparse = (len(xs) == 1 if decode is None else decode) or self.sparse_batches
        if self.predictors is not None and sparse:
            return self._predicted(layer, xs, pre_norm)
        threshold = self.thresholds and sparse
        per_step = self.max_tokens if router_in is None else self.max_tokens // 2
        if len(xs) <= per_step:  # one exchange (every decoded token): no chunking, no extra copy
            self._write_inputs(xs, router_in)
            return self.exchange(layer, len(xs), threshold=threshold)
        out = np.empty_like(xs)
        for a in range(0, len(xs), per_step):
            n = min(per_step, len(xs) - a)
            self._write_inputs(xs[a:a + n], None if router_in is None else router_in[a:a + n])
            out[a:a + n] = self.exchange(layer, n, threshold=threshold)
        return out

    def _write_inputs(self, xs: np.ndarray, router_in: np.ndarray | None) -> None:
        """A step's FFN inputs into x[:n] and, where given, the router's into x[n:2n]."""
        n = len(xs)
        self.buffers.x[:n] = xs
        if router_in is not None:
            self.buffers.x[n:2 * n] = router_in

    def _predicted(self, layer: int, xs: np.ndarray, pre_norm: np.ndarray) -> np.ndarray:
        """One exchange per token: the shared mask holds one active set per step; or each
        process scores its own neurons from the token's pre-norm residual (x[1])."""
        out = np.empty_like(xs)
        if self.predictors is self.shard_predictors:
            for t in range(len(xs)):
                self.buffers.x[0], self.buffers.x[1] = xs[t], pre_norm[t]
                out[t:t + 1] = self.exchange(layer, 1, dense=False, predict=True)
            return out
        masks = self.predictors.masks(layer, pre_norm)
        for t in range(len(xs)):
            self.buffers.x[:1] = xs[t:t + 1]
            self.buffers.mask[:] = masks[t]
            out[t:t + 1] = self.exchange(layer, 1, dense=False)
        return out

    def exchange(self, layer: int, n_tokens: int, dense: bool = True, threshold: bool = False,
                 predict: bool = False) -> np.ndarray:
        """x[:n_tokens] (and the mask or thresholds) are in shared memory: run the step on every
        process that owns neurons of `layer` and return the summed output (n_tokens, hidden)."""
        if not 1 <= n_tokens <= self.max_tokens:
            raise ValueError(f"n_tokens {n_tokens} outside 1..{self.max_tokens}")
        t0 = time.perf_counter()
        buf, part = self.buffers, self.participants[layer]
        own = None
        if self.own is not None and layer in self.own.layers:  # our neurons while the workers compute theirs
            own = lambda posted: self.own.serve(buf, self.own_slot, posted)  # noqa: E731
        step = run_posted(self.bell, StepKind.FFN, layer, n_tokens, part, own, dense, threshold, predict)
        (n_own, own_ns), n_active, slowest_ns = step.own or (0, 0), step.n_active, step.slowest_ns
        st = self.stats
        st.active[layer] = st.active.get(layer, 0) + n_active + n_own
        st.tokens[layer] = st.tokens.get(layer, 0) + n_tokens
        rt = (time.perf_counter() - t0) * 1e6
        st.round_trip_us.append(rt)
        st.overhead_us.append(rt - max(slowest_ns, own_ns) / 1e3)
        return sum_slots(buf.out, self.sum_slots[layer], n_tokens)


class SplitHead:
    """Logits of decoded tokens whose lm_head rows are split: `rows[slot]` = [start, stop) for
    each worker slot; the coordinator's own shard holds the last rows (own.head). Several
    tokens (a continuous batch) go in posts of as many as the workers' output slots hold."""

    def __init__(self, bell: CoordinatorBell, buffers: SharedBuffers, own: FfnShard, own_slot: int,
                 rows: dict[int, tuple[int, int]], stats: ExchangeStats):
        self.bell, self.buffers, self.own, self.own_slot, self.stats = bell, buffers, own, own_slot, stats
        self.rows = {s: r for s, r in rows.items() if s != own_slot}
        self.part = np.array(sorted(self.rows), dtype=np.intp)
        widest = max((b - a for a, b in self.rows.values()), default=1)
        self.per_post = max(1, min(MAX_SMALL_BATCH, buffers.out[0].size // widest, buffers.layout.max_tokens))

    @classmethod
    def over(cls, pool: WorkerPool, ffn: SparseFfn) -> "SplitHead | None":
        """The split head of `pool`'s plan, or None when the coordinator computes the whole head."""
        if not pool.head_rows or ffn.own is None or ffn.own.head is None:
            return None
        return cls(pool.bell, pool.buffers, ffn.own, ffn.own_slot, pool.head_rows, ffn.stats)

    def __call__(self, hs: np.ndarray) -> np.ndarray:
        """hs: (T, hidden), the final normed hidden states -> (T, n_vocab) logits."""
        t0 = time.perf_counter()
        buf, head = self.buffers, self.own.head
        logits = np.empty((len(hs), head.stop), np.float32)  # the coordinator's rows end the vocabulary
        for a in range(0, len(hs), self.per_post):
            n = min(self.per_post, len(hs) - a)
            buf.x[:n] = hs[a:a + n]
            mine = run_posted(self.bell, StepKind.HEAD, 0, n, self.part, lambda posted: head(buf.x[:n])).own
            logits[a:a + n, head.start:] = mine.reshape(n, -1)
            for slot, (lo, hi) in self.rows.items():
                logits[a:a + n, lo:hi] = buf.out[slot].reshape(-1)[: n * (hi - lo)].reshape(n, hi - lo)
        self.stats.head_us.append((time.perf_counter() - t0) * 1e6)
        return logits
