"""Real worker processes and the coordinator's side of the exchange, wired as the engine wires
them (WorkerPool + SparseFfn.over + SplitHead.over), without the attention model around them."""
from __future__ import annotations

import numpy as np
from gguf import GGUFReader

from coordinator.placement import Plan, split_vocabulary
from coordinator.sparse_ffn import SparseFfn, SplitHead
from coordinator.worker_pool import WorkerPool


class Rig:
    """Attributes the tests read of the pool (buffers, plan, workers, ...) are the pool's."""

    def __init__(self, path, plan: Plan, hidden: int, max_tokens: int, split_lm_head: bool = False, **kw):
        head_rows = {}
        if split_lm_head:
            names = {t.name: t for t in GGUFReader(path).tensors}
            head = names.get("output.weight") or names["token_embd.weight"]
            head_rows = split_vocabulary(plan, int(head.shape[1]), max_tokens * hidden)
        self.pool = WorkerPool(path, plan, hidden=hidden, max_tokens=max_tokens, head_rows=head_rows, **kw)
        try:
            self.pool.wait_ready()
            self.ffn = SparseFfn.over(self.pool, weights=kw.get("weights", "f32"))
            self.head = SplitHead.over(self.pool, self.ffn)
        except BaseException:
            self.pool.close()
            raise

    def __getattr__(self, name):
        return getattr(self.pool, name)

    @property
    def stats(self):
        return self.ffn.stats

    def run_ffn(self, layer: int, n_tokens: int, dense: bool = True, threshold: bool = False) -> np.ndarray:
        return self.ffn.exchange(layer, n_tokens, dense, threshold)

    def close(self) -> None:
        self.pool.close()
