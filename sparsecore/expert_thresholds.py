"""CATS thresholds of a routed layer's experts (sparsecore/experts.py ExpertsLayer): the forms a
step's threshold takes, and where a process finds them.

`sparseinfer calibrate` stores a threshold per (layer, expert) (coordinator/tools/calibrate.py
expert_levels): an expert's gate activations have their own scale, so the layer's one threshold
would leave some experts nearly dense and others nearly empty. The coordinator writes the level's
into shared memory (protocol.shm_layout SharedBuffers.expert_thresholds, one row of E floats a
layer), where every process holding expert rows reads them at each threshold step; the native
token step (sparsecore/kernels/moe_step.c moe_token) sets each chosen expert's before its FFN.
"""
from __future__ import annotations

import numpy as np


def per_expert(threshold, flat: np.ndarray, mask=None) -> np.ndarray | None:
    """A step's `threshold` as one float32 per expert (E, contiguous), or None (dense): None; a
    float, every expert's (written into `flat`, the layer's E-float scratch); or E values (the
    layer's row of shared memory). A negative value leaves that expert dense. A predictor's
    `mask` is refused: it is over one FFN's neurons, and a routed layer has E of them."""
    if mask is not None:
        raise ValueError("routed experts take no predictor's mask (the mask is over one FFN's neurons)")
    if threshold is None:
        return None
    if np.ndim(threshold) == 0:
        flat[:] = float(threshold)
        return flat
    t = np.asarray(threshold)
    if t.shape != flat.shape or t.dtype != np.float32 or not t.flags.c_contiguous:
        raise ValueError(f"expert thresholds {t.shape} {t.dtype}: one contiguous float32 per expert ({len(flat)})")
    return t


def of_expert(thr: np.ndarray | None, e: int) -> float | None:
    """Expert e's threshold of a step (None: dense), as its FileLayer takes it."""
    return None if thr is None or thr[e] < 0 else float(thr[e])


def step_threshold(w, buf, layer: int):
    """The threshold a CATS step of `layer` gives its FFN `w` from shared memory `buf`: the
    layer's, or a routed layer's (one with `experts`) row of its experts' where the segment
    holds them."""
    experts = getattr(w, "experts", None)
    if experts is not None and buf.expert_thresholds.shape[1] == len(experts):
        return buf.expert_thresholds[layer]
    return float(buf.thresholds[layer])
