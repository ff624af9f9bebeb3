"""`OaiExpertsLayer`: gpt-oss's routed layer (llama.cpp's LLM_FFN_SWIGLU_OAI_MOE with
LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT; transformers' GptOssMLP), one process's share:

    logits = router x + router_bias; the k largest (ties to the lower index); w = softmax of those k
    y = sum over them of w_e * (down_e[:, own] h_e + [own starts at 0] down_bias_e)
    h_e = (clamp(up_e[own] x + bu, -L, L) + 1) * g * sigmoid(1.702 g),  g = min(gate_e[own] x + bg, L)

The down bias is added once, by the process whose range starts the expert's neurons; every
process routes each token itself alike (float64 sums a row at a time, whatever the batch).

The products are the native kernels' on the file's blocks (MXFP4 read in place): a token alone
through matvec, the tokens of a batch or prompt that chose the same expert through matmul (its
rows read once for up to MAX_SMALL_BATCH tokens), which gives each token what matvec gives it,
so a token's output is the same bit for bit alone or in a batch (continuous batching must not
change a reply); the biases, the clamp and the weighted sum are numpy on each token's vector
of the owned neurons. No fused native step (moe_token) takes the biases
and the clamp yet: a call per product.
"""
from __future__ import annotations

import numpy as np

from .kernels import MAX_SMALL_BATCH
from .experts import ExpertsLayer, dealt

SWIGLU_ALPHA = np.float32(1.702)  # gpt-oss's sigmoid gain (transformers' swiglu_alpha; llama.cpp's constant)


def route_softmax_weight(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(T, E) router logits -> the k largest of each row (ties to the lower index) and the
    softmax over those k alone: (T, k) int32, (T, k) float32."""
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :k].astype(np.int32)
    top = np.take_along_axis(logits, ids, axis=1)
    e = np.exp(top - top[:, :1])
    return ids, (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


def _dense_only(active, threshold) -> None:
    """gpt-oss's experts decode densely: no predictor's mask, no CATS threshold (not calibrated)."""
    if active is not None or threshold is not None:
        raise ValueError("gpt-oss's experts decode densely within each chosen expert (no masks or thresholds)")


class OaiRouter:
    """Layer `layer`'s router with its bias: x (T, hidden) -> route_softmax_weight of its logits,
    float64 sums a row at a time (every process, and `sparseinfer profile`, alike)."""

    def __init__(self, store, layer: int):
        f64 = lambda n: np.ascontiguousarray(store.matrix(f"blk.{layer}.{n}"), dtype=np.float64)  # noqa: E731
        self.w, self.b = f64("ffn_gate_inp.weight"), f64("ffn_gate_inp.bias")

    def __call__(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        x64 = np.asarray(x, dtype=np.float64)
        logits = np.array([self.w @ row for row in x64]).reshape(len(x64), -1) + self.b
        return route_softmax_weight(logits, k)


class OaiExpertsLayer(ExpertsLayer):
    """ExpertsLayer with gpt-oss's routing, expert biases and clamped SwiGLU (module doc)."""

    def __init__(self, store, layer: int, own: range, fast: bool, scratch, cfg, row_layout: str = "",
                 deal: tuple[int, int] | None = None):
        # fast mode's layouts as a dense FileLayer's (MXFP4 rows interleaved 16 by 16 where the
        # level has the tiles: one token's expert products 1.75x the file rows' speed, 2880 x
        # 2880 on one AVX2 core); dealt (ExpertsLayer), each expert whole
        super().__init__(store, layer, own, fast, scratch, cfg, row_layout, deal=deal)
        own = self.own
        self.fast = fast
        self.calls = [(e.gate.prepare(own, fast=fast), e.up.prepare(own, fast=fast),
                       e.down.prepare(None, own, fast=fast)) for e in self.experts]
        p = f"blk.{layer}."
        self.biased_router = OaiRouter(store, layer)
        f32 = lambda n: np.ascontiguousarray(store.matrix(p + n), dtype=np.float32)  # noqa: E731
        sl = slice(own.start, own.stop)
        self.gate_b, self.up_b = f32("ffn_gate_exps.bias")[:, sl], f32("ffn_up_exps.bias")[:, sl]
        # the down bias once across the processes: by the one whose range starts the neurons (dealt:
        # every process, each expert being computed by one of them)
        self.down_b = f32("ffn_down_exps.bias") if own.start == 0 else None
        self.limit = np.float32(cfg.swiglu_limit)

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The experts of each row of x (T, hidden) and their weights: (T, k) int32, (T, k) float32."""
        return self.biased_router(x, self.k)

    def _glu(self, e: int, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        """The clamped SwiGLU of one token's gate and up products (biases added here), float32."""
        g = np.minimum(g + self.gate_b[e], self.limit)
        u = np.clip(u + self.up_b[e], -self.limit, self.limit)
        return ((u + np.float32(1)) * (g * (np.float32(1) / (np.float32(1) + np.exp(-(g * SWIGLU_ALPHA)))))).astype(
            np.float32)

    def _share(self, e: int, x: np.ndarray) -> np.ndarray:
        """One token's share of expert e (before its weight), down bias included where owned."""
        gate, up, down = self.calls[e]
        y = down(self._glu(e, gate(x), up(x)))
        return y + self.down_b[e] if self.down_b is not None else y

    def _shares(self, e: int, X: np.ndarray) -> np.ndarray:
        """Several tokens' shares of expert e, (B, hidden), B <= MAX_SMALL_BATCH: its rows read once
        for all (the kernels' matmul gives each token what matvec gives it alone, and the SwiGLU
        is each token's own vector, as _share's), so each row is _share's, bit for bit."""
        ex = self.experts[e]
        G = ex.gate.matmul(X, rows=self.own, fast=self.fast)
        U = ex.up.matmul(X, rows=self.own, fast=self.fast)
        H = np.stack([self._glu(e, G[b], U[b]) for b in range(len(X))])
        Y = ex.down.matmul(H, cols=self.own, fast=self.fast)
        return Y + self.down_b[e] if self.down_b is not None else Y

    def _rows(self, xs: np.ndarray, out: np.ndarray) -> int:
        """out[t] = token t's share, as each token alone: the tokens that chose an expert through
        its rows together, MAX_SMALL_BATCH at a time."""
        ids, weights = self.route(xs)
        pick = dealt(ids, self.owned, self.deal)  # every choice, or this process's dealt ones
        self.counts += np.bincount(ids[pick], minlength=len(self.counts))
        parts = np.zeros((len(xs), self.k, xs.shape[1]), np.float32)  # zero where another process's
        for e in np.unique(ids[pick]):
            ts, js = np.nonzero((ids == e) & pick)
            for a in range(0, len(ts), MAX_SMALL_BATCH):
                t, j = ts[a:a + MAX_SMALL_BATCH], js[a:a + MAX_SMALL_BATCH]
                if len(t) == 1:
                    parts[t[0], j[0]] = self._share(int(e), xs[t[0]])
                else:
                    parts[t, j] = self._shares(int(e), np.ascontiguousarray(xs[t]))
        out[:len(xs)] = 0.0
        for j in range(self.k):
            out[:len(xs)] += weights[:, j, None] * parts[:, j]
        return int(pick.sum()) * len(self.own)

    def token_into(self, x: np.ndarray, activation: str, active: np.ndarray | None, threshold: float | None,
                   out: np.ndarray) -> int:
        _dense_only(active, threshold)
        return self._rows(np.ascontiguousarray(x, dtype=np.float32)[None], out[None])

    def batch_into(self, x: np.ndarray, activation: str, active: np.ndarray | None, threshold: float | None,
                   out: np.ndarray) -> int:
        _dense_only(active, threshold)
        return self._rows(np.ascontiguousarray(x, dtype=np.float32), out)

    def step(self, x: np.ndarray, activation: str, active: np.ndarray | None,
             threshold: float | None) -> tuple[np.ndarray, int]:
        _dense_only(active, threshold)
        xs = np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty_like(xs)
        return y, self._rows(xs, y)
