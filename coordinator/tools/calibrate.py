"""SwiGLU sparsity without training (CATS, arXiv 2404.08763): per-layer magnitude thresholds.

A neuron is skipped for a token when |act(gate x)| is below its layer's threshold, so its up
row and down column are never read. Calibration runs the dense model over calibration text,
records every layer's FFN inputs, and sets each layer's threshold at the quantile of
|act(gate x)| equal to the target sparsity. Thresholds for a grid of sparsities are stored
beside the model in `<model>.thresholds.json` (coordinator.model_files), so any of them can be
chosen at run time.
"""
from __future__ import annotations

import time

import numpy as np

from ..model_files import THRESHOLDS_FORMAT, level_key
from . import observe

DEFAULT_LEVELS = tuple(round(0.1 * i, 2) for i in range(1, 10))


def calibrate(engine, chunks: list[list[int]], levels=DEFAULT_LEVELS) -> dict:
    """Thresholds per level and layer from the dense model's activations on `chunks`."""
    cfg = observe.config(engine)
    path = observe.model_path(engine)
    inputs: dict[int, list[np.ndarray]] = {i: [] for i in range(cfg.n_layers)}
    t0 = time.perf_counter()
    n_tokens = observe.dense_run(engine, chunks, lambda layer, x, *_: inputs[layer].append(x.copy()))
    gates = observe.GateActivity(engine)
    table = {level_key(s): [] for s in levels}
    for layer in range(cfg.n_layers):
        mags = gates(layer, np.concatenate(inputs.pop(layer)))
        for s, q in zip(levels, observe.magnitude_quantiles(mags, levels).tolist()):
            table[level_key(s)].append(q)
    return {
        "format": THRESHOLDS_FORMAT,
        "model": path.name,
        "model_bytes": path.stat().st_size,
        "activation": cfg.activation,
        "tokens": n_tokens,
        "seconds": round(time.perf_counter() - t0, 1),
        "levels": table,
    }
