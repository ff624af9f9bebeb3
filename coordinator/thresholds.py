"""SwiGLU sparsity without training (CATS, arXiv 2404.08763): per-layer magnitude thresholds.

A neuron is skipped for a token when |act(gate x)| is below its layer's threshold, so its up
row and down column are never read. Calibration runs the dense model over calibration text,
records every layer's FFN inputs, and sets each layer's threshold at the quantile of
|act(gate x)| equal to the target sparsity. Thresholds for a grid of sparsities are stored
beside the model in `<model>.thresholds.json`, so any of them can be chosen at run time.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from sparsecore.ffn import ACTIVATIONS
from sparsecore.tensors import TensorStore

FORMAT = "sparseinfer-thresholds/1"
DEFAULT_LEVELS = tuple(round(0.1 * i, 2) for i in range(1, 10))


def thresholds_path(model: Path) -> Path:
    return Path(str(model) + ".thresholds.json")


def level_key(sparsity: float) -> str:
    return f"{sparsity:.2f}"


def load_thresholds(model: Path, sparsity: float, path: Path | None = None) -> list[float]:
    path = path or thresholds_path(model)
    if not path.exists():
        raise ValueError(f"{path}: no calibrated thresholds; run `sparseinfer calibrate -m {model} "
                         f"--sparsity {sparsity}` first")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: format {data.get('format')!r}, expected {FORMAT!r}")
    levels = data.get("levels", {})
    key = level_key(sparsity)
    if key not in levels:
        raise ValueError(f"{path}: no thresholds for sparsity {key} (calibrated: {', '.join(sorted(levels))}); "
                         f"run `sparseinfer calibrate --sparsity {sparsity}`")
    return [float(t) for t in levels[key]]


def calibrate(engine, chunks: list[list[int]], levels=DEFAULT_LEVELS) -> dict:
    """Thresholds per level and layer from the dense model's activations on `chunks`."""
    cfg = engine.cfg
    inputs: dict[int, list[np.ndarray]] = {i: [] for i in range(cfg.n_layers)}
    engine.set_sparsity(None)
    engine.ffn_observer = lambda layer, x, *_: inputs[layer].append(x.copy())
    t0 = time.perf_counter()
    try:
        for c in chunks:
            engine.forward_logits(c)
    finally:
        engine.ffn_observer = None
    store = TensorStore(engine.path, engine.reader)
    act = ACTIVATIONS[cfg.activation]
    table = {level_key(s): [] for s in levels}
    for layer in range(cfg.n_layers):
        x = torch.from_numpy(np.concatenate(inputs.pop(layer)))
        gate = torch.from_numpy(store.matrix(f"blk.{layer}.ffn_gate.weight"))
        mags = act(x @ gate.T).abs().flatten()
        qs = torch.quantile(mags[torch.randperm(len(mags), generator=torch.Generator().manual_seed(0))[: 1 << 24]],
                            torch.tensor(levels, dtype=torch.float32))
        for s, q in zip(levels, qs.tolist()):
            table[level_key(s)].append(q)
    return {
        "format": FORMAT,
        "model": engine.path.name,
        "model_bytes": engine.path.stat().st_size,
        "activation": cfg.activation,
        "tokens": int(sum(len(c) for c in chunks)),
        "seconds": round(time.perf_counter() - t0, 1),
        "levels": table,
    }


def save(model: Path, table: dict, path: Path | None = None) -> Path:
    path = path or thresholds_path(model)
    old = json.loads(path.read_text()) if path.exists() else {}
    if old.get("format") == FORMAT and old.get("model_bytes") == table["model_bytes"]:
        old["levels"].update(table["levels"])  # keep levels calibrated earlier
        table = {**table, "levels": old["levels"]}
    path.write_text(json.dumps(table, indent=1))
    return path
