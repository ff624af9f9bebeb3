"""THE per-layer attention step of decoded tokens when their heads are split across processes:
the coordinator's side of the exchange (the workers' side: sparsecore/attn_shard.py).

Per layer (`SplitAttention.__call__`, called by the model for one decoded token or a continuous
batch of them, whose KV caches are in the shared pool):
  1. the residuals go into shared memory with each sequence's (position, cache), the doorbell
     rings (a StepKind.ATTENTION step);
  2. the coordinator computes its own heads' share meanwhile (the same kernel, _kernels.attn_part);
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
from sparsecore.kernels import MAX_SMALL_BATCH, AttentionStep, residual_norm
from sparsecore.kv_pool import KvPool

from .posted_step import run_posted
from .sparse_ffn import ExchangeStats

# Whether a step's split pays for its exchange (`pays`): the thresholds and their measurements are
# coordinator/runtime/decode_plan.py's (MIN_SPLIT_BYTES), passed in with the plan.


class SplitAttention:
    """`heads[slot]` = [h0, h1) (query heads) per worker slot and `own` the coordinator's range; `steps`: the
    model's native step objects (one per layer), which compute the coordinator's share."""

    def __init__(self, bell: CoordinatorBell, buffers: SharedBuffers, pool: KvPool, steps: list[AttentionStep],
                 heads: dict[int, tuple[int, int]], own: tuple[int, int], stats: ExchangeStats,
                 min_bytes: tuple[int, int], every_token: bool = False):
        """min_bytes: the work (bytes) a step of one sequence, of several, must halve to pay for
        the exchange (DecodePlan.split_min_bytes). every_token: split every decoded step whatever it
        costs (DecodePlan.every_token: input sparsity, whose twins only the shares carry, and
        lockstep engines, whose per-layer steps must compute what a lockstep step does)."""
        self.bell, self.buffers, self.pool, self.steps, self.own, self.stats = bell, buffers, pool, steps, own, stats
        self.part = np.array(sorted(heads), dtype=np.intp)
        for s in steps:
            s.keep_output_columns(*own)
        self.scratch = np.empty((MAX_SMALL_BATCH, buffers.layout.hidden), np.float32)
        s = pool.shape
        self.weight_bytes = steps[0].weight_bytes  # one layer's Q, K, V and output matrices
        self.kv_bytes_per_pos = 2 * 4 * s.n_kv * s.head_dim  # keys and values of one position
        self.min_bytes = min_bytes  # (one sequence, several)
        self.max_tokens = min(MAX_SMALL_BATCH, buffers.layout.max_tokens)  # rows of a step in shared memory
        self.every_token = every_token

    def pays(self, pos: np.ndarray, prompt: bool = False) -> bool:
        """Whether splitting a step of tokens at `pos` is worth its extra exchange a layer: one
        token each of several sequences (their weights read once), or `prompt`: consecutive
        tokens of one, whose products cost about the weights' bytes once per token."""
        if len(pos) > self.max_tokens:
            return False
        if self.every_token and not prompt:
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
        own, off = self.scratch[:B], layer * step.layer_bytes
        run_posted(self.bell, StepKind.ATTENTION, layer, B, self.part,
                   lambda posted: self.steps[layer].part(h, step.pos, step.kp + off, step.vp + off, *self.own, own))
        step = self.steps[layer]
        post = step.extra_arrays.get("post_norm")
        if post is None and not step.extras.out_scale:
            for slot in self.part:
                own += buf.out[slot, :B]
            h += own
        else:  # the output norm (gemma3) and residual scale (granite) apply to the sum of the shares
            residual_norm(h, [own, *(buf.out[slot, :B] for slot in self.part)], None, step.eps, post,
                          step.extras.out_scale)
        self.stats.attn_us.append((time.perf_counter() - t0) * 1e6)


class SplitStep(NamedTuple):
    pos: np.ndarray  # (B,) int64 positions
    kp: np.ndarray  # (B,) int64 addresses of layer 0's keys in each sequence's cache
    vp: np.ndarray  # and of its values
    layer_bytes: int  # from one layer's keys (or values) to the next
