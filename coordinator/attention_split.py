"""THE per-layer attention step of decoded tokens when their heads are split across processes:
the coordinator's side of the exchange (the workers' side: sparsecore/attn_shard.py).

Per layer (`SplitAttention.__call__`, called by the model for one decoded token or a continuous
batch of them, whose KV caches are in the shared pool):
  1. the residuals go into shared memory with each sequence's (position, cache), the doorbell
     rings (a StepKind.ATTENTION step);
  2. the coordinator computes its own KV heads' share meanwhile (the same kernel, _kernels.attn_part);
  3. it waits for the workers that hold the other heads;
  4. the residual plus the shares is the layer's attention output.
Each process reads only its heads' rows of Q, K, V and columns of the output matrix: a decoded
token's attention weights are read once across the cores instead of by the coordinator alone.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from protocol.doorbell import CoordinatorBell
from protocol.shm_layout import SharedBuffers, StepKind
from sparsecore.kernels import MAX_SMALL_BATCH, AttentionStep
from sparsecore.kv_pool import KvPool

from .sparse_ffn import ExchangeStats


# An attention step split across processes costs one more exchange a layer (a doorbell round
# trip and some Python, 20-40 us); it pays when the work it halves is larger: the layer's
# attention weights plus the keys and values the step reads. Measured on a 2-core EPYC with the
# vectorized attention kernel (paired in-process runs, fast arithmetic): SmolLM2 (0.55 MB of
# weights a layer) one sequence 0.95x at 8 positions, 0.97-0.99x at 128-256, 1.00x at 1024
# (2.1 MB with the cache); 4 sequences at 128 positions (1.3 MB) 1.04x; the 1.1B shape (5.3 MB
# a layer) one sequence 1.02-1.08x at 8-1024 positions, 4 sequences 1.13x.
MIN_SPLIT_BYTES = 2 << 20  # one sequence
MIN_SPLIT_BYTES_BATCH = 1 << 20  # several: their caches' share of the work splits too


class SplitAttention:
    """`heads[slot]` = [kv0, kv1) per worker slot and `own` the coordinator's range; `steps`: the
    model's native step objects (one per layer), which compute the coordinator's share."""

    def __init__(self, bell: CoordinatorBell, buffers: SharedBuffers, pool: KvPool, steps: list[AttentionStep],
                 heads: dict[int, tuple[int, int]], own: tuple[int, int], stats: ExchangeStats,
                 every_token: bool = False):
        """every_token: split every decoded token's step whatever it costs (input sparsity: only
        the shares carry input-major twins, so the coordinator's whole-head step would read densely)."""
        self.bell, self.buffers, self.pool, self.steps, self.own, self.stats = bell, buffers, pool, steps, own, stats
        self.part = np.array(sorted(heads), dtype=np.intp)
        for s in steps:
            s.keep_output_columns(*own)
        self.scratch = np.empty((MAX_SMALL_BATCH, buffers.layout.hidden), np.float32)
        s = pool.shape
        self.weight_bytes = steps[0].weight_bytes  # one layer's Q, K, V and output matrices
        self.kv_bytes_per_pos = 2 * 4 * s.n_kv * s.head_dim  # keys and values of one position
        self.min_bytes = (MIN_SPLIT_BYTES, MIN_SPLIT_BYTES_BATCH)  # (one sequence, several)
        self.max_tokens = min(MAX_SMALL_BATCH, buffers.layout.max_tokens)  # rows of a step in shared memory
        self.every_token = every_token

    def pays(self, pos: np.ndarray, prompt: bool = False) -> bool:
        """Whether splitting a step of tokens at `pos` is worth its extra exchange a layer: one
        token each of several sequences (their weights read once), or `prompt`: consecutive
        tokens of one, whose products cost about the weights' bytes once per token."""
        if len(pos) > self.max_tokens:
            return False
        if self.every_token and len(pos) == 1 and not prompt:
            return True
        work = self.weight_bytes * (len(pos) if prompt else 1) + self.kv_bytes_per_pos * int(pos.sum() + len(pos))
        return work >= self.min_bytes[len(pos) > 1]

    def begin(self, pos: np.ndarray, caches: np.ndarray) -> "SplitStep":
        """A decode step of sequences at `pos` with pool caches `caches` (int64): their (position,
        cache) go into shared memory once for every layer of the step."""
        kp, vp = self.pool.addresses(0, caches)  # checks the indices; layer i adds i layers
        self.buffers.seq[:len(pos), 0], self.buffers.seq[:len(pos), 1] = pos, caches
        return SplitStep(pos, kp, vp, self.pool.shape.layer_bytes)

    def __call__(self, layer: int, h: np.ndarray, step: "SplitStep") -> None:
        """h (B, hidden) float32, contiguous: the step's residuals, plus their attention in place."""
        t0 = time.perf_counter()
        B, buf = len(h), self.buffers
        buf.x[:B] = h
        posted = self.bell.post(StepKind.ATTENTION, layer, B, True, False, self.part)
        own, off = self.scratch[:B], layer * step.layer_bytes
        self.steps[layer].part(h, step.pos, step.kp + off, step.vp + off, *self.own, own)
        self.bell.wait(posted.step, self.part)
        for slot in self.part:
            own += buf.out[slot, :B]
        h += own
        self.stats.attn_us.append((time.perf_counter() - t0) * 1e6)


class SplitStep(NamedTuple):
    pos: np.ndarray  # (B,) int64 positions
    kp: np.ndarray  # (B,) int64 addresses of layer 0's keys in each sequence's cache
    vp: np.ndarray  # and of its values
    layer_bytes: int  # from one layer's keys (or values) to the next
