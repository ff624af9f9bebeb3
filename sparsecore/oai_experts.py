"""`OaiExpertsLayer`: gpt-oss's routed layer (llama.cpp's LLM_FFN_SWIGLU_OAI_MOE with
LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT; transformers' GptOssMLP), one process's share:

    logits = router x + router_bias; the k largest (ties to the lower index); w = softmax of those k
    y = sum over them of w_e * (down_e[:, own] h_e + [own starts at 0] down_bias_e)
    h_e = (clamp(up_e[own] x + bu, -L, L) + 1) * g * sigmoid(1.702 g),  g = min(gate_e[own] x + bg, L)

The down bias is added once across the processes, by the one whose range starts the expert's
neurons (dealt: by the process that computes the expert); every process routes each token
itself alike.

Everything runs ExpertsLayer's native steps: the routing with the router's bias and
MOE_SOFTMAX_WEIGHT (moe_step.c), the FFN records' ACT_OAI activation, which reads each expert's
row of `expert_biases` (gate's and up's biases of the owned neurons, then down's) and the clamp
`limit` (ffn_step.c). A token and a batch of up to MAX_SMALL_BATCH take moe_token and moe_batch,
so a token's output is the same bit for bit alone or in a batch (continuous batching must not
change a reply); a longer prompt groups its tokens by expert over the whole prompt, each
expert's rows read once for up to MAX_SMALL_BATCH of its tokens (ffn_batch).
"""
from __future__ import annotations

import numpy as np

from .kernels import MAX_SMALL_BATCH, ffn_batch, ptr
from .experts import ExpertsLayer, dealt


def _dense_only(active, threshold) -> None:
    """gpt-oss's experts decode densely: no predictor's mask, no CATS threshold (not calibrated)."""
    if active is not None or threshold is not None:
        raise ValueError("gpt-oss's experts decode densely within each chosen expert (no masks or thresholds)")


class OaiExpertsLayer(ExpertsLayer):
    """ExpertsLayer with gpt-oss's routing, expert biases and clamped SwiGLU (module doc)."""

    def __init__(self, store, layer: int, own: range, fast: bool, scratch, cfg, row_layout: str = "",
                 deal: tuple[int, int] | None = None):
        # fast mode's layouts as a dense FileLayer's (MXFP4 rows interleaved 16 by 16 where the
        # level has the tiles: one token's expert products 1.75x the file rows' speed, 2880 x
        # 2880 on one AVX2 core); dealt (ExpertsLayer), each expert whole
        super().__init__(store, layer, own, fast, scratch, cfg, row_layout, deal=deal)
        own = self.own
        f32 = lambda n: np.ascontiguousarray(store.matrix(f"blk.{layer}.{n}"), dtype=np.float32)  # noqa: E731
        sl, down = slice(own.start, own.stop), f32("ffn_down_exps.bias")
        # the down bias once across the processes: by the one whose range starts the neurons (dealt:
        # every process, each expert being computed by one of them); zeros elsewhere add nothing
        self.expert_biases = np.ascontiguousarray(np.concatenate(
            [f32("ffn_gate_exps.bias")[:, sl], f32("ffn_up_exps.bias")[:, sl],
             down if own.start == 0 else np.zeros_like(down)], axis=1))
        self.limit = float(cfg.swiglu_limit)  # read by the records made at a layer's first step

    def _biased(self, ffn):
        """The record with every expert's biases (moe_token and moe_batch take expert e's row)
        and the clamp."""
        ffn.bias, ffn.limit = ptr(self.expert_biases), self.limit
        return ffn

    def _rows(self, xs: np.ndarray, out: np.ndarray) -> int:
        """out[t] = token t's share, the tokens that chose an expert through its rows together,
        MAX_SMALL_BATCH at a time (a prompt)."""
        ids, weights = self.route(xs)
        pick = dealt(ids, self.owned, self.deal)  # every choice, or this process's dealt ones
        self.counts += np.bincount(ids[pick], minlength=len(self.counts))
        parts = np.zeros((len(xs), self.k, xs.shape[1]), np.float32)  # zero where another process's
        for e in np.unique(ids[pick]):
            ts, js = np.nonzero((ids == e) & pick)
            ex = self.experts[e]
            for a in range(0, len(ts), MAX_SMALL_BATCH):
                t, j = ts[a:a + MAX_SMALL_BATCH], js[a:a + MAX_SMALL_BATCH]
                parts[t, j] = ffn_batch(ex.gate, ex.up, ex.down, np.ascontiguousarray(xs[t]), self.own, "swiglu_oai",
                                        ex.scratch, fast=ex.fast, bias=self.expert_biases[e], limit=self.limit)[0]
        out[:len(xs)] = 0.0
        for j in range(self.k):
            out[:len(xs)] += weights[:, j, None] * parts[:, j]
        return int(pick.sum()) * len(self.own)

    def token_into(self, x: np.ndarray, activation: str, active: np.ndarray | None, threshold: float | None,
                   out: np.ndarray, router_x: np.ndarray | None = None) -> int:
        _dense_only(active, threshold)
        return super().token_into(x, "swiglu_oai", None, None, out)

    def batch_into(self, x: np.ndarray, activation: str, active: np.ndarray | None, threshold: float | None,
                   out: np.ndarray, router_x: np.ndarray | None = None) -> int:
        _dense_only(active, threshold)
        return super().batch_into(x, "swiglu_oai", None, None, out)

    def step(self, x: np.ndarray, activation: str, active: np.ndarray | None,
             threshold: float | None, router_x: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        _dense_only(active, threshold)
        xs = np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty_like(xs)
        if len(xs) <= MAX_SMALL_BATCH:  # the native batch step, as a continuous batch's
            return y, self.batch_into(xs, activation, None, None, y)
        return y, self._rows(xs, y)
