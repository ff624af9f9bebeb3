"""The coordinator's side of a lockstep decode step: one post for every layer of a decoded token
(or of a small continuous batch), each process running sparsecore/lockstep.py on its own heads
and neurons and summing the others' shares itself. The per-layer posted steps
(coordinator/runtime/attention_split.py, coordinator/runtime/sparse_ffn.py) stay for everything this does not
cover: prompts, batches beyond the lockstep's rows, a predictor the coordinator scores,
calibration's observer, and cores shared with other programs (waits here are spins).
"""
from __future__ import annotations

import time

import numpy as np

from protocol.doorbell import CoordinatorBell
from protocol.shm_layout import REQ_PARTS, SharedBuffers, StepKind
from sparsecore.lockstep import Lockstep

from .attention_split import SplitAttention, SplitStep
from .posted_step import run_posted
from .sparse_ffn import SparseFfn

# Whether a step runs in lockstep (`usable`): its threshold and measurement are
# coordinator/runtime/decode_plan.py's (MIN_LOCKSTEP_BYTES), passed in with the plan.


class LockstepDecode:
    """`own`: the coordinator's part (its output slot `own.slot`); `part`: the worker slots that
    take part (each holds attention heads and neurons of every layer); `head_rows`: the lm_head's
    vocabulary rows per worker slot where the head is split (the coordinator's own: own.head)."""

    def __init__(self, bell: CoordinatorBell, buffers: SharedBuffers, own: Lockstep, part: np.ndarray,
                 ffn: SparseFfn, attn: SplitAttention, min_bytes: int,
                 head_rows: dict[int, tuple[int, int]] | None = None):
        self.bell, self.buffers, self.own, self.part, self.ffn, self.attn = bell, buffers, own, part, ffn, attn
        self.min_bytes = min_bytes  # a step's attention work it pays from (DecodePlan.lockstep_min_bytes)
        self.parts = sum(1 << int(s) for s in (*part, own.slot))
        self.n_layers = len(own.attn)
        self.steps = 0  # lockstep steps run (benchmarks and tests)
        # The logits as the step's last phase where every part holds head rows and they are all
        # the head's (each part computes its rows where they fit a half slot: Lockstep.head_fits).
        rows = {s: r for s, r in (head_rows or {}).items() if s != own.slot}
        self.head_rows = rows if own.head is not None and set(rows) == {int(s) for s in part} else None

    def head_in_step(self, n_tokens: int) -> bool:
        """Whether a step of n_tokens ends with its logits (one post for the decoded tokens)."""
        return self.head_rows is not None and self.own.head_fits(n_tokens) and all(
            self.own.head_fits(n_tokens, hi - lo) for lo, hi in self.head_rows.values())

    def usable(self, pos: np.ndarray) -> bool:
        """Whether a step of decoded tokens at `pos` (one per sequence) runs in lockstep now."""
        ffn, bell, n_tokens = self.ffn, self.bell, len(pos)
        predict = ffn.predictors is not None
        work = self.attn.weight_bytes + self.attn.kv_bytes_per_pos * int(pos.sum() + n_tokens)
        spinning = bell.spin and not bell.governor.contended  # its waits are spins (sparsecore/lockstep.py)
        return (self.own.fits(n_tokens) and work >= self.min_bytes and spinning and ffn.observer is None
                and (not predict or (ffn.predictors is ffn.shard_predictors and n_tokens == 1)))

    def __call__(self, h: np.ndarray, split: SplitStep) -> np.ndarray | None:
        """h (B, hidden) float32, contiguous: the residuals entering layer 0 (split.pos, the
        caches' addresses: SplitAttention.begin), replaced by those leaving the last layer.
        Returns the step's logits (B, n_vocab) where its last phase computed them (head_in_step),
        else None (the model's head computes them from h)."""
        t0 = time.perf_counter()
        B, buf, ffn = len(h), self.buffers, self.ffn
        predict = ffn.predictors is not None
        buf.x[:B] = h
        buf.request[REQ_PARTS] = self.parts  # before post writes the step number
        step = run_posted(self.bell, StepKind.LOCKSTEP, 0, B, self.part,
                          lambda posted: self.own.run(posted.step, self.parts, h, split.pos, split.kp, split.vp,
                                                      split.layer_bytes, posted.threshold, posted.predict,
                                                      self.bell.watch),
                          dense=not (ffn.thresholds or predict), threshold=ffn.thresholds and not predict,
                          predict=predict)
        n_own, n_active = step.own, step.n_active
        st = ffn.stats
        for i in range(self.n_layers):  # the meters read sums over the layers
            st.tokens[i] = st.tokens.get(i, 0) + B
        st.active[0] = st.active.get(0, 0) + n_active + n_own
        logits = None
        if self.head_in_step(B):  # every part's rows, read once it marked the step done
            own = self.own.head
            logits = np.empty((B, own.stop), np.float32)  # the coordinator's rows end the vocabulary
            logits[:, own.start:] = self.own.head_share(B)
            half = self.own.head_half
            for slot, (lo, hi) in self.head_rows.items():
                logits[:, lo:hi] = Lockstep.head_share_of(buf.out[slot, half * self.own.half:(half + 1) * self.own.half],
                                                          B, hi - lo)
        st.lockstep_us.append((time.perf_counter() - t0) * 1e6)
        self.steps += 1
        return logits
