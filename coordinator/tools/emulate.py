"""Input sparsity (TEAL) emulated in float32, for quality measurements on whole prompts.

While decoding, the kernels skip, per token, the inputs of each matrix at or below its
layer's threshold (sparsecore/input_sparsity.py). Here the same rule zeroes those inputs in
the model's torch attention (Transformer.input_filter) and in an FFN computed on the
coordinator from the dequantized matrices, so a teacher-forced prompt gets the logits each of
its tokens would get decoded that way (up to the kernels' 8-bit activation rounding in fast
mode: +0.24 % held-out perplexity dense). It also counts the fraction of inputs kept per site.
Only tools use it (perplexity, calibrate's quality pass): a one-layer FFN of a 1.1B model takes
140 MB of float32 here.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch

from protocol.shm_layout import INPUT_SITES
from sparsecore.ffn import ACTIVATIONS, combine
from sparsecore.lm_head import HEAD_CANDIDATES

from . import observe

KEEP_BYTES = 1 << 30  # float32 FFN matrices MaskedFfn keeps between chunks, at most


class InputMasks:
    """The rule for each (layer, site): keep inputs with |x| > threshold; counts what it kept."""

    def __init__(self, thresholds: list[list[float]]):
        self.t = np.asarray(thresholds, dtype=np.float32)  # (layers, INPUT_SITES)
        self.kept = np.zeros(self.t.shape, np.int64)
        self.seen = np.zeros(self.t.shape, np.int64)
        self.head = None  # the CandidateHead, where the lm_head is emulated too

    def __call__(self, layer: int, site: str, x: torch.Tensor) -> torch.Tensor:
        k = INPUT_SITES.index(site)
        t = float(self.t[layer, k])
        if t < 0:
            return x
        keep = x.abs() > t
        self.kept[layer, k] += int(keep.sum())
        self.seen[layer, k] += keep.numel()
        return x * keep

    def head_kept(self) -> float:
        """The share of the lm_head's inputs read (1 where the head is dense)."""
        return self.head.kept / max(1, self.head.seen) if self.head is not None else 1.0

    def kept_fraction(self) -> np.ndarray:
        """(layers, INPUT_SITES): the fraction of inputs read (1 where nothing was seen)."""
        return np.where(self.seen > 0, self.kept / np.maximum(self.seen, 1), 1.0)


class MaskedFfn:
    """The model's FFN in float32 on the coordinator, its gate/up inputs and down input masked."""

    def __init__(self, engine, masks: InputMasks):
        cfg = observe.config(engine)
        self.masks, self.act, self.activation, self.mode = masks, ACTIVATIONS[cfg.activation], cfg.activation, cfg.ffn_gate
        # every layer's float matrices kept where they are small (SmolLM2: 0.3 GB), else read
        # from the file at each use
        self.keep = cfg.n_layers * 3 * cfg.hidden * cfg.n_ff * 4 <= KEEP_BYTES
        self.gates = observe.GateActivity(engine, keep=self.keep)
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _up_down(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        got = self.kept.get(layer)
        if got is None:
            up = None if self.mode == "none" else self.gates.matrix(layer, "ffn_up")
            got = (up, self.gates.down(layer))
            if self.keep:
                self.kept[layer] = got
        return got

    def __call__(self, layer: int, xs: np.ndarray, pre_norm: np.ndarray, decode=None) -> np.ndarray:
        up, down = self._up_down(layer)
        x = self.masks(layer, "ffn_in", torch.from_numpy(xs))
        h = combine(self.act(x @ self.gates.gate(layer).T), x, up, self.activation, self.mode)
        return (self.masks(layer, "ffn_h", h) @ down.T).numpy()


class CandidateHead:
    """The lm_head as sparsecore.lm_head.HeadCandidates computes it: every row's logit from the
    inputs above the threshold, then the HEAD_CANDIDATES best exactly. One list of candidates
    for the whole vocabulary, where each process that holds rows keeps its own HEAD_CANDIDATES:
    this emulation is the stricter one."""

    def __init__(self, engine, threshold: float):
        self.w, self.t = observe.GateActivity(engine).head(), float(threshold)
        self.kept = self.seen = 0

    def __call__(self, hs: np.ndarray) -> np.ndarray:
        h = torch.from_numpy(hs)
        keep = h.abs() > self.t
        self.kept += int(keep.sum())
        self.seen += keep.numel()
        logits = (h * keep) @ self.w.T
        best = logits.topk(min(HEAD_CANDIDATES, logits.shape[1]), dim=1).indices
        exact = torch.einsum("th,tkh->tk", h, self.w[best])
        return logits.scatter_(1, best, exact).numpy()


@contextlib.contextmanager
def input_sparsity(engine, thresholds: list[list[float]], head: float | None = None) -> Iterator[InputMasks]:
    """Within the block the engine's prompts run with input sparsity at `thresholds` (per layer,
    one per INPUT_SITES; negative: that site dense) and, with `head`, the lm_head's candidates
    (CandidateHead), emulated; yields the masks' counters (`head_kept`: the head's share read)."""
    masks = InputMasks(thresholds)
    model = observe.model(engine)
    old_ffn = model.ffn
    model.ffn, model.input_filter = MaskedFfn(engine, masks), masks
    try:
        with contextlib.ExitStack() as stack:
            if head is not None and head >= 0:
                cand = CandidateHead(engine, head)
                stack.enter_context(observe.head_replaced(engine, cand))
                masks.head = cand
            yield masks
    finally:
        model.ffn, model.input_filter = old_ffn, None
