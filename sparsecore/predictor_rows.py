"""A shard's share of PowerInfer's activation predictors: which of ITS neurons a token will use.

    rows = PredictorRows.load(store, layer, own, threshold, fast)   # fc1 whole, fc2's rows [own]
    mask = rows.mask_for(pre_norm)     # uint8 over the layer's neurons, set within [own] only

A predictor scores every neuron as fc2 @ relu(fc1 @ h) (h: the residual before ffn_norm) and
marks it active above a threshold. Scoring is a row product per neuron, so each process scores
the neurons it owns while the others score theirs: fc1 (rank x hidden, small) is read by every
process, fc2's rows once across them. On the coordinator alone it was a serial step of every
layer while the workers' cores waited (coordinator/model/predictor.py keeps that path for predictors
of other types or swapped in at run time). Same kernels and arithmetic as that path, so a
neuron gets the same decision either way; but in fast mode on AVX-512 VNNI, where the rows
here are interleaved 16 by 16 (the same integers, another float order: a score within
rounding of the threshold may fall on the other side).
"""
from __future__ import annotations

import numpy as np

from .gguf_file import field_value
from .kernels import FileMatrix, supports
from .tensors import TensorStore

def has_predictors(reader) -> bool:
    """Whether a model file carries PowerInfer's predictors (blk.N.fc1/fc2)."""
    return any(t.name == "blk.0.fc1.weight" for t in reader.tensors)


THRESHOLD_KEY = "powerinfer.sparse_threshold"  # one threshold for every layer (PowerInfer's)
PER_LAYER_KEY = "sparseinfer.predictor.thresholds"  # per layer, from predictor training


def predictor_thresholds(reader, n_layers: int) -> list[float] | None:
    """Per-layer thresholds from a predictor file's metadata (default 0 for every layer), or
    None when the per-layer list does not have `n_layers` entries."""
    thr = field_value(reader, PER_LAYER_KEY)
    if thr is None:
        thr = [float(field_value(reader, THRESHOLD_KEY, 0.0))] * n_layers
    return [float(t) for t in thr] if len(thr) == n_layers else None


def native_predictor(store: TensorStore, layer: int) -> bool:
    """Whether the kernels read this layer's fc1 and fc2 in the file's blocks."""
    names = (f"blk.{layer}.fc1.weight", f"blk.{layer}.fc2.weight")
    return all(store.has(n) and supports(store.info(n).tensor_type) for n in names)


class PredictorRows:
    def __init__(self, fc1: FileMatrix, fc2: FileMatrix, own: range, threshold: float, fast: bool):
        if fc1.cols % 32 or fc2.cols != fc1.rows or not 0 <= own.start <= own.stop <= fc2.rows:
            raise ValueError(f"predictor {fc1.name} {fc1.rows}x{fc1.cols}, {fc2.name} {fc2.rows}x{fc2.cols} "
                             f"and neurons {own} disagree")
        self.own, self.threshold = own, float(threshold)
        # Fast mode reads both whole (fc2: from the group of 16 rows holding own.start on)
        # interleaved where it can (FileMatrix.for_fast_products): on the 1.1B ReLU shape they
        # are a fifth of a token's bytes, and one-row products read them at half the speed.
        if fast:
            fc1, fc2 = fc1.for_fast_products(), fc2.for_fast_products(range(own.start // 16 * 16, own.stop))
        start = fc2.row_range.start if fc2.interleaved else own.start
        self._fc1 = fc1.prepare(fast=fast)
        # fc2's rows this shard reads: from the group of 16 holding own.start where interleaved
        self.fc2_rows = range(start, own.stop)
        self._fc2 = fc2.prepare(rows=self.fc2_rows, fast=fast)
        self._skip = own.start - start  # scores of rows before own.start: not ours
        self.mask = np.zeros(fc2.rows, np.uint8)  # outside [own]: 0, never written

    @classmethod
    def load(cls, store: TensorStore, layer: int, own: range, threshold: float, fast: bool) -> "PredictorRows":
        p = f"blk.{layer}."
        return cls(FileMatrix(store.info(p + "fc1.weight")), FileMatrix(store.info(p + "fc2.weight")), own,
                   threshold, fast)

    def mask_for(self, pre_norm: np.ndarray) -> np.ndarray:
        """pre_norm: (hidden,) float32, contiguous. Returns the mask, a buffer reused per call."""
        r = self._fc1(pre_norm)
        np.maximum(r, 0, out=r)
        scores = self._fc2(r)[self._skip:]
        np.greater(scores, self.threshold, out=self.mask[self.own.start:self.own.stop].view(np.bool_))
        return self.mask
